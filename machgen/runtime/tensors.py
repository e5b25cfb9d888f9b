"""Values that cross between the sampler and its components: numpy arrays
or torch tensors, on the CPU or a GPU.

The sampler does not know which target a component runs on: ONNX Runtime
takes and gives numpy arrays, the ``torch`` target torch tensors that stay
on their GPU (passed through DLPack, never through host memory). The few
operations the sampler and cache policies apply to such values (slicing and
arithmetic work on both) that differ between the two live here. torch is
imported only when a value is a tensor.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def is_torch(value: Any) -> bool:
    return type(value).__module__.partition(".")[0] == "torch"


def as_numpy(value: Any) -> np.ndarray:
    """A numpy view of a CPU value (no copy); a GPU tensor is copied to the host."""
    if is_torch(value):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def as_torch(value: Any, device: Any = None):
    """A torch tensor (a numpy array is wrapped without a copy), on ``device`` when given."""
    import torch

    tensor = value if is_torch(value) else torch.from_numpy(np.ascontiguousarray(value))
    return tensor if device is None else tensor.to(device, non_blocking=True)


def concat(values: Sequence[Any]) -> Any:
    """Rows of ``values`` (all numpy or all torch) joined along the first axis."""
    if is_torch(values[0]):
        import torch

        return torch.cat(list(values), dim=0)
    return np.concatenate(values, axis=0)


def mean_abs(value: Any) -> float:
    return float(abs(value).mean())

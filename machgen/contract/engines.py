"""What a TensorRT engine was built for, and the check the public model
makes at start-up: TensorRT refuses plans from another version with an
error of its own, and a plan tuned for one GPU is wrong for another, so the
server names both and the fix instead. The builder writes the metadata
(machgen/builder/tensorrt_engine.py); the Triton models read it here."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

ENGINE_FILE = "model.plan"
METADATA_FILE = "engine.json"


class EngineMismatch(RuntimeError):
    """An engine was built for another TensorRT version or another GPU."""


@dataclass(frozen=True)
class EngineMetadata:
    tensorrt_version: str
    gpu_name: str
    compute_capability: str  # "9.0"
    precision: str
    refittable: bool
    plugins: tuple[str, ...] = ()

    def write(self, folder: Path) -> None:
        (folder / METADATA_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, folder: Path) -> "EngineMetadata":
        data = json.loads((Path(folder) / METADATA_FILE).read_text())
        return cls(**{**data, "plugins": tuple(data.get("plugins", ()))})


def check_engine(component: str, metadata: EngineMetadata, tensorrt_version: str | None, gpu_name: str | None,
                 compute_capability: str | None) -> None:
    """Refuse an engine built for another TensorRT or GPU, naming both and the fix.
    A value the host cannot tell (None) is not compared."""
    problems = []
    # TensorRT plans load only under the exact version that built them (no version-compatible flag is set).
    if tensorrt_version is not None and tensorrt_version != metadata.tensorrt_version:
        problems.append(f"TensorRT {metadata.tensorrt_version}, this server has {tensorrt_version}")
    if compute_capability is not None and compute_capability != metadata.compute_capability:
        problems.append(f"compute capability {metadata.compute_capability} ({metadata.gpu_name}), "
                        f"this GPU is {compute_capability} ({gpu_name})")
    elif gpu_name is not None and gpu_name != metadata.gpu_name:
        problems.append(f"{metadata.gpu_name} (tactics are timed per GPU model), this GPU is {gpu_name}")
    if problems:
        raise EngineMismatch(f"{component}: the engine was built for " + "; ".join(problems)
                             + ". Rebuild it on this host: machgen-build build ... --target tensorrt")


def host_gpu() -> tuple[str | None, str | None]:
    """(name, compute capability) of this process's GPU, when torch can see one."""
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    major, minor = torch.cuda.get_device_capability()
    return torch.cuda.get_device_name(), f"{major}.{minor}"


def serving_host() -> tuple[str | None, str | None, str | None]:
    """(TensorRT version, GPU name, compute capability) of this process, each
    None where it cannot tell (the server's TensorRT is the container's; its
    Python may not see it)."""
    try:
        import tensorrt
        version = tensorrt.__version__
    except ImportError:
        version = None
    return (version, *host_gpu())


def check_repository_engines(repository: Path, served_models: Mapping[str, str],
                             host: tuple[str | None, str | None, str | None]) -> None:
    """``check_engine`` for every engine a pipeline calls (component name to
    the Triton model serving it), and a clear refusal of an engine without
    its metadata."""
    for name, model in served_models.items():
        folder = Path(repository) / model / "1"
        if not (folder / METADATA_FILE).is_file():
            raise EngineMismatch(f"{name}: {folder} has no {METADATA_FILE}: the engine was not built by "
                                 "machgen-build, so what it was built for is unknown; rebuild it")
        check_engine(name, EngineMetadata.read(folder), *host)

"""SparseAttention as a TensorRT plugin, through TensorRT's Python plugin
API (``tensorrt.plugin``, TensorRT >= 10.7), so that an engine built from
our ONNX files keeps the ``machgen::SparseAttention`` node as the plugin.

The plugin's fields are the schema's attributes (plugins/schema.py): the
registered functions get their signature from ``ATTRIBUTES``, never a
second list. The implementation is the JIT kind: TensorRT calls back into
Python on its stream, which runs the operator's mask prediction and
quantization in torch and the Triton kernel (plugins/triton_kernel.py).
That serves TensorRT from Python (polygraphy, Triton's Python backend). An
ahead-of-time implementation, which Triton's C++ TensorRT backend needs,
must be one kernel: it waits for a kernel that predicts the mask too.

TensorRT cannot be installed on the machines this was written on: nothing
here has run; its tests skip without TensorRT.
"""

from __future__ import annotations

import inspect

from machgen.plugins.schema import ATTRIBUTES, DOMAIN, OP_TYPE, SparseAttentionConfig

PLUGIN_ID = f"{DOMAIN}::{OP_TYPE}"
_PYTHON_TYPES = {"int": int, "float": float, "string": str}
_registered = False


def plugin_signature(tensor_type, *tail: inspect.Parameter, returns=inspect.Signature.empty) -> inspect.Signature:
    """(q, k, v, <schema attributes>, *tail) with the annotations tensorrt.plugin reads."""
    parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=tensor_type)
                  for name in ("q", "k", "v")]
    parameters += [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                     annotation=_PYTHON_TYPES[a.kind]) for a in ATTRIBUTES]
    return inspect.Signature([*parameters, *tail], return_annotation=returns)


def _config(attributes: dict) -> SparseAttentionConfig:
    return SparseAttentionConfig(**{a.name: _PYTHON_TYPES[a.kind](attributes[a.name]) for a in ATTRIBUTES})


def register() -> str:
    """Register the plugin with TensorRT (once per process); returns its id."""
    global _registered
    import tensorrt.plugin as trtp

    if _registered:
        return PLUGIN_ID

    def describe(*args, **kwargs):
        bound = describe.__signature__.bind(*args, **kwargs).arguments
        _config(bound)  # bad attributes fail when the engine is built, not when it runs
        return bound["q"].like()

    describe.__signature__ = plugin_signature(trtp.TensorDesc, returns=trtp.TensorDesc)
    trtp.register(PLUGIN_ID)(describe)

    def run(*args, **kwargs):
        import torch

        from machgen.plugins import triton_kernel

        bound = run.__signature__.bind(*args, **kwargs).arguments
        q, k, v = (torch.as_tensor(bound[name], device="cuda") for name in ("q", "k", "v"))
        with torch.cuda.stream(torch.cuda.ExternalStream(bound["stream"])):
            result = triton_kernel.sparse_attention(q, k, v, _config(bound))
            torch.as_tensor(bound["outputs"][0], device="cuda").copy_(result)

    tail = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)
            for name, annotation in (("outputs", tuple), ("stream", int))]
    run.__signature__ = plugin_signature(trtp.Tensor, *tail)
    trtp.impl(PLUGIN_ID)(run)
    _registered = True
    return PLUGIN_ID

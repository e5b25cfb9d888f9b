"""What the TorchScript-based ONNX exporter lacks or gets wrong, as translations of our own
(builder/export.py export_torchscript registers them before each export).

Operators it has no translation of: ``aten::rms_norm`` and nearest-exact upsampling. Operators it
translates wrongly once the file's axes are dynamic: each says what it did and where it was seen. Its
own translations stay wherever the fault cannot arise. Whatever they produce, export_torchscript keeps
a file only where it matches torch at the sample sizes and at others.
"""

from __future__ import annotations

import functools

import torch
from torch.onnx._internal.torchscript_exporter import (symbolic_helper, symbolic_opset9, symbolic_opset11,
                                                       symbolic_opset13)

# The opset from which these translations hold (export_torchscript exports at torch's default, 18 or later).
OPSET = 18


def rms_norm(g, x, normalized_shape, weight, eps):
    """As torch computes it (Flux's, Wan's, LTX's attention norms): x * rsqrt(mean(x^2) + eps) * weight, eps by
    default the dtype's."""
    axes = symbolic_helper._get_const(normalized_shape, "is", "normalized_shape")
    if symbolic_helper._is_none(eps):
        eps = torch.finfo(torch.float32).eps
    else:
        eps = symbolic_helper._get_const(eps, "f", "eps")
    squares = g.op("Mul", x, x)
    mean = g.op("ReduceMean", squares, g.op("Constant", value_t=torch.tensor(list(range(-len(axes), 0)))),
                keepdims_i=1)
    scale = g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean, g.op("Constant", value_t=torch.tensor(eps)))))
    out = g.op("Mul", x, scale)
    return out if symbolic_helper._is_none(weight) else g.op("Mul", out, weight)


def upsample_nearest_exact(g, x, output_size, scale_factors):
    """By scale factors (Wan's VAE), as ONNX's Resize: torch's source index floor((i + 0.5) * in / out) is
    half_pixel's (i + 0.5) * in / out - 0.5 rounded half up."""
    if symbolic_helper._is_none(scale_factors):
        raise NotImplementedError("nearest-exact upsampling to an output size")  # the dynamo exporter's
    factors = symbolic_helper._get_const(scale_factors, "fs", "scale_factors")
    return g.op("Resize", x, symbolic_helper._optional_input_placeholder_tensor(g),
                g.op("Constant", value_t=torch.tensor([1.0, 1.0, *factors], dtype=torch.float32)),
                mode_s="nearest", coordinate_transformation_mode_s="half_pixel",
                nearest_mode_s="round_prefer_ceil")


def unflatten(g, x, dim, sizes):
    """With the split axis known when exporting. The exporter's own computes it in the graph: the target shape's
    length is then unknown to its shape inference, which falls back on the traced sizes, every one of them a
    constant of the file from there on (Flux's and Wan's attention heads' split fixed the batch and token
    counts)."""
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None or not symbolic_helper._is_constant(dim):
        raise NotImplementedError("unflatten of a tensor of unknown rank")  # the dynamo exporter's
    dim = symbolic_helper._get_const(dim, "i", "dim") % rank
    shape = g.op("Shape", x)

    def sizes_of(start, end):
        return g.op("Slice", shape, g.op("Constant", value_t=torch.tensor([start])),
                    g.op("Constant", value_t=torch.tensor([end])))

    return g.op("Reshape", x, g.op("Concat", sizes_of(0, dim), sizes, sizes_of(dim + 1, rank), axis_i=0))


def repeat_interleave(g, x, repeats, dim=None, output_size=None):
    """The exporter's own with ``dim`` a constant of its own: it adds the rank to a negative ``dim`` in place, in
    the tensor of the trace's constant, and every other use of that constant then reads the new value (LTX's
    rotary embedding's repeat_interleave(2, dim=-1) turned its attention's unbind(-1) into unbind(2))."""
    if not symbolic_helper._is_none(dim) and symbolic_helper._is_constant(dim):
        dim = g.op("Constant", value_t=torch.tensor(symbolic_helper._get_const(dim, "i", "dim")))
    return symbolic_opset13.repeat_interleave(g, x, repeats, dim, output_size)


def movedim(g, x, source, destination):
    """A Transpose of torch's permutation. The exporter's own writes a negative dim into it as it is (LTX's VAE:
    movedim(-1, 1) became perm [0, -1, 1, 2, 3], which ONNX Runtime refuses)."""
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        raise NotImplementedError("movedim of a tensor of unknown rank")  # the dynamo exporter's

    def dims(value, name):
        return [int(dim) % rank for dim in symbolic_helper._get_const(value, "t", name).view(-1)]

    moved = dict(zip(dims(destination, "destination"), dims(source, "source")))
    kept = iter(dim for dim in range(rank) if dim not in moved.values())
    return g.op("Transpose", x, perm_i=[moved[dim] if dim in moved else next(kept) for dim in range(rank)])


def squeeze(g, x, dim=None):
    """Where the exporter's shape inference lost the axis's size, the traced size decides, as torch.export's
    does: the exporter's own writes an If of a Squeeze and an Identity there, which ONNX Runtime refuses to load
    where it knows the size is not 1 (LTX-2's gate.squeeze(2) on [batch, tokens, dim] after a reshape to -1)."""
    rank = symbolic_helper._get_tensor_rank(x)
    axis = None if dim is None else symbolic_helper._maybe_get_const(dim, "i")
    if isinstance(axis, int) and rank is not None and symbolic_helper._get_tensor_dim_size(x, axis % rank) is None:
        traced = g.original_node.inputsAt(0).type()
        sizes = traced.sizes() if isinstance(traced, torch._C.TensorType) and traced.dim() == rank else None
        if sizes is not None and sizes[axis % rank] is not None and sizes[axis % rank] != 1:
            return g.op("Identity", x)
    return symbolic_opset11.squeeze(g, x, dim)


def convolution_mode(g, x, weight, bias, stride, padding, dilation, groups):
    """"same" padding as the pads torch computes (the odd one at the end), not the exporter's auto_pad
    SAME_UPPER, which ONNX Runtime refuses with a dilation (LTX-2's vocoder)."""
    kernel = symbolic_helper._get_tensor_sizes(weight)
    if (symbolic_helper._parse_arg(padding, "s") != "same" or kernel is None or None in kernel[2:]
            or not (symbolic_helper._is_none(bias) or symbolic_helper._get_tensor_rank(bias) == 1)):
        return symbolic_opset9._convolution_mode(g, x, weight, bias, stride, padding, dilation, groups)
    kernel = kernel[2:]
    dilations = symbolic_helper._parse_arg(dilation, "is")
    total = [step * (size - 1) for step, size in zip(dilations, kernel)]
    inputs = [x, weight] + ([] if symbolic_helper._is_none(bias) else [bias])
    return g.op("Conv", *inputs, kernel_shape_i=kernel, strides_i=symbolic_helper._parse_arg(stride, "is"),
                pads_i=[pad // 2 for pad in total] + [pad - pad // 2 for pad in total], dilations_i=dilations,
                group_i=symbolic_helper._parse_arg(groups, "i"))


@functools.cache
def register() -> None:
    """The translations above, for every TorchScript export of this process from ``OPSET`` on."""
    translations = {"aten::rms_norm": rms_norm, "aten::unflatten": unflatten,
                    "aten::repeat_interleave": repeat_interleave, "aten::movedim": movedim, "aten::squeeze": squeeze,
                    "aten::_convolution_mode": convolution_mode,
                    **{f"aten::_upsample_nearest_exact{rank}": upsample_nearest_exact for rank in ("1d", "2d", "3d")}}
    for operator, translation in translations.items():
        torch.onnx.register_custom_op_symbolic(operator, translation, OPSET)

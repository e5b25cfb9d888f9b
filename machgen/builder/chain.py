"""A denoiser's head and tail as one ONNX file: the model a step that runs
both calls on the onnxruntime target (repository.fused_chains).

Served as two Triton models joined by an ensemble, such a step pays two
Python-backend round trips and moves the head's outputs (the per-token
time embedding of a Wan 2.2 model is several times the latents) through
shared memory twice; one graph pays one and keeps them inside ONNX
Runtime. The graphs are joined, not exported again: the head's nodes and
weights as they are, the tail's under a prefix, each tail input wired to
the head output of its name, else to the head input of its name (the
sampler routes a separate tail call the same way, runtime/sampler.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

# The tail's names inside the joined graph (its outputs keep their own).
_TAIL_PREFIX = "tail/"
# A head input the tail takes too reaches it through an Identity output of the head under this suffix.
_PASSED_SUFFIX = "/to_tail"


def fuse_head_and_tail(head_path: Path, tail_path: Path, out_path: Path, head_outputs_kept: Sequence[str]) -> Path:
    """Write the graph that runs ``tail_path`` on ``head_path``'s outputs to
    ``out_path``: the head's inputs, then the tail's outputs and
    ``head_outputs_kept`` (what the cache keeps of the head's) as outputs.
    Raises ValueError where the tail takes an input neither part of the head
    gives, or where a name of the result would mean two things."""
    import onnx
    import onnx.compose
    from onnx import helper

    from machgen.builder.export import EXTERNAL_DATA_BYTES

    head = onnx.load(os.fspath(head_path))
    tail = onnx.load(os.fspath(tail_path))
    head_inputs = {tensor.name: tensor for tensor in head.graph.input}
    head_outputs = {tensor.name for tensor in head.graph.output}
    tail_outputs = [tensor.name for tensor in tail.graph.output]
    head_values = {name for node in head.graph.node for name in node.output} | set(head_inputs) | \
        {tensor.name for tensor in head.graph.initializer}
    clashing = [name for name in tail_outputs if name in head_values]
    if clashing:
        raise ValueError(f"{tail_path}: the tail's outputs {clashing} are names in the head's graph too")
    missing = [name for name in head_outputs_kept if name not in head_outputs]
    if missing:
        raise ValueError(f"{head_path}: the head has no output {missing}")
    io_map = []
    for tensor in tail.graph.input:
        if tensor.name in head_outputs:
            io_map.append((tensor.name, tensor.name))
        elif tensor.name in head_inputs:
            passed = tensor.name + _PASSED_SUFFIX
            head.graph.node.append(helper.make_node("Identity", [tensor.name], [passed], name=passed))
            output = onnx.ValueInfoProto()
            output.CopyFrom(head_inputs[tensor.name])
            output.name = passed
            head.graph.output.append(output)
            io_map.append((passed, tensor.name))
        else:
            raise ValueError(f"{tail_path}: the tail's input {tensor.name!r} is neither an input nor an output "
                             "of the head")
    joined = onnx.compose.merge_models(head, tail, io_map=io_map, prefix2=_TAIL_PREFIX,
                                       outputs=[_TAIL_PREFIX + name for name in tail_outputs]
                                       + list(head_outputs_kept))
    renamed = {_TAIL_PREFIX + name: name for name in tail_outputs}
    for node in joined.graph.node:
        node.output[:] = [renamed.get(name, name) for name in node.output]
        node.input[:] = [renamed.get(name, name) for name in node.input]
    for tensor in joined.graph.output:
        tensor.name = renamed.get(tensor.name, tensor.name)
    _one_opset_per_domain(joined)
    weights = sum(len(tensor.raw_data) for tensor in joined.graph.initializer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(joined, os.fspath(out_path), save_as_external_data=weights > EXTERNAL_DATA_BYTES,
                    location=out_path.name + ".data")
    return out_path


def _one_opset_per_domain(model) -> None:
    """One opset_import entry per domain, the highest version: merge_models keeps both parts' entries, and a
    head from one exporter and a tail from the other name the default domain "" and "ai.onnx", which
    ONNX Runtime's quantizer and onnx.checker's full check refuse."""
    from onnx import helper

    versions: dict[str, int] = {}
    for entry in model.opset_import:
        domain = "" if entry.domain in ("", "ai.onnx") else entry.domain
        versions[domain] = max(versions.get(domain, 0), entry.version)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(domain, version) for domain, version in versions.items())


__all__ = ["fuse_head_and_tail"]

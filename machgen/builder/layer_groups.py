"""The denoiser's linear layers in groups by what they are in the transformer, for the int8 sensitivity
sweep (builder/precision_sweep.py): read from the exported graphs' module paths, for any family.

A module path's first numeric part is a block index ("transformer.transformer_blocks.0.attn.to_q": block
"transformer.transformer_blocks.0", role "attn.to_q"). Inside a block, the layers that read the same tensor
are one group: an attention's q, k and v projections (and a single-stream block's MLP input beside them), its
context's, its output projection, a feed-forward's input and output, a block's norm modulation. Outside the
blocks, a layer belongs to its module at the depth the block lists sit ("transformer.time_text_embed" takes
every linear of the time, guidance and pooled text embedders; "transformer.proj_out" the final projection).
A module that several graphs hold (the head's embedders and the reuse graph's) is one layer of one group;
two denoisers of one model (Wan 2.2's experts: ``denoiser`` and ``denoiser_2``) never share a group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from machgen.builder.quantize import LinearLayer

# A denoiser component's parts share its stem: denoiser_head, denoiser_tail, denoiser_reuse -> denoiser.
_PART_SUFFIX = re.compile(r"_(head|tail|reuse)$")


@dataclass(frozen=True)
class LayerGroup:
    name: str
    modules: tuple[str, ...]  # module paths (LinearLayer.module), in graph order
    stem: str  # the denoiser they belong to
    parameters: int  # weight elements, each module counted once

    def holds(self, stem: str, module: str) -> bool:
        return stem == self.stem and module in self.modules


def denoiser_stem(component: str) -> str:
    return _PART_SUFFIX.sub("", component)


def _block_index(parts: Sequence[str]) -> int | None:
    """The position of the first numeric part after the first, else None."""
    return next((index for index, part in enumerate(parts) if index > 0 and part.isdigit()), None)


def group_layers(layers: Mapping[str, Sequence[LinearLayer]]) -> list[LayerGroup]:
    """The groups of the linear layers of each denoiser component (``layers`` by component name), in order
    of first appearance."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(key):
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    def union(first, second):
        parent[find(second)] = find(first)

    order: list[tuple[str, str]] = []
    parameters: dict[tuple[str, str], int] = {}
    for component, found in layers.items():
        stem = denoiser_stem(component)
        for layer in found:
            key = (stem, layer.module)
            if key not in parent:
                parent[key] = key
                order.append(key)
                parameters[key] = layer.parameters
    splits = {key: key[1].split(".") for key in order}
    depths = [index for parts in splits.values() if (index := _block_index(parts)) is not None]
    top_depth = min(depths) if depths else None
    by_place: dict[tuple, tuple[str, str]] = {}  # (stem, block, input) or (stem, top module) -> first key
    for component, found in layers.items():
        stem = denoiser_stem(component)
        for layer in found:
            key = (stem, layer.module)
            parts = splits[key]
            index = _block_index(parts)
            if index is not None:
                place = (stem, component, ".".join(parts[:index + 1]), layer.input)
            elif top_depth is not None and len(parts) > top_depth:
                place = (stem, ".".join(parts[:top_depth]))
            else:
                place = key
            union(by_place.setdefault(place, key), key)
    members: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for key in order:
        members.setdefault(find(key), []).append(key)
    stems = list(dict.fromkeys(stem for stem, _ in order))
    root = _common_root([module for _, module in order])
    groups = []
    for keys in members.values():
        stem = keys[0][0]
        modules = tuple(module for _, module in keys)
        name = _group_name(modules, root, top_depth)
        groups.append(LayerGroup(f"{stem}: {name}" if len(stems) > 1 else name, modules, stem,
                                 sum(parameters[key] for key in keys)))
    return groups


def _common_root(modules: Sequence[str]) -> str:
    """The first path part every module shares (the export wrapper's "transformer."), else ""."""
    firsts = {module.split(".")[0] for module in modules}
    return f"{firsts.pop()}." if len(firsts) == 1 and all("." in module for module in modules) else ""


def _group_name(modules: Sequence[str], root: str, top_depth: int | None) -> str:
    """``transformer_blocks.0 attn.to_q/to_k/to_v``, ``time_text_embed``, ``proj_out``."""
    paths = [module[len(root):] if root and module.startswith(root) else module for module in modules]
    parts = [path.split(".") for path in paths]
    index = _block_index(modules[0].split("."))
    if index is None:
        shown = top_depth - (1 if root else 0) if top_depth is not None else None
        if shown is not None and shown > 0 and all(len(p) > shown for p in parts) and len({
                ".".join(p[:shown]) for p in parts}) == 1:
            return ".".join(parts[0][:shown])
        return "/".join(paths)
    block_length = index + 1 - (1 if root else 0)
    block = ".".join(parts[0][:block_length])
    roles = [p[block_length:] for p in parts]
    shared = 0
    while all(len(role) > shared + 1 for role in roles) and len({tuple(role[:shared + 1]) for role in roles}) == 1:
        shared += 1
    prefix = ".".join(roles[0][:shared]) + ("." if shared else "")
    return f"{block} {prefix}{'/'.join('.'.join(role[shared:]) for role in roles)}"

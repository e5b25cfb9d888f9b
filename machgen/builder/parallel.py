"""A build for a parallel layout (``machgen-build build --target torch
--parallel cfg=2,ulysses=2``): checked against what the family allows before
any export, its attention exported as ``machgen::sequence_attention``, and
each parallel component's ``ShardPlan`` written beside its program."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from machgen.builder.family_export import ExportableComponent, FamilyExport, OnRanks
from machgen.contract.specs import AxisRange
from machgen.parallel.layout import LayoutError, ParallelLayout, ParallelSupport, ShardPlan, check_layout


def check_parallel_build(layout: ParallelLayout, exporter: FamilyExport, pipe: Any, target: str,
                         ranges: dict[str, AxisRange], sparse: bool = False) -> ParallelSupport:
    """What the model allows, or LayoutError naming why ``layout`` cannot be built (``sparse``: with
    sparse attention)."""
    name = exporter.family.name
    if target != "torch":
        raise LayoutError(f"--parallel {layout}: parallel layouts run on the torch target (--target torch), "
                          f"not {target}")
    support = exporter.parallel_support(pipe, ranges)
    if support is None:
        raise LayoutError(f"--parallel {layout}: family '{name}' declares no parallel layouts")
    check_layout(layout, support, f"family '{name}'", sparse)
    return support


def parallel_variant(component: ExportableComponent, exporter: FamilyExport) -> OnRanks | None:
    """How the component runs on the ranks, or None: on one device (the encoders, run once a request; the
    denoiser's part run in the sampler's process; a part without attention). A denoiser part runs as
    FamilyExport.sequence_parallel exports it, its tokens split over the sequence ranks; a VAE decoder that
    FamilyExport.decoder_split_by_rows gives a variant for, its rows of pixels over every rank."""
    spec = component.spec
    if (spec.per_step and not spec.in_sampler
            and any(type(sub).__module__ in exporter.sharded_attention_modules
                    for sub in component.module.modules())):
        variant = exporter.sequence_parallel(component)
        return OnRanks(variant, exporter.sequence_axes) if variant is not None else None
    return exporter.decoder_split_by_rows(component)


def write_shard_plan(folder: Path, plan: ShardPlan) -> None:
    """The plan into the program's component.json (runtime/torch_runner.TorchComponentInfo.parallel)."""
    from machgen.runtime.torch_runner import INFO_FILE

    info = json.loads((folder / INFO_FILE).read_text())
    info["parallel"] = plan.to_json()
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")

"""The build-time half of a model family: ``FamilyExport``.

A family's ``export.py`` subclasses it: from a loaded diffusers pipeline to
the components to export (each a torch module with its spec and sample
inputs), the served defaults, the settings its runtime reads, and the
shapes its engines must cover. Nothing here runs inside Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from machgen.contract.specs import AxisRange, ComponentSpec, ServedDefaults
from machgen.parallel.layout import ParallelLayout, ParallelSupport, ShardPlan, shard_plan

if TYPE_CHECKING:  # pragma: no cover
    from contextlib import AbstractContextManager

    import torch

    from machgen.families.registry import Family


@dataclass
class ExportableComponent:
    """A component ready for export: its spec, a torch module whose forward
    takes the spec's inputs in order, and sample inputs to trace and check."""

    spec: ComponentSpec
    module: "torch.nn.Module"
    sample_inputs: dict[str, "torch.Tensor"]
    # The parity check also runs the batched inputs' first row alone; this fixes up inputs that index rows.
    first_row: "Callable[[dict], dict] | None" = None
    # How many times longer a named axis gets where the others double (the TorchScript exporter's check at
    # other sizes): an axis that is a product of two others (a flat cache of height x width) grows 4 times.
    axis_growth: dict[str, int] = field(default_factory=dict)
    # What the TorchScript exporter traces the module under: numerically identical replacements of what it
    # mistranslates or translates slowly (LTX-2's rotary embedding adds into halves of a tensor in place, Wan's
    # writes into every other element of an empty one). The parity checks run the module as it is: they compare
    # the file with the model's own code.
    torchscript_context: "Callable[[], AbstractContextManager] | None" = None


@dataclass(frozen=True)
class OnRanks:
    """A component that runs on a parallel layout's ranks: what it exports as, and how its tensors split
    (parallel/layout.ShardPlan)."""

    component: ExportableComponent
    # The axis names whose tensors are split (ShardPlan.sequence), over which ranks (ShardPlan.ranks), and
    # the fewest a rank may hold for a call to be split (ShardPlan.min_rows).
    split_axes: tuple[str, ...]
    ranks: str = "sequence"
    min_rows: int = 1

    def plan(self, layout: ParallelLayout) -> ShardPlan:
        return shard_plan(self.component.spec, layout, self.split_axes, self.ranks, self.min_rows)


class FamilyExport:
    """What ``machgen-build`` asks of a family."""

    # The model-folder subfolders the sampler needs at run time (tokenizers,
    # scheduler config); they are copied into the sampler's model folder.
    sampler_assets: ClassVar[tuple[str, ...]] = ()
    # The modules whose ``dispatch_attention_fn`` calls are the denoiser's
    # attention: ``--attention sparse-fp8`` swaps those calls for the
    # SparseAttention operator during export (plugins/ops.py).
    attention_modules: ClassVar[tuple[str, ...]] = ()
    # The key prefix of the adapted model's weights in a diffusers-format LoRA (per-request adapters).
    adapted_prefix: ClassVar[str] = "transformer."
    # The axis names of the denoiser's token sequences: split over the sequence ranks of a parallel layout
    # (its blocks must mix tokens only in the attention of ``sequence_attention_modules``).
    sequence_axes: ClassVar[tuple[str, ...]] = ()
    # The modules whose self-attention runs across the sequence ranks (machgen::sequence_attention) under a
    # parallel layout; None: ``attention_modules``.
    sequence_attention_modules: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, family: "Family"):
        self.family = family

    def check(self, pipe: Any) -> None:
        """Refuse, with a message, a pipeline of this class that the family cannot serve."""

    def components(self, pipe: Any) -> list[ExportableComponent]:
        raise NotImplementedError

    def pipeline_defaults(self, pipe: Any) -> ServedDefaults:
        """The defaults of the diffusers pipeline for this model."""
        raise NotImplementedError

    def sampler_settings(self, pipe: Any, defaults: ServedDefaults) -> dict[str, Any]:
        """JSON-able settings the runtime needs (shapes, factors, flags): the manifest's family settings."""
        raise NotImplementedError

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        """The range of every named axis of the components' inputs except
        ``batch``, from the served sizes (``settings``: sampler_settings)."""
        raise NotImplementedError

    def sparse_attention_layers(self, pipe: Any) -> list | None:
        """The attention modules whose calls ``--attention sparse-fp8`` swaps,
        where the rule of plugins/ops.attention_swapped (unmasked, keys as
        long as the queries) would also take a cross-attention; None: every
        call in ``attention_modules`` that the rule takes."""
        return None

    @property
    def sharded_attention_modules(self) -> tuple[str, ...]:
        """``sequence_attention_modules``, else ``attention_modules``."""
        if self.sequence_attention_modules is None:
            return self.attention_modules
        return self.sequence_attention_modules

    def sequence_attention_swap(self, pipe: Any):
        """The context a component that runs on a parallel layout's ranks is
        exported in: its self-attention swapped for machgen::sequence_attention
        (parallel/op.py). A model with attention over the split sequence that
        the swap's rule does not take, or takes wrongly, says which layers do what."""
        from machgen.parallel.op import sequence_attention_swapped

        return sequence_attention_swapped(self.sharded_attention_modules)

    def parallel_support(self, pipe: Any, ranges: dict[str, AxisRange]) -> ParallelSupport | None:
        """What parallel layouts the model allows (``ranges``: axis_ranges'),
        or None: it runs on one device only. A call whose token counts the
        sequence degree does not divide runs unsplit (runtime: parallel/rank_programs.py)."""
        return None

    def sequence_parallel(self, component: ExportableComponent) -> ExportableComponent | None:
        """What a per-step denoiser component exports as under a parallel
        layout: itself, its token-axis tensors (``sequence_axes``) split
        outside the program; or a variant that splits its tokens itself
        (machgen::sequence_shard, its spec with the SEQUENCE_MARKER input),
        for a model that computes what its tokens need from the whole input;
        None: it runs on one device."""
        return component

    def decoder_split_by_rows(self, component: ExportableComponent) -> OnRanks | None:
        """How a VAE decoder component runs under a parallel layout whose
        every rank decodes a band of the picture's rows (parallel/rows.py):
        what it exports as and its tensors split so (``ranks="all"``); None:
        it decodes on one device."""
        return None

    def adapted_model(self, pipe: Any) -> "torch.nn.Module | None":
        """The model whose linear layers per-request LoRA adapters change (the
        denoiser's transformer), or None: this family serves no adapters."""
        return None

    def adapter_state_dict(self, weights_file: Any) -> tuple[dict, dict | None, dict | None]:
        """(state dict in diffusers' key format, network alphas, saved LoRA
        config) of a LoRA file, as the family's pipeline loads it."""
        raise ValueError(f"family '{self.family.name}' serves no per-request adapters")

    def streaming_components(self, pipe: Any, streaming: Any) -> tuple[list[ExportableComponent], dict[str, Any]]:
        """The components of the model's streaming mode (realtime sessions; ``streaming``: the card's
        contract.streaming.StreamingSettings) and the settings its runtime needs besides them (the cache's
        shape); a family without one refuses, saying so."""
        raise ValueError(f"family '{self.family.name}' has no streaming mode (realtime sessions)")

    def dense_attention_tokens(self, defaults: ServedDefaults) -> int:
        """Leading tokens of the denoiser's attention whose blocks stay dense
        under sparse attention (the text tokens of a joint-attention model)."""
        return 0

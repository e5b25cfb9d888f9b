"""A parallel layout and what a model allows of it; plain data, no torch.

A layout multiplies three degrees: ``cfg`` (the guidance rows of a step
split over rank groups), ``ulysses`` and ``ring`` (the token sequence split
over ranks; ``ulysses x ring`` is the sequence degree). Its ranks are
numbered cfg-major, then ring, then Ulysses: the ranks of a Ulysses group,
whose all-to-all moves the most bytes, are neighbours (one NVLink island).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from machgen.contract.specs import ComponentSpec

AXES = ("cfg", "ulysses", "ring")
# The program input of a program that splits its tokens itself: its length is the call's sequence degree.
SEQUENCE_MARKER = "sequence_marker"
# The layout's word for the stale-keys ring, and the exact steps a request takes first where it gives none
# (DistriFusion's default; on the trained video default 1, 4 and 8 steps give 28, 34 and 46 dB against one rank:
# perf/RESULTS.md).
STALE = "stale"
STALE_WARMUP = 4


class LayoutError(ValueError):
    """A layout that cannot be parsed, or that the model does not allow."""


@dataclass(frozen=True)
class ParallelLayout:
    """How many ranks share one generation, and how."""

    cfg: int = 1  # rank groups the guidance rows (conditional, unconditional) are split over
    ulysses: int = 1  # ranks exchanging heads for sequence by all-to-all (divides the head count)
    ring: int = 1  # ranks passing key/value blocks round a ring
    # The ring's other blocks from the request's previous step, their exchange hidden under a whole step: not
    # exact (DistriFusion's displaced patch parallelism; parallel/stale.py). The exact steps (warm-up) a request
    # takes before its ring goes stale; 0: the exact ring.
    stale: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.stale, int) or isinstance(self.stale, bool) or self.stale < 0:
            raise LayoutError(f"parallel layout: stale must be a whole number of warm-up steps, not {self.stale!r}")
        for axis in AXES:
            degree = getattr(self, axis)
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise LayoutError(f"parallel layout: {axis} must be a whole number of at least 1, not {degree!r}")
        if self.stale and self.ring == 1:
            raise LayoutError("parallel layout: stale keys are a ring's, give a ring degree (ring=2,stale)")

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses * self.ring

    @property
    def sequence_degree(self) -> int:
        return self.ulysses * self.ring

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """``"cfg=2,ulysses=2,ring=2"`` (any order, missing axes 1; ``""`` or ``"none"``: one rank), and
        ``stale`` or ``stale=N`` (N exact warm-up steps; 0: off) among them for the stale-keys ring."""
        text = text.strip()
        if text in ("", "none"):
            return cls()
        degrees: dict[str, Any] = {}
        for part in text.split(","):
            axis, separator, value = part.strip().partition("=")
            axis = axis.strip()
            if axis == STALE and not separator:
                value, separator = str(STALE_WARMUP), "="
            if not separator or axis not in (*AXES, STALE):
                raise LayoutError(f"parallel layout {text!r}: expected AXIS=DEGREE, AXIS one of {', '.join(AXES)}"
                                  f", or {STALE}[=WARMUP]")
            if axis in degrees:
                raise LayoutError(f"parallel layout {text!r}: {axis} given twice")
            try:
                degrees[axis] = int(value)
            except ValueError:
                raise LayoutError(f"parallel layout {text!r}: {axis}={value.strip()!r} is not a whole number") \
                    from None
        return cls(**degrees)

    def __str__(self) -> str:
        named = [f"{axis}={getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1]
        stale = [] if not self.stale else [STALE if self.stale == STALE_WARMUP else f"{STALE}={self.stale}"]
        return ",".join(named + stale) or "none"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> "ParallelLayout":
        return cls(**dict(data)) if data else cls()


@dataclass(frozen=True)
class ParallelSupport:
    """What a model allows: a family declares it from the loaded model."""

    # Attention heads of every attention the sequence is split for (Ulysses scatters them).
    heads: int
    # Whether a step's denoiser call carries guidance rows (conditional and unconditional) to split.
    guidance_rows: bool
    # Whether the sequence can be split at all (False: a model whose blocks mix tokens outside attention).
    sequence: bool = True
    # Why the sequence cannot be split, said when a layout asks for it.
    sequence_reason: str = ""
    # Why sparse attention cannot run with the sequence split ("": it can, its sharded attention's whole
    # sequence put back in single-rank order: one stream, or a joint attention led by its text).
    sparse_sequence_reason: str = ""


def refusals(layout: ParallelLayout, support: ParallelSupport, sparse: bool = False) -> list[str]:
    """Why ``support``'s model cannot run ``layout`` (empty: it can); ``sparse``: with sparse attention."""
    reasons = []
    if sparse and layout.sequence_degree > 1 and support.sparse_sequence_reason:
        reasons.append(f"ulysses x ring = {layout.sequence_degree} with sparse attention: "
                       f"{support.sparse_sequence_reason}")
    if layout.cfg > 1 and not support.guidance_rows:
        reasons.append(f"cfg={layout.cfg} needs guidance rows, and this model's steps have one row per image "
                       "(guidance embedded, no negative-prompt pass)")
    if layout.cfg > 2:
        reasons.append(f"cfg={layout.cfg}: a step has two guidance rows per image (conditional and "
                       "unconditional), so at most cfg=2")
    if layout.sequence_degree > 1 and not support.sequence:
        reasons.append(f"ulysses x ring = {layout.sequence_degree}: {support.sequence_reason or 'the model'}"
                       " cannot split its sequence")
    if layout.ulysses > 1 and support.heads % layout.ulysses:
        reasons.append(f"ulysses={layout.ulysses} does not divide the model's {support.heads} attention heads "
                       "(use a ring degree for the rest of the sequence degree)")
    return reasons


def check_layout(layout: ParallelLayout, support: ParallelSupport, model: str = "the model",
                 sparse: bool = False) -> None:
    """Raise LayoutError naming every reason ``model`` cannot run ``layout`` (``sparse``: with sparse attention)."""
    reasons = refusals(layout, support, sparse)
    if reasons:
        raise LayoutError(f"{model} cannot run the parallel layout {layout}: " + "; ".join(reasons))


@dataclass(frozen=True)
class ShardPlan:
    """How a component's tensors are split under a layout: the batched ones
    (first axis: rows, split over the cfg groups) and the token-sequence ones
    (by name, their token axis, split over the sequence ranks). Written to
    the component's folder by the build; the ranks read it."""

    layout: ParallelLayout
    batched: tuple[str, ...]  # inputs and outputs whose first axis is the batch
    sequence: Mapping[str, int]  # inputs and outputs with a token axis, and which axis
    # The program input whose length is the call's sequence degree, for a program that splits its tokens
    # itself (machgen::sequence_shard); its inputs and outputs then travel whole. None: split outside.
    marker: str | None = None
    # Which ranks split the ``sequence`` tensors: "sequence" (the sequence ranks, each cfg group its share of
    # the batched rows) or "all" (every rank, the batch whole: a VAE decoder's rows of pixels, parallel/rows.py).
    ranks: str = "sequence"
    # The fewest rows of each split tensor's axis a rank may hold for a call to be split (else every rank runs
    # it whole): a decoder whose convolutions pad by reflection mirrors the row next to the picture's edge.
    min_rows: int = 1

    def __post_init__(self) -> None:
        if self.ranks not in ("sequence", "all"):
            raise LayoutError(f"a shard plan splits over the 'sequence' ranks or 'all' of them, not {self.ranks!r}")

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout.to_json(), "batched": list(self.batched), "sequence": dict(self.sequence),
                "marker": self.marker, "ranks": self.ranks, "min_rows": self.min_rows}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ShardPlan":
        return cls(ParallelLayout.from_json(data["layout"]), tuple(data["batched"]), dict(data["sequence"]),
                   data.get("marker"), data.get("ranks", "sequence"), data.get("min_rows", 1))


def shard_plan(spec: ComponentSpec, layout: ParallelLayout, split_axes: tuple[str, ...],
               ranks: str = "sequence", min_rows: int = 1) -> ShardPlan:
    """How ``spec``'s tensors split: batched ones by rows, those with an axis named in ``split_axes`` along
    it, over ``ranks`` (ShardPlan.ranks; ``min_rows``: ShardPlan.min_rows)."""
    tensors = spec.inputs + spec.outputs
    sequence = {}
    for tensor in tensors:
        axis = next((index for index, size in enumerate(tensor.shape) if size in split_axes), None)
        if axis is not None:
            sequence[tensor.name] = axis
    marker = SEQUENCE_MARKER if any(t.name == SEQUENCE_MARKER for t in spec.inputs) else None
    batched = tuple(dict.fromkeys(t.name for t in tensors if t.batched)) if ranks == "sequence" else ()
    return ShardPlan(layout, batched, sequence, marker, ranks, min_rows)

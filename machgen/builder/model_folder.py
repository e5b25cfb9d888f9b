"""A diffusers model folder as the builder reads it: its family, its pipeline (safetensors only, local files
only), the served and calibrated defaults of its model card (machgen.json), and the tiny folders tests and demos
write."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from machgen.contract.specs import ServedDefaults
from machgen.families.registry import Family, family_for_model

# A model folder's served defaults (key "serving") and calibrated cache defaults (key "cache").
SERVING_FILE = "machgen.json"


def detect_family(model_dir: Path) -> Family:
    index = model_dir / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{model_dir} is not a diffusers model folder (no model_index.json)")
    return family_for_model(json.loads(index.read_text()))


# Weight files that are Python pickles: loading one runs whatever code it carries.
PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def refuse_pickled_weights(folder: Path) -> None:
    """Raise ValueError when ``folder`` holds pickle-based weights: machgen loads safetensors only."""
    folder = Path(folder)
    files = [folder] if folder.is_file() else folder.rglob("*")
    found = sorted(path.relative_to(folder.parent if folder.is_file() else folder) for path in files
                   if path.is_file() and path.suffix.lower() in PICKLED_WEIGHTS)
    if found:
        raise ValueError(f"{folder} holds pickle-based weights ({', '.join(map(str, found[:5]))}"
                         f"{', ...' if len(found) > 5 else ''}): loading them can run arbitrary code, so machgen "
                         "loads safetensors only; convert them (for example load once in a trusted place and "
                         "save_pretrained(..., safe_serialization=True)) and remove the pickles")


def load_pipeline(model_dir: Path, family: Family):
    import diffusers

    refuse_pickled_weights(model_dir)
    pipeline_class = getattr(diffusers, family.diffusers_pipeline)
    # Local folders only: no model hub at build or run time; safetensors only; never a model's own code.
    return pipeline_class.from_pretrained(model_dir, local_files_only=True, use_safetensors=True)


def served_defaults(model_dir: Path, family: Family, pipe) -> ServedDefaults:
    """The model card's served defaults when the folder has them, else the
    pipeline's; every family input at its default unless either sets it."""
    defaults = family.exporter().pipeline_defaults(pipe)
    defaults = replace(defaults, family_inputs={**{declared.name: declared.default for declared in family.inputs},
                                                **defaults.family_inputs})
    card = model_dir / SERVING_FILE
    if card.is_file():
        overrides = json.loads(card.read_text()).get("serving", {})
        unknown = set(overrides) - set(defaults.to_json())
        if unknown:
            raise ValueError(f"{card}: unknown serving keys {sorted(unknown)}")
        # A family's input defaults are merged key by key: a card may set one of them.
        declared = {declared.name for declared in family.inputs}
        inputs = {**defaults.family_inputs, **overrides.get("family_inputs", {})}
        if set(inputs) - declared:
            raise ValueError(f"{card}: family_inputs {sorted(set(inputs) - declared)} are not inputs of the "
                             f"'{family.name}' family")
        defaults = ServedDefaults.from_json({**defaults.to_json(), **overrides, "family_inputs": inputs})
    return defaults


def streaming_settings(model_dir: Path):
    """The model card's streaming mode (contract.streaming.StreamingSettings), or None: it declares none."""
    from machgen.contract.streaming import StreamingSettings

    card = model_dir / SERVING_FILE
    section = json.loads(card.read_text()).get("streaming") if card.is_file() else None
    return None if section is None else StreamingSettings.from_json(section)


def model_cache_settings(model_dir: Path, sparse: bool = False):
    """The cache defaults ``machgen-build calibrate`` stored with the model, if any. For a build with sparse
    attention (``sparse``) without the held-out figures: calibration measured the dense model, so a response
    of this build reports no expected PSNR rather than the dense model's."""
    from machgen.runtime.cache import CacheSettings

    card = model_dir / SERVING_FILE
    settings = CacheSettings.from_json(json.loads(card.read_text()).get("cache") if card.is_file() else None)
    return _without_held_out(settings) if sparse else settings


def _without_held_out(settings):
    """``settings`` (and each task's) without the held-out figures, saying why."""
    if "held_out" in settings.calibration:
        settings = replace(settings, calibration={key: value for key, value in settings.calibration.items()
                                                  if key != "held_out"}
                           | {"held_out_note": "measured with dense attention: not this build's"})
    return replace(settings, tasks={task: _without_held_out(task_settings)
                                    for task, task_settings in settings.tasks.items()})


def write_tiny_model(family: Family, out: Path, streaming: bool = False) -> Path:
    """A tiny random-weight pipeline folder that diffusers loads with from_pretrained (``streaming``: one with
    a streaming mode in its card, where the family serves realtime sessions)."""
    from machgen.contract.manifest import load_object

    card: dict = {}
    if streaming:
        if family.tiny_streaming is None:
            raise ValueError(f"family '{family.name}' has no streaming mode (realtime sessions)")
        pipe, defaults, card["streaming"] = load_object(family.tiny_streaming)()
    else:
        pipe, defaults = family.tiny_model()
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    (out / SERVING_FILE).write_text(json.dumps({"serving": defaults.to_json(), **card}, indent=2) + "\n")
    return out

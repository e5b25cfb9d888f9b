"""The tasks a served model may do, by the two names each has: the short one every CLI's --help documents
(t2i, i2i, t2v, i2v, r2v) and the long one families and manifests give (text-to-image, ...). Every CLI takes
either."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """A task as --task takes it: by its short name (each CLI's --help documents that one) or by the long name
    families and manifests give it (accepted too); what generate sends for it besides the prompt."""

    name: str  # the long name: text-to-video, ...
    needs_image: bool
    needs_references: bool
    video: bool


TASKS = {"t2i": Task("text-to-image", False, False, False), "i2i": Task("image-to-image", True, False, False),
         "t2v": Task("text-to-video", False, False, True), "i2v": Task("image-to-video", True, False, True),
         "r2v": Task("reference-to-video", False, True, True)}
_SHORT_NAMES = {task.name: short for short, task in TASKS.items()}


def short_task_name(given: str) -> str | None:
    """The short name of a task given by either name; None for a name of no task."""
    return given if given in TASKS else _SHORT_NAMES.get(given)


def long_task_name(given: str | None) -> str | None:
    """The long name (the manifests') of a task given by either name; anything else as given, for the caller
    to refuse in its own words."""
    return TASKS[given].name if given in TASKS else given

"""``torch.export.load`` in about half the time, same program.

perf/bench_program_load.py measures it against ``torch.export.load``
(perf/RESULTS.md). Nearly all of a load is the deserializer's own
bookkeeping, not the weights: it parses every symbolic size and stride of
every node from its text with ``sympy.sympify`` (the same few expressions,
thousands of times), and looks up a schema class's type hints for every
JSON object it turns into one. Both are pure functions of their arguments,
so they are remembered for the duration of a load:

- a parse is remembered by its text and the symbols (with their
  assumptions) it can name, so an expression is only reused where it would
  parse to an equal one (sympy expressions are immutable values);
- type hints by schema class.

What the deserializer does with each parsed expression (symbols, ranges and
hints entered into the program's ShapeEnv) still runs for every node. Where
torch's deserializer does not call these as it does today (another torch
version), the load is the plain one.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

# One load at a time takes the remembering path: it swaps names in torch's serde module for its duration.
_LOADING = threading.Lock()


class _ModuleView:
    """A module as the deserializer sees it: its own names, but for those a subclass remembers."""

    def __init__(self, module):
        self._module = module
        self._remembered: dict = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _RememberingSympy(_ModuleView):
    """``sympy`` with ``sympify`` of text remembered."""

    def sympify(self, value, *args, locals=None, **kwargs):  # noqa: A002 - sympy's own keyword
        if args or kwargs or not isinstance(value, str) or locals is None:
            return self._module.sympify(value, *args, locals=locals, **kwargs)
        # Every name the text can refer to is a substring of it: those bindings decide the result.
        key = (value, tuple(sorted(((name, bound) for name, bound in locals.items() if name in value),
                                   key=lambda item: item[0])))
        try:
            return self._remembered[key]
        except KeyError:
            parsed = self._remembered[key] = self._module.sympify(value, locals=locals)
            return parsed
        except TypeError:  # a binding that cannot be hashed: parse it every time
            return self._module.sympify(value, locals=locals)


class _RememberingTyping(_ModuleView):
    """``typing`` with ``get_type_hints`` of a class remembered."""

    def get_type_hints(self, owner, *args, **kwargs):
        if args or set(kwargs) - {"globalns"} or not isinstance(owner, type):
            return self._module.get_type_hints(owner, *args, **kwargs)
        key = (owner, id(kwargs.get("globalns")))  # the deserializer passes one namespace, its schema's
        if key not in self._remembered:
            self._remembered[key] = self._module.get_type_hints(owner, **kwargs)
        return self._remembered[key]


@contextlib.contextmanager
def _remembering() -> Iterator[None]:
    from torch._export.serde import serialize

    sympy, typing = getattr(serialize, "sympy", None), getattr(serialize, "typing", None)
    if sympy is None or typing is None or not hasattr(sympy, "sympify") or not hasattr(typing, "get_type_hints"):
        yield
        return
    with _LOADING:
        serialize.sympy, serialize.typing = _RememberingSympy(sympy), _RememberingTyping(typing)
        try:
            yield
        finally:
            serialize.sympy, serialize.typing = sympy, typing


def load_program(path: str | os.PathLike):
    """The ExportedProgram of a ``.pt2`` file, as ``torch.export.load`` gives it."""
    import torch

    with _remembering():
        return torch.export.load(os.fspath(path))

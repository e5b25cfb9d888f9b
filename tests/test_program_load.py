"""machgen/runtime/program_load.py: a program read with remembered parses is the program torch.export.load reads."""

from __future__ import annotations

import pytest


def patches_module():
    """A module whose sizes are symbolic arithmetic: 2x2 patches of an image of any size, projected."""
    import torch

    class Patches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.project = torch.nn.Linear(12, 12)

        def forward(self, image, scale):
            batch, channels, height, width = image.shape
            patches = image.reshape(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
            tokens = self.project(patches.reshape(batch, (height // 2) * (width // 2), channels * 4))
            return tokens.reshape(batch, height // 2, width // 2, -1).mean(-1) * scale[:, None, None], tokens

    return Patches().eval()


@pytest.fixture(scope="module")
def saved_program(tmp_path_factory):
    import torch
    from torch.export import Dim

    module = patches_module()
    image, scale = torch.randn(2, 3, 8, 6), torch.randn(2)
    height, width = Dim("height2", min=1, max=64), Dim("width2", min=1, max=64)
    program = torch.export.export(module, (image, scale), dynamic_shapes=(
        {0: Dim.DYNAMIC, 2: 2 * height, 3: 2 * width}, {0: Dim.DYNAMIC}))
    path = tmp_path_factory.mktemp("program") / "model.pt2"
    torch.export.save(program, str(path))
    return module, path


def test_the_remembered_load_is_the_plain_load(saved_program):
    import torch

    from machgen.runtime.program_load import load_program

    module, path = saved_program
    plain, remembered = torch.export.load(str(path)), load_program(path)
    assert str(remembered.graph) == str(plain.graph)
    assert str(remembered.graph_signature) == str(plain.graph_signature)
    assert {str(k): str(v) for k, v in remembered.range_constraints.items()} == \
        {str(k): str(v) for k, v in plain.range_constraints.items()}
    assert [str(n.meta.get("val")) for n in remembered.graph.nodes] == [str(n.meta.get("val"))
                                                                        for n in plain.graph.nodes]
    # Sizes the trace never saw: the same results as the module's.
    image, scale = torch.randn(3, 3, 10, 14), torch.randn(3)
    with torch.no_grad():
        for got, want in zip(remembered.module()(image, scale), module(image, scale)):
            assert torch.allclose(got, want, atol=1e-6)
    # The deserializer's own modules are back after the load.
    import sympy
    import typing

    from torch._export.serde import serialize

    assert serialize.sympy is sympy and serialize.typing is typing


def test_this_torch_takes_the_remembering_path(saved_program):
    """Where torch's deserializer stops calling sympify and get_type_hints through its module names, the load
    falls back to the plain one, and its speed goes with it: this says so."""
    from torch._export.serde import serialize

    from machgen.runtime.program_load import _remembering, _RememberingSympy, _RememberingTyping

    with _remembering():
        assert isinstance(serialize.sympy, _RememberingSympy) and isinstance(serialize.typing, _RememberingTyping)


def test_a_parse_is_reused_only_where_its_symbols_are_the_same():
    import sympy

    from machgen.runtime.program_load import _RememberingSympy

    remembering = _RememberingSympy(sympy)
    s0, s1 = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True, positive=True)
    first = remembering.sympify("2*s0 + s1", locals={"s0": s0, "s1": s1, "s10": sympy.Symbol("s10")})
    assert first == 2 * s0 + s1
    assert remembering.sympify("2*s0 + s1", locals={"s0": s0, "s1": s1}) is first  # s10 cannot matter
    unbacked = sympy.Symbol("s0", integer=True)  # another symbol of the same name
    other = remembering.sympify("2*s0 + s1", locals={"s0": unbacked, "s1": s1})
    assert other == 2 * unbacked + s1 and other != first

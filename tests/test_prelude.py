"""A kernel module defines the helpers of the prelude it calls, and only
those (tilec.codegen.triton_ops.prelude_for)."""

import re
import types

import pytest
import torch

import tilec
from tilec.codegen.triton_ops import PRELUDE, prelude_for

DEFINED = re.compile(r"^def (\w+)\(", re.MULTILINE)
HELPERS = DEFINED.findall(PRELUDE)


def _globals_used(text: str) -> set[str]:
    """The global names the functions of ``text`` use, as Python compiles
    them (not as prelude_for scans the text)."""
    module = compile(text, "<prelude>", "exec")
    functions = [c for c in module.co_consts if isinstance(c, types.CodeType)]
    return set().union(*(f.co_names for f in functions))


@pytest.mark.parametrize("name", HELPERS)
def test_a_helper_comes_with_every_helper_it_calls(name):
    text = prelude_for(f"y = {name}(x)")
    defined = set(DEFINED.findall(text))
    assert name in defined
    # Every helper it uses is defined, and nothing it does not use.
    assert (_globals_used(text) & set(HELPERS)) | {name} == defined


def test_a_kernel_without_helpers_gets_none():
    assert prelude_for("tl.store(out, tl.load(x) + 1.0)") == ""


def test_a_compiled_kernel_defines_only_what_it_calls():
    """sinh is written with expm1, e^a / 2 for large a and a sign helper;
    the reduction combines with _add.  Nothing else of the prelude is in
    the module."""
    x = torch.randn(4, 32)
    fn = torch.compile(lambda x: torch.sinh(x).sum(-1), backend="tilec")
    torch.testing.assert_close(fn(x), torch.sinh(x).sum(-1))
    (program,) = tilec.programs().values()
    sources = [step.kernel.source for step in program.launches()]
    defined = set().union(*(DEFINED.findall(source) for source in sources)) & set(HELPERS)
    assert defined == {"_sinh", "_expm1", "_half_exp", "_with_sign_of", "_add"}


@pytest.mark.parametrize("op", [torch.sinh, torch.cosh], ids=["sinh", "cosh"])
def test_sinh_and_cosh_of_large_arguments_are_within_float32_tolerance(op):
    """Past 20, e^a / 2 as (e^(a/2) / 2) e^(a/2): exact halvings, so within
    torch's float32 tolerance of float64 up to where float32 overflows
    (exp(a - ln 2) rounded a - ln 2: 1.5e-6 off at 80, found by the int64
    reference inputs of the OpInfo sweep).  Past 89.42 both overflow."""
    x = torch.tensor([-80.0, 20.5, 50.0, 80.0, 88.9, 89.0, 89.42, 90.0])
    got = torch.compile(op, backend="tilec")(x)
    torch.testing.assert_close(got[:-2], op(x.double())[:-2].float())
    assert got[-2:].isinf().all() and torch.equal(got[-2:], op(x[-2:]))

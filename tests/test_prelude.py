"""A kernel module defines the helpers of the prelude it calls, and only
those (tilec.codegen.triton_ops.prelude_for)."""

import re

import pytest
import torch

import tilec
from tilec.codegen.triton_ops import PRELUDE, prelude_for

DEFINED = re.compile(r"^def (\w+)\(", re.MULTILINE)
HELPERS = DEFINED.findall(PRELUDE)


@pytest.mark.parametrize("name", HELPERS)
def test_a_helper_comes_with_every_helper_it_calls(name):
    text = prelude_for(f"y = {name}(x)")
    defined = set(DEFINED.findall(text))
    called = set(re.findall(r"\b_\w+\b", text)) & set(HELPERS)
    assert name in defined
    assert called == defined, called ^ defined
    compile(text, name, "exec")  # whole functions, as Python


def test_a_kernel_without_helpers_gets_none():
    assert prelude_for("tl.store(out, tl.load(x) + 1.0)") == ""


def test_a_compiled_kernel_defines_only_what_it_calls():
    """sinh is written with expm1 and a sign helper; the reduction combines
    with _add.  Nothing else of the prelude is in the module."""
    x = torch.randn(4, 32)
    fn = torch.compile(lambda x: torch.sinh(x).sum(-1), backend="tilec")
    torch.testing.assert_close(fn(x), torch.sinh(x).sum(-1))
    (program,) = tilec.programs().values()
    sources = [step.kernel.source for step in program.launches()]
    defined = set().union(*(DEFINED.findall(source) for source in sources)) & set(HELPERS)
    assert defined == {"_sinh", "_expm1", "_with_sign_of", "_add"}

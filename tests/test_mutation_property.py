"""Property tier for inputs the graph writes: random programs of in-place
ops on two inputs (and on views of them), read before and after, against
eager.

Each program mutates its inputs through a random sequence of statements
(scatters, ``copy_`` into slices and transposes, pointwise in-place ops,
optimizer-like updates) and returns values read from the old and the new
contents.  Sometimes the two inputs are views of one tensor, which
AOTAutograd gives the backend as one base.  Compiled by tilec (default mode,
``reduce-overhead``, and that with its kernels chained into one launch:
``passes/chain.py``) and called twice, the outputs and the inputs'
contents afterwards must equal eager's.  Oracle: eager torch.

A second property draws training programs: ``w`` needs a gradient, ``b``
does not and is written between reads.  Gradients, outputs and ``b``
afterwards must equal eager's, over two steps.

A failure prints the program as Python source.  This tier found a
scatter ordered after a kernel that read the old value beside the new one
(``passes/in_place.py``): the compile failed with a cycle; and torch's
min-cut partitioner recomputing a read of ``b`` in the backward after the
write (``compiler/partition.py``): a wrong gradient.
"""

from __future__ import annotations

import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from tests.compare import assert_close_tree
from tests.test_fusion_property import PROPERTY_SETTINGS

# Each example compiles twice and runs its kernels in the interpreter (about
# 0.25 s); 120 found the cycle above without its fix, 60 did not.
EXAMPLES = 120
TRAINING_EXAMPLES = 60

# Statements over inputs ``a`` and ``b`` (4 x 5 float32) and ``idx`` (two
# distinct rows); ``out`` collects what the program returns.
STATEMENTS = [
    "a.add_(b)",
    "a[1:].mul_(2)",
    "a[:, 0].copy_(b[:, 1])",
    "a.transpose(0, 1).add_(1)",
    "b.index_put_((idx,), a[idx] * 3)",
    "b.index_copy_(0, idx, a[idx] + 1)",
    "a.clamp_(-0.5, 0.5)",
    "b[::2].sub_(a[::2])",
    "a.scatter_add_(0, idx.unsqueeze(1).expand(-1, 5), b[:2])",
    "a.view(-1)[3:7].fill_(7)",
    "a.masked_fill_(b > 0, 0.25)",
    "b.relu_()",
    "a.mul_(b.sum())",
    "a.mul_(0.9).add_(b, alpha=0.1)",
    "b.lerp_(a, 0.3)",
    "b.copy_(a.flip(0))",
    "a.copy_(a.t().reshape(4, 5))",
    "b.index_fill_(0, idx, -1.0)",
    "a[idx] = b[:2]",
    "a.div_(b.abs() + 1)",
    "a.addcmul_(b, b, value=0.5)",
    "b.swapaxes(0, 1)[1].zero_()",
    "out.append(a.sum(0))",
    "out.append(b * a)",
    "out.append(a[0].clone())",
    "out.append(a.mean())",
    "out.append(a[1:])",
    "out.append(b.t())",
    "out.append(a.t() @ b)",
    "out.append(a.cumsum(1))",
    "out.append(torch.softmax(a, -1))",
    "out.append(b.sum(1, keepdim=True) * a)",
    "t = a * 2\n    t[0].add_(b[1])\n    out.append(t)",
]


@st.composite
def programs(draw) -> tuple[str, bool, int]:
    lines = draw(st.lists(st.sampled_from(STATEMENTS), min_size=2, max_size=8))
    body = "".join(f"    {line}\n" for line in lines)
    source = f"def program(a, b, idx):\n    out = []\n{body}    out.append(a + b)\n    return out\n"
    return source, draw(st.booleans()), draw(st.integers(0, 2**16))


CHAINED = {"cudagraphs": True, "chain": True}


def _inputs(aliased: bool, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([2, 0])
    if aliased:  # two views of one tensor's rows
        base = torch.randn(8, 5, generator=g)
        return [base[:4], base[4:], idx]
    return [torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g), idx]


@settings(PROPERTY_SETTINGS, max_examples=EXAMPLES)
@given(programs())
def test_in_place_programs_match_eager(drawn: tuple[str, bool, int]) -> None:
    source, aliased, seed = drawn
    note(f"Failing program (inputs aliased: {aliased}, seed {seed}):\n\n{source}")
    scope = {"torch": torch}
    exec(source, scope)
    program = scope["program"]
    # The last: reduce-overhead with the kernels chained (``passes/chain.py``),
    # the stages ordered around the inputs written in place.
    for how in ({"mode": "default"}, {"mode": "reduce-overhead"}, {"options": CHAINED}):
        torch._dynamo.reset()
        compiled = torch.compile(program, backend="tilec", **how)
        for _ in range(2):
            mine, theirs = _inputs(aliased, seed), _inputs(aliased, seed)
            with torch.no_grad():
                assert_close_tree(compiled(*mine), program(*theirs), 1e-5, 1e-5)
            assert_close_tree(mine, theirs, 1e-5, 1e-5)


# Training programs: ``y`` starts as ``w * 1`` (``w`` needs a gradient);
# ``b`` (no gradient) is written between reads.
TRAINING_STATEMENTS = [
    "b.add_(w.detach())",
    "b[1:].mul_(2)",
    "b.index_put_((idx,), (w[idx] * 3).detach())",
    "b.index_copy_(0, idx, b[idx] + 1)",
    "b.clamp_(-0.5, 0.5)",
    "b.lerp_(w.detach(), 0.3)",
    "b.relu_()",
    "y = y * b",
    "y = y + b.t().reshape(4, 5)",
    "y = torch.tanh(y) * b.sum()",
    "y = y[idx].sum(0, keepdim=True) + y",
    "y = torch.softmax(y, -1) * (b + 1)",
    "y = y.cumsum(0)",
    "y = y.index_add(0, idx, b[:2])",
]


@st.composite
def training_programs(draw) -> tuple[str, int]:
    lines = draw(st.lists(st.sampled_from(TRAINING_STATEMENTS), min_size=2, max_size=8))
    body = "".join(f"    {line}\n" for line in lines)
    source = f"def program(w, b, idx):\n    y = w * 1\n{body}    return (y * y).sum(), b * 2\n"
    return source, draw(st.integers(0, 2**16))


def _train(program, seed: int) -> list[torch.Tensor] | None:
    """Two steps of ``program``: losses, outputs, gradients and ``b`` after
    each; None where eager refuses it (a value saved for the backward
    written after)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 5, generator=g).requires_grad_()
    b = torch.randn(4, 5, generator=g)
    found = []
    for _ in range(2):
        loss, doubled = program(w, b, torch.tensor([2, 0]))
        try:
            loss.backward()
        except RuntimeError as error:
            if "modified by an inplace operation" in str(error):
                return None
            raise
        found += [loss.detach(), doubled, w.grad.clone(), b.clone()]
    return found


@settings(PROPERTY_SETTINGS, max_examples=TRAINING_EXAMPLES)
@given(training_programs())
def test_training_programs_writing_an_input_match_eager(drawn: tuple[str, int]) -> None:
    source, seed = drawn
    note(f"Failing program (seed {seed}):\n\n{source}")
    scope = {"torch": torch}
    exec(source, scope)
    program = scope["program"]
    expected = _train(program, seed)
    if expected is None:
        return
    torch._dynamo.reset()
    actual = _train(torch.compile(program, backend="tilec"), seed)
    # Values grow to hundreds over the steps: float32 rounding against
    # the largest of each, as the order of sums differs.
    for mine, theirs in zip(actual, expected, strict=True):
        scale = max(1.0, theirs.abs().max().item())
        torch.testing.assert_close(mine, theirs, atol=1e-5 * scale, rtol=1e-4)

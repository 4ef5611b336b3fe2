"""Attention written out, trained through tilec (``compiler/attention_training.py``):
rewritten to ``scaled_dot_product_attention`` before AOTAutograd, so that
neither the forward nor the backward holds an ``M x N`` tensor; gradients
against float64 eager."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F

import tilec
from tilec import index as ix

B, H, M, E = 2, 2, 48, 16


@pytest.fixture(autouse=True)
def _free_programs():
    yield
    torch._dynamo.reset()
    gc.collect()  # training's programs sit in reference cycles (autograd's graph)


def _masked_fill(q, k, v, mask):
    """GPT-2's (the old transformers code): a boolean causal mask filled with -inf."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return F.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v


def _additive(q, k, v, mask):
    """transformers' eager attention: scale, additive mask, float32 softmax cast
    back, dropout that is off."""
    s = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    p = F.softmax(s + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(p, p=0.0, training=True), v)


def _returns_probabilities(q, k, v, mask):
    p = F.softmax(q @ k.transpose(-1, -2) * 0.25 + mask, dim=-1)
    return p @ v, p


def _causal(form):
    upper = torch.triu(torch.ones(M, M, dtype=torch.bool), 1)
    if form is _masked_fill:
        return upper
    return torch.zeros(M, M).masked_fill(upper, torch.finfo(torch.float32).min)


def _train(fn):
    """tilec's gradients against float64 eager's; returns the programs."""
    torch._dynamo.reset()
    gc.collect()
    tilec.reset_stats()
    mask = _causal(fn)
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(B, H, M, E, generator=g, requires_grad=True) for _ in range(3)]
    outputs = torch.compile(fn, backend="tilec")(*leaves, mask)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    weights = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outputs]
    loss = sum((o * w.float()).sum() for o, w in zip(outputs, weights))
    grads = torch.autograd.grad(loss, leaves)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    expected = fn(*exact, mask.double() if mask.is_floating_point() else mask)
    expected = expected if isinstance(expected, tuple) else (expected,)
    exact_loss = sum((o * w).sum() for o, w in zip(expected, weights))
    for got, want in zip(grads, torch.autograd.grad(exact_loss, exact)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert tilec.stats()["fallbacks"] == {}
    return list(tilec.programs().values())


def _largest(program) -> int:
    """Elements of the largest tensor in the program's graph (inputs included:
    a backward's inputs are what the forward saved)."""
    return max(ix.hint(ix.numel(n.shape), {}) for n in program.graph.nodes.values())


@pytest.mark.parametrize("fn", [_masked_fill, _additive], ids=["masked_fill", "additive"])
def test_written_out_attention_trains_without_the_scores(fn):
    """One SDPA call forward and one backward (library calls): no program
    holds a tensor of the B x H x M x N scores."""
    programs = _train(fn)
    assert len(programs) == 2
    for program in programs:
        assert _largest(program) < B * H * M * M, program.graph.name
        assert program.step_counts()["library"] >= 1


def test_probabilities_read_elsewhere_are_left_alone():
    """Probabilities returned (``output_attentions``): nothing is rewritten,
    the gradients through both outputs are right."""
    programs = _train(_returns_probabilities)
    assert max(_largest(program) for program in programs) == B * H * M * M


def test_a_row_with_every_key_masked_gives_zero_as_sdpa_does():
    """The one difference from eager, stated in attention_training.py: a
    fully masked row (eager: nan) is 0 in the output and the gradients, as
    SDPA (and Inductor's same rewrite) gives."""
    mask = torch.triu(torch.ones(M, M, dtype=torch.bool), 1)
    mask[5] = True
    leaves = [torch.randn(B, H, M, E, requires_grad=True) for _ in range(3)]
    out = torch.compile(_masked_fill, backend="tilec")(*leaves, mask)
    (q_grad,) = torch.autograd.grad(out.sum(), leaves[:1])
    assert torch.isnan(_masked_fill(*(t.detach() for t in leaves), mask)[:, :, 5]).all()
    assert (out[:, :, 5] == 0).all() and (q_grad[:, :, 5] == 0).all()
    assert torch.isfinite(out).all()

"""The attention backward template (``compiler/attention_grad.py``,
``codegen/attention_grad.py``): FlexAttention trained through tilec, its
gradients against the same attention written with materialized scores in
float64 (torch 2.13 has no FlexAttention backward on a CPU: eager refuses
``requires_grad`` inputs there, so these tests lift that check), on the
Triton interpreter and on tilec's IR interpreter."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tilec
from tilec.attention import key_range
from tilec.codegen.attention_grad import _transposed


@pytest.fixture(autouse=True)
def _cpu_backward(monkeypatch):
    """FlexAttention refuses inputs that need gradients on a CPU before it
    traces anything; tilec's backward is what runs here, so let them in."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    yield
    # Training keeps programs in reference cycles (autograd's graph): collect
    # them, so that later tests see only their own in tilec.programs().
    torch._dynamo.reset()
    gc.collect()


def _causal(b, h, q, kv):
    return q >= kv


def _window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 9)


def _documents(doc):
    def mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return mask


def _alibi(slopes):
    def score_mod(score, b, h, q, kv):
        return score + slopes[h] * (kv - q).to(score.dtype)

    return score_mod


def _softcap(score, b, h, q, kv):
    return 5.0 * torch.tanh(score / 5.0)


def _grid(batch, heads, m, n):
    return (
        torch.arange(batch).view(-1, 1, 1, 1),
        torch.arange(heads).view(1, -1, 1, 1),
        torch.arange(m).view(1, 1, -1, 1),
        torch.arange(n).view(1, 1, 1, -1),
    )


def _materialized(q, k, v, score_mod=None, mask_mod=None):
    """Attention with every score in memory (FlexAttention's semantics: a row
    with nothing unmasked gives 0), differentiable by torch's autograd."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    b, h, m, n = _grid(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if score_mod is not None:
        s = score_mod(s, b, h, m, n)
    if mask_mod is not None:
        s = torch.where(mask_mod(b, h, m, n), s, -math.inf)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return p @ v


def _qkv(batch=1, heads=2, m=40, n=40, e=16, kv_heads=None, ev=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, m, e, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads or heads, n, e, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads or heads, n, ev or e, generator=g, dtype=torch.float64)
    return q, k, v


def _train(q, k, v, score_mod=None, mask_mod=None, options=None, tolerance=2e-5, block=128):
    """tilec's output and gradients (float32) against the float64 reference's
    (a block mask of ``block``-sized blocks for ``mask_mod``); returns the
    backward program's kernels (none under the IR interpreter)."""
    torch._dynamo.reset()
    gc.collect()  # the programs of earlier calls (tilec.programs() holds them weakly)
    tilec.reset_stats()
    batch, heads, m, _ = q.shape
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(
            mask_mod, batch, heads, m, k.shape[2], "cpu", BLOCK_SIZE=block
        )
    gqa = q.shape[1] != k.shape[1]

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)

    weights = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = torch.compile(fn, backend="tilec", options=options)(*leaves)
    (out * weights.float()).sum().backward()
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _materialized(*exact, score_mod=score_mod, mask_mod=mask_mod)
    (expected * weights).sum().backward()
    torch.testing.assert_close(out.double(), expected.detach(), atol=tolerance, rtol=tolerance)
    for name, got, want in zip("qkv", leaves, exact):
        torch.testing.assert_close(
            got.grad.double(), want.grad, atol=tolerance, rtol=tolerance, msg=f"d{name}"
        )
    stats = tilec.stats()
    # Without a block mask, flex_attention builds a full one in the graph: a
    # sort that lowering counts and dead-code elimination removes (as in
    # test_attention.py).
    unread = {} if mask_mod is not None else {"aten.sort.stable": 1}
    assert stats["fallbacks"] == unread and stats["extern_calls"] == 0, stats
    if (options or {}).get("interpret"):
        return []  # no kernels: the IR interpreter ran the graphs
    (backward,) = [p for name, p in tilec.programs().items() if "backward" in name]
    return [step.kernel for step in backward.launches()]


@pytest.mark.parametrize(
    "mask_mod, score_mod",
    [
        (_causal, None),
        (_window, None),
        (_causal, _alibi(torch.tensor([0.5, 0.25]))),
        (_documents(torch.tensor([0] * 13 + [1] * 20 + [2] * 7)), None),
        (None, _softcap),
    ],
    ids=["causal", "sliding-window", "alibi", "documents", "softcap"],
)
def test_flex_attention_gradients_in_two_kernels(mask_mod, score_mod):
    """Output and dq, dk, dv match the materialized reference; the backward
    is two attention kernels (dq; dk and dv) beside small row reductions,
    with no fallback and no library call."""
    templates = [
        kernel.template for kernel in _train(*_qkv(), score_mod=score_mod, mask_mod=mask_mod)
    ]
    assert templates.count("attention_grad") == 2, templates
    assert "gemm" not in templates, templates


def test_grouped_query_attention_sums_the_group_in_registers():
    """Four query heads share each of two key/value heads (odd lengths, a
    value head dimension unlike q's): dk and dv summed over the group."""
    q, k, v = _qkv(batch=2, heads=4, kv_heads=2, m=37, n=45, ev=8)
    kernels = _train(q, k, v, score_mod=_softcap, mask_mod=_causal)
    assert [kernel.template for kernel in kernels].count("attention_grad") == 2


def test_document_masks_walk_the_block_lists_both_ways():
    """Packed documents in 32-blocks: the dq kernel walks the key blocks
    listed for its query block, the dk/dv kernel the query blocks listed
    for its key block (GQA: per query head of the group)."""
    q, k, v = _qkv(heads=4, kv_heads=2, m=100, n=100)
    doc = torch.tensor([0] * 30 + [1] * 45 + [2] * 25)
    kernels = _train(q, k, v, mask_mod=_documents(doc), block=32)
    grads = [kernel for kernel in kernels if kernel.template == "attention_grad"]
    assert len(grads) == 2 and all("listed = partial" in kernel.source for kernel in grads)


def test_a_single_query_row_and_rows_with_nothing_unmasked():
    """One query row against many keys; and rows whose every key is masked
    (a late-keys mask): their gradients are 0, as the reference's."""
    _train(*_qkv(m=1, n=70))

    def late(b, h, q, kv):
        return (kv >= 30) & (kv <= q)

    _train(*_qkv(m=40, n=40), mask_mod=late)


def test_the_ir_interpreter_agrees():
    """The backward nodes' reference (scores materialized in torch) gives
    the same gradients: tilec's IR interpreter runs the graph."""
    q, k, v = _qkv(heads=4, kv_heads=2, m=33, n=29)
    _train(q, k, v, score_mod=_softcap, mask_mod=_window, options={"interpret": True})


def test_the_log_sum_exp_gradient_reaches_q_and_k():
    """A loss on the returned log-sum-exp: its gradient enters through
    ``delta`` (every row's dp shifted by it)."""
    q, k, v = _qkv(m=24, n=24)
    block_mask = create_block_mask(_causal, 1, 2, 24, 24, "cpu")

    def fn(q, k, v):
        out, lse = flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        return out.sum() + (lse * lse).sum()

    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    torch.compile(fn, backend="tilec")(*leaves).backward()

    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    b, h, m, n = _grid(1, 2, 24, 24)
    s = exact[0] @ exact[1].transpose(-1, -2) / 4.0
    s = torch.where(m >= n, s, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    (torch.softmax(s, dim=-1) @ exact[2]).sum().add((lse * lse).sum()).backward()
    for got, want in zip(leaves, exact):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-5, rtol=2e-5)
    assert tilec.stats()["fallbacks"] == {}


def test_a_buffer_that_needs_a_gradient_falls_back_counted():
    """ALiBi slopes being trained: the template computes no gradient of a
    buffer, so the backward op falls back (counted) and is still right."""
    q, k, v = (t.float().requires_grad_() for t in _qkv(m=16, n=16))
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)

    def fn(q, k, v, slopes):
        return flex_attention(q, k, v, score_mod=_alibi(slopes))

    torch.compile(fn, backend="tilec")(q, k, v, slopes).sum().backward()
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, slopes)]
    _materialized(*exact[:3], score_mod=_alibi(exact[3])).sum().backward()
    torch.testing.assert_close(slopes.grad.double(), exact[3].grad, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(q.grad.double(), exact[0].grad, atol=2e-5, rtol=2e-5)
    fallbacks = tilec.stats()["fallbacks"]
    assert fallbacks.get("higher_order.flex_attention_backward") == 1, fallbacks


@pytest.mark.parametrize("constraint", [(1, -1, 0), (1, -1, 5), (-1, 1, 9), (0, 1, -7), (2, -3, 4)])
def test_the_query_range_of_a_key_tile_keeps_every_allowed_row(constraint):
    """dk/dv programs walk the query rows the transposed constraints allow:
    every (row, key) the constraint admits is inside."""
    found = _transposed([constraint])
    a, b, c = constraint
    for first in range(0, 30, 8):
        last = min(first + 7, 29)
        start, end = key_range(found, first, last, 30)
        for key in range(first, last + 1):
            for row in range(30):
                if a * row + b * key + c >= 0:
                    assert start <= row < end, (constraint, key, row, start, end)


def test_backward_kernels_skip_masked_tiles():
    """Compiled for the GPU (sm_90 tiles), the dq and dk/dv kernels of causal
    attention at 1024 count about half the square's FLOPs (the key tiles a
    row tile sees, the query tiles a key tile is seen by)."""
    from tests.lowering import gpu_kernels
    from tests.test_ptx import _flex_training

    q, k, v, do = (torch.randn(1, 2, 1024, 64, dtype=torch.float16) for _ in range(4))
    fn, blocks = _flex_training(1024, 1024)
    kernels = [kernel for _, kernel in gpu_kernels(fn, q, k, v, do, *blocks)]
    grads = [kernel for kernel in kernels if kernel.template == "attention_grad"]
    assert len(grads) == 2
    # Per (row, key): dq's kernel 2 * (2E + Ev) FLOPs, dk/dv's 4 * (E + Ev).
    square = 2 * 1024 * 1024
    dq, dkdv = sorted(grads, key=lambda kernel: kernel.flops)
    assert dq.flops <= 0.6 * square * 2 * (2 * 64 + 64), dq.flops
    assert dkdv.flops <= 0.6 * square * 4 * (64 + 64), dkdv.flops
    assert dkdv.flops >= 0.5 * square * 4 * (64 + 64), dkdv.flops

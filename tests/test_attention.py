"""The attention template (``compiler/attention.py``, ``codegen/attention.py``):
FlexAttention lowered to one fused kernel, against eager (float32, Triton
interpreter) and against the IR interpreter."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tilec
from tests.compare import assert_close_tree, run_tilec


def _causal(b, h, q, kv):
    return q >= kv


def _sliding(window):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv <= window)

    return mask


def _relative(score, b, h, q, kv):
    return score + (q - kv).to(score.dtype) * 0.1


def _alibi(slopes):
    def score_mod(score, b, h, q, kv):
        return score + slopes[h] * (kv - q).to(score.dtype)

    return score_mod


def _documents(doc):
    def mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return mask


# Without a block mask, flex_attention builds a full one in the graph (a
# sort): lowering counts the sort's fallback, which the template never reads,
# and dead-code elimination removes it (no library call runs; see the note
# in docs/architecture.md, known limits).
DEFAULT_BLOCK_MASK = {"aten.sort.stable": 1}


def _check(fn, *inputs, kernels=1, atol=2e-5, rtol=2e-5, fallbacks=None):
    """``fn`` through tilec matches eager, in ``kernels`` kernels, with no
    fallback (but ``fallbacks``, counted and never run) and no library
    call; returns tilec's result."""
    with torch.no_grad():
        expected = fn(*inputs)
    actual = run_tilec(fn, *inputs)
    assert_close_tree(actual, expected, atol, rtol)
    stats = tilec.stats()
    assert stats["fallbacks"] == (fallbacks or {}), stats
    assert stats["extern_calls"] == 0, stats
    (program,) = tilec.programs().values()
    templates = [step.kernel.template for step in program.launches()]
    assert templates.count("attention") == 1 and len(templates) == kernels, templates
    assert program.step_counts().get("library", 0) == 0
    return actual


def _qkv(batch=1, heads=2, m=64, n=64, e=16, kv_heads=None, ev=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, m, e, generator=g)
    k = torch.randn(batch, kv_heads or heads, n, e, generator=g)
    v = torch.randn(batch, kv_heads or heads, n, ev or e, generator=g)
    return q, k, v


@pytest.mark.parametrize(
    "name, mask_mod, score_mod",
    [
        ("causal", _causal, None),
        ("causal+relative", _causal, _relative),
        ("sliding window", _sliding(8), None),
        ("alibi", _causal, _alibi(torch.tensor([0.5, 0.25]))),
        ("documents", _documents(torch.tensor([0] * 20 + [1] * 30 + [2] * 14)), None),
        ("no mask", None, _relative),
    ],
)
def test_flex_attention_is_one_kernel_matching_eager(name, mask_mod, score_mod):
    q, k, v = _qkv()
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, 1, 2, 64, 64, "cpu")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

    _check(fn, q, k, v, fallbacks=None if mask_mod else DEFAULT_BLOCK_MASK)


def test_grouped_query_attention_indexes_shared_heads():
    q, k, v = _qkv(heads=4, kv_heads=2, ev=8)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, enable_gqa=True)

    _check(fn, q, k, v, fallbacks=DEFAULT_BLOCK_MASK)


@pytest.mark.parametrize("m, n", [(37, 77), (1, 50), (5, 130)])
def test_odd_lengths_and_a_single_query_row(m, n):
    q, k, v = _qkv(batch=2, m=m, n=n, e=24)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, scale=0.3)

    _check(fn, q, k, v, fallbacks=DEFAULT_BLOCK_MASK)


def test_fully_masked_rows_give_zero_and_minus_inf_log_sum_exp():
    """Row 0 sees no position (kv < q): eager's output is 0 there and its
    log-sum-exp -inf; the template's are the same."""
    q, k, v = _qkv(m=32, n=32)
    block_mask = create_block_mask(lambda b, h, q, kv: kv < q, 1, 2, 32, 32, "cpu", BLOCK_SIZE=16)

    def fn(q, k, v):
        out, lse = flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        return out, lse

    out, lse = _check(fn, q, k, v, kernels=2)  # the log-sum-exp's base-2 scaling
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -float("inf")).all()


def test_the_ir_interpreter_agrees(tmp_path):
    """option interpret runs the graph's IR, the template's reference semantics."""
    q, k, v = _qkv(m=33, n=40)
    block_mask = create_block_mask(_sliding(5), 1, 2, 33, 40, "cpu", BLOCK_SIZE=16)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, block_mask=block_mask, return_lse=True)

    with torch.no_grad():
        expected = fn(q, k, v)
    actual = run_tilec(fn, q, k, v, options={"interpret": True})
    assert_close_tree(actual, expected, 2e-5, 2e-5)


def test_bf16_on_a_cpu_falls_back_counted():
    """The interpreter has no bf16 dot: the op runs in ATen, counted."""
    q, k, v = (t.bfloat16() for t in _qkv())
    block_mask = create_block_mask(_causal, 1, 2, 64, 64, "cpu")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, block_mask=block_mask)

    with torch.no_grad():
        expected = fn(q, k, v)
    assert_close_tree(run_tilec(fn, q, k, v), expected)
    assert tilec.stats()["fallbacks"] == {"higher_order.flex_attention": 1}

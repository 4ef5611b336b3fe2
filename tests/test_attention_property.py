"""Property tests of the attention template: the key ranges it visits never
leave out a position the mask allows, and random FlexAttention score and
mask modifications match eager (float32, Triton interpreter)."""

from __future__ import annotations

import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tilec
from tests.compare import assert_close_tree, run_tilec
from tilec.attention import key_range

constraints = st.lists(
    st.tuples(st.integers(-3, 3), st.integers(-3, 3), st.integers(-40, 40)).filter(
        lambda c: c[1] != 0
    ),
    max_size=3,
)


@settings(max_examples=400, derandomize=True, database=None, deadline=None)
@given(constraints, st.integers(0, 60), st.integers(0, 20), st.integers(1, 70))
def test_key_range_keeps_every_allowed_position(found, first, rows, n):
    """For rows ``first .. first + rows``: every key position in ``[0, n)``
    that satisfies all constraints lies in the range the kernel visits."""
    last = first + rows
    start, end = key_range(found, first, last, n)
    assert 0 <= start <= end <= n
    for m in range(first, last + 1):
        for key in range(n):
            if all(a * m + b * key + c >= 0 for a, b, c in found):
                assert start <= key < end, (m, key, start, end)


# Score modifications: (text for the failure report, function).
SCORE_MODS = {
    "none": lambda s, b, h, q, kv: s,
    "relative": lambda s, b, h, q, kv: s + (q - kv).to(s.dtype) * 0.05,
    "softcap": lambda s, b, h, q, kv: 5.0 * torch.tanh(s / 5.0),
    "head scale": lambda s, b, h, q, kv: s * (h + 1).to(s.dtype),
    "where": lambda s, b, h, q, kv: torch.where(q % 3 == 0, s * 2.0, s - 1.0),
}
# Mask pieces combined with ``&``: linear ones the template can skip by, and others.
MASK_PIECES = {
    "causal": lambda b, h, q, kv: q >= kv,
    "window": lambda b, h, q, kv: q - kv <= 9,
    "shifted": lambda b, h, q, kv: kv + 3 <= q,
    "lookahead": lambda b, h, q, kv: kv <= q + 5,
    "late keys": lambda b, h, q, kv: kv >= 7,
    "even keys": lambda b, h, q, kv: kv % 2 == 0,
    "per head": lambda b, h, q, kv: (h == 0) | (q >= kv),
}


def _mask(names):
    def mask(b, h, q, kv):
        keep = q >= 0
        for name in names:
            keep = keep & MASK_PIECES[name](b, h, q, kv)
        return keep

    return mask


@settings(max_examples=12, derandomize=True, database=None, deadline=None)
@given(
    st.sampled_from(sorted(SCORE_MODS)),
    st.lists(st.sampled_from(sorted(MASK_PIECES)), max_size=3, unique=True),
    st.integers(1, 150),
    st.integers(1, 150),
)
def test_random_flex_modifications_match_eager(score, pieces, m, n):
    note(f"score_mod {score!r}, mask pieces {pieces}, {m} query rows, {n} keys")
    torch._dynamo.reset()
    tilec.reset_stats()
    g = torch.Generator().manual_seed(m * 1000 + n)
    q, k, v = (torch.randn(1, 2, size, 16, generator=g) for size in (m, n, n))
    block_mask = create_block_mask(_mask(pieces), 1, 2, m, n, "cpu", BLOCK_SIZE=32)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=SCORE_MODS[score], block_mask=block_mask)

    with torch.no_grad():
        expected = fn(q, k, v)
    assert_close_tree(run_tilec(fn, q, k, v), expected, 3e-5, 3e-5)
    assert tilec.stats()["fallbacks"] == {}

"""Decode attention with the query heads that share keys and values packed
into one program's tile (``attention.head_group``; ``codegen/attention.py``),
and keys and values read through ``repeat_kv``'s copy
(``passes/attention_copies.py``): against eager (float32, Triton
interpreter) and the IR interpreter."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch.nn.attention.flex_attention import flex_attention

import tilec
from tests.compare import assert_close_tree, run_tilec
from tests.test_attention import _qkv
from tilec import index as ix
from tilec.attention import QK, attention_node, head_group
from tilec.ir import Const, Load


def _attention_launch(program):
    """The attention kernel's launch step, and its key chunks (1: not split)."""
    (step,) = [s for s in program.launches() if s.kernel.template == "attention"]
    source = step.kernel.source
    splits = int(source.split("sp = pid % ")[1].split("\n")[0]) if "sp = pid %" in source else 1
    return step, splits


def _per_head(score, b, h, q, kv):
    """A score that differs per query head: a packed row's head must be its own."""
    return score + (h + 1).to(score.dtype) * 0.05 * (kv - q).to(score.dtype)


@pytest.mark.parametrize("combine", [False, True], ids=["combine kernel", "combined in kernel"])
def test_a_decode_row_of_grouped_heads_is_one_program_per_key_value_head(combine):
    """8 query heads over 2 key/value heads, one row each, a score per
    head: a program's tile holds the 4 heads of one key/value head (the
    grid is the batch times 2 key/value heads times the chunks); the output
    and log-sum-exp match eager's, with the chunks combined by another
    kernel or by the last program of each tile (``split_combine``; the
    log-sum-exp's combine stays a kernel of its own either way)."""
    q, k, v = _qkv(batch=2, heads=8, kv_heads=2, m=1, n=700)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_per_head, enable_gqa=True, return_lse=True)

    with torch.no_grad():
        expected = fn(q, k, v)
    got = run_tilec(fn, q, k, v, options={"split_combine": combine})
    assert_close_tree(got, expected, 2e-5, 2e-5)
    (program,) = tilec.programs().values()
    step, splits = _attention_launch(program)
    assert splits > 1
    assert step.kernel.launch.grid == (2 * 2 * splits,)
    assert ("combined by the row tile's last program" in step.kernel.group.reason) == combine


def _windowed(m: int, n: int, window: int):
    """SDPA over keys up to each row's position (the last ``m`` of ``n``),
    within ``window`` of it, the mask built from positions in the graph
    (the template's linear constraints: tiles outside are skipped)."""

    def fn(q, k, v):
        rows = torch.arange(m)[:, None] + (n - m)
        keys = torch.arange(n)[None, :]
        mask = (keys <= rows) & (rows - keys < window)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True
        )

    return fn


@pytest.mark.parametrize("interpret", [False, True], ids=["kernels", "IR interpreter"])
def test_two_decode_rows_of_eight_heads_fill_a_tile_under_a_window(interpret):
    """Two rows (speculative decode) of 16 query heads over 2 key/value
    heads: a program's 16 rows are 8 heads' two rows each.  The window
    rules out most of the keys for both rows; the tile's key range is the
    rows' (the first key block visited is past 0)."""
    m, n = 2, 400
    q, k, v = _qkv(heads=16, kv_heads=2, m=m, n=n)
    fn = _windowed(m, n, 90)
    with torch.no_grad():
        expected = fn(q, k, v)
    got = run_tilec(fn, q, k, v, options={"interpret": interpret})
    assert_close_tree(got, expected, 2e-5, 2e-5)
    if interpret:
        return
    (program,) = tilec.programs().values()
    step, splits = _attention_launch(program)
    assert step.kernel.launch.grid == (2 * splits,)
    assert "m_first = 0" in step.kernel.source


def test_repeat_kv_copies_are_read_through_and_the_heads_packed():
    """transformers' ``repeat_kv`` (the key/value heads expanded and
    reshaped: a copy) before SDPA: attention reads the cache itself, one
    program per key/value head; no kernel writes the copy."""
    q, k, v = _qkv(heads=8, kv_heads=2, m=1, n=300)

    def fn(q, k, v):
        k, v = (t[:, :, None].expand(1, 2, 4, 300, 16).reshape(1, 8, 300, 16) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    with torch.no_grad():
        expected = fn(q, k, v)
    assert_close_tree(run_tilec(fn, q, k, v), expected, 2e-5, 2e-5)
    (program,) = tilec.programs().values()
    step, splits = _attention_launch(program)
    assert step.kernel.launch.grid == (2 * splits,)
    graph_nodes = program.graph.nodes.values()
    assert not [n for n in graph_nodes if n.kind == "pointwise" and n.shape[-2:] == (300, 16)]


def _node(head: sympy.Expr, heads: int = 8, m: int = 1):
    """An attention node whose keys and values are read at head ``head``."""
    i0, i1, i2, i3 = ix.out_symbols(4)
    r0, r1 = ix.reduce_symbols(2)
    loads = (
        Load(0, (i0, i1, i2, r1), torch.float32),
        Load(1, (i0, head, r0, r1), torch.float32),
        Load(2, (i0, head, r0, i3), torch.float32),
    )
    true = Const(True, torch.bool)
    return attention_node("out", (1, heads, m, 16), torch.float32, ("q", "k", "v"), loads,
                          QK, true, 0.0, (64, 16))  # fmt: skip


def test_the_heads_packed_are_those_whose_keys_and_values_are_one_anothers():
    i1 = ix.out_symbols(2)[1]
    # Key/value head h // 4: 4 heads share, as many as fit 16 rows.
    assert head_group(_node(sympy.floor(i1 / 4))) == 4
    assert head_group(_node(sympy.floor(i1 / 4), m=8)) == 2
    assert head_group(_node(sympy.floor(i1 / 4), m=16)) == 1
    # One key/value head for all.
    assert head_group(_node(sympy.Integer(0), heads=32)) == 16
    # Heads interleaved (h % 2: heads 0, 2, 4, ... share), each its own
    # (multi-head), and a layout whose head h reads row h // 4 of another
    # dimension mixed with the head: not packed.
    assert head_group(_node(sympy.Mod(i1, 2))) == 1
    assert head_group(_node(i1)) == 1
    assert head_group(_node(sympy.Mod(i1 + sympy.floor(i1 / 4), 3))) == 1

"""Attention reading a one-position cache update without waiting for it
(``passes/attention_cache.py``): a decode step with a static KV cache.

Oracles: eager torch (outputs and the caches after every step, over several
positions), the IR interpreter, and the graph itself (what attention reads,
the caches written in place, the launches)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tilec
from tests.compare import assert_close_tree
from tilec.attention import ATTENTION, SPLITS


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Step(nn.Module):
    """One decode step of grouped-query attention with a rotary embedding
    and a static cache (buffers, written at ``pos`` with ``index_copy_``)."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=8, cache=40, gqa_flag=True, batch=1):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.gqa_flag = (
            heads,
            kv_heads,
            head_dim,
            gqa_flag,
        )
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(batch, kv_heads, cache, head_dim))
        self.register_buffer("v_cache", torch.zeros(batch, kv_heads, cache, head_dim))
        freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", freq)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, d = x.shape[0], self.head_dim
        q = self.q(x).view(b, 1, self.heads, d).transpose(1, 2)
        k, v = self.kv(x).view(b, 1, 2 * self.kv_heads, d).transpose(1, 2).split(self.kv_heads, 1)
        angles = pos[:, None].float() * self.inv_freq
        table = torch.cat([angles, angles], dim=-1)
        cos, sin = table.cos().to(x.dtype), table.sin().to(x.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        mask = torch.arange(self.k_cache.shape[2], device=pos.device)[None, :] <= pos[:, None]
        keys, values = self.k_cache, self.v_cache
        if not self.gqa_flag:  # transformers' repeat_kv: expanded and copied
            group = self.heads // self.kv_heads
            keys, values = (
                t[:, :, None]
                .expand(b, self.kv_heads, group, *t.shape[2:])
                .reshape(b, self.heads, *t.shape[2:])
                for t in (keys, values)
            )
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.gqa_flag
        )


def _decode(gqa_flag: bool, options: dict | None = None, batch: int = 1) -> tuple[Step, Step]:
    """Several steps through tilec and eagerly: outputs and caches equal."""
    torch.manual_seed(0)
    eager = Step(gqa_flag=gqa_flag, batch=batch).eval()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tilec", options=options)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for position in (0, 1, 2, 7, 39, 3):
            x, pos = torch.randn(batch, 1, 32, generator=g), torch.tensor([position])
            assert_close_tree(compiled(x, pos), eager(x, pos), atol=2e-5, rtol=2e-5)
            assert_close_tree(model.k_cache, eager.k_cache, atol=1e-6, rtol=1e-6)
            assert_close_tree(model.v_cache, eager.v_cache, atol=1e-6, rtol=1e-6)
    return model, eager


@pytest.mark.parametrize(
    "gqa_flag, batch", [(True, 1), (False, 1), (True, 3)], ids=["enable_gqa", "repeat_kv", "batch"]
)
def test_attention_reads_the_cache_input_and_the_new_entry(gqa_flag, batch):
    """Attention reads the cache inputs (their old values) and computes the
    new entry and q's rotary embedding itself; the scatters still write the
    caches, in place, after it."""
    torch._dynamo.reset()
    _decode(gqa_flag, batch=batch)
    gc.collect()
    (program,) = tilec.programs().values()
    graph = program.graph
    attention = [n for n in graph.nodes.values() if n.reduce_op in (ATTENTION, *SPLITS)]
    assert attention
    for node in attention:
        kinds = {graph.nodes[i].kind for i in node.inputs}
        assert kinds <= {"input", "constant", "extern"}, kinds  # no scatter, no rotary node
        assert sum(graph.nodes[i].kind == "input" and graph.nodes[i].shape == (batch, 2, 40, 8)
                   for i in node.inputs) == 2  # fmt: skip
    scatters = [n for n in graph.nodes.values() if n.kind == "scatter"]
    assert len(scatters) == 2 and set(graph.in_place) == {s.name for s in scatters}
    order = [s.kernel.group.name for s in program.launches()]
    unit_of = {n: g.name for g in graph.groups for n in g.nodes}
    first_scatter = min(order.index(unit_of[s.name]) for s in scatters)
    assert all(order.index(unit_of[n.name]) < first_scatter for n in attention)


def test_the_ir_interpreter_agrees():
    torch._dynamo.reset()
    _decode(True, {"interpret": True})


def test_without_fusion_the_step_still_matches_eager():
    """Option ``fuse`` off: no attention node, so nothing to rewrite; the
    library attention and the cache writes still give eager's values."""
    torch._dynamo.reset()
    _decode(True, {"fuse": False})


def test_a_multi_position_update_is_left_alone():
    """A prefill writes several positions: attention keeps reading the
    scatter's result (and the result is eager's)."""

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Step().eval()
    model = copy.deepcopy(eager)

    def prefill(m: Step, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = m.q(x).view(b, t, m.heads, m.head_dim).transpose(1, 2)
        k, v = m.kv(x).view(b, t, 2 * m.kv_heads, m.head_dim).transpose(1, 2).split(m.kv_heads, 1)
        m.k_cache.index_copy_(2, pos, k)
        m.v_cache.index_copy_(2, pos, v)
        return F.scaled_dot_product_attention(q, m.k_cache, m.v_cache, enable_gqa=True)

    compiled = torch.compile(lambda x, pos: prefill(model, x, pos), backend="tilec")
    x, pos = torch.randn(1, 5, 32), torch.arange(5)
    with torch.no_grad():
        assert_close_tree(compiled(x, pos), prefill(eager, x, pos), atol=2e-5, rtol=2e-5)
    assert_close_tree(model.k_cache, eager.k_cache)
    gc.collect()
    (program,) = tilec.programs().values()
    graph = program.graph
    attention = [n for n in graph.nodes.values() if n.reduce_op in (ATTENTION, *SPLITS)]
    assert attention and all(
        any(graph.nodes[i].kind == "scatter" for i in n.inputs) for n in attention
    )


@pytest.mark.gpu
def test_a_bf16_decode_step_on_a_gpu_matches_eager():
    """On a GPU, in bf16, at TinyLlama's attention shape (32 query heads, 4
    key/value heads of 64, 2048 positions), where the cost model takes the
    template: the attention kernel computes the new entry and q's rotary
    embedding itself, the scatters write after it; outputs and caches as
    eager's within bf16's rounding."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    shape = dict(dim=2048, heads=32, kv_heads=4, head_dim=64, cache=2048)
    eager = Step(**shape).eval().to("cuda", torch.bfloat16)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tilec")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for position in (0, 1, 5, 2047):
            x = torch.randn(1, 1, 2048, generator=g).to("cuda", torch.bfloat16)
            pos = torch.tensor([position], device="cuda")
            assert_close_tree(compiled(x, pos), eager(x, pos), atol=2e-2, rtol=2e-2)
            assert_close_tree(model.k_cache, eager.k_cache, atol=2e-2, rtol=2e-2)
            assert_close_tree(model.v_cache, eager.v_cache)
    gc.collect()
    (program,) = tilec.programs().values()
    graph = program.graph
    attention = [n for n in graph.nodes.values() if n.reduce_op in (ATTENTION, *SPLITS)]
    assert attention and not any(
        graph.nodes[i].kind == "scatter" for n in attention for i in n.inputs
    )

"""Unit tier for the passes: the IR interpreter is the oracle.

Every pass must keep ``interpret(before) == interpret(after)`` on random
inputs, and must report what it did in its counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

from tests.compare import assert_close_tree, assert_matches_eager
from tests.lowering import lower, lower_with_constants
from tests.test_fusion_property import programs
from tilec.interpret import interpret
from tilec.ir import Graph, format_graph, view_base
from tilec.options import Options
from tilec.passes import constant_fold as constant_fold_module
from tilec.passes.constant_fold import constant_fold
from tilec.passes.cse import cse
from tilec.passes.dce import dce
from tilec.passes.fold_affine import fold_affine
from tilec.passes.fuse import MAX_INLINED, fuse, inlined_size
from tilec.passes.layout import layout
from tilec.passes.memory_plan import memory_plan
from tilec.passes.simplify import simplify
from tilec.pipeline import passes
from tilec.target import H100_SXM


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v


# name -> (function, inputs): graphs with reductions, views, externs, gathers, duplicates.
PROGRAMS: dict[str, tuple[Callable, tuple[torch.Tensor, ...]]] = {
    "softmax": (lambda x: torch.softmax(x, -1), (_r(5, 12),)),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (16,), w, b), (_r(3, 4, 16), _r(16), _r(16))),
    "gelu_mlp": (lambda x, w: F.gelu(x @ w).sum(-1), (_r(6, 8), _r(8, 10))),
    "attention": (_attention, (_r(2, 5, 16), _r(2, 7, 16), _r(2, 7, 16))),
    "duplicates": (lambda x: x.exp() * x.exp() + x.sum(0) + x.sum(0), (_r(4, 6),)),
    "views": (
        lambda x: x.t().reshape(3, 8).sin()[:, 1::2].unsqueeze(0).expand(2, 3, 4),
        (_r(4, 6),),
    ),
    "gather": (lambda t, i: F.embedding(i, t).mean(1), (_r(10, 8), torch.randint(0, 10, (3, 5)))),
    "argmax_where": (lambda x: torch.where(x > 0, x, -x).argmax(0), (_r(7, 3),)),
    "cat_pad": (lambda x, y: F.pad(torch.cat([x, y], 1), (1, 1)), (_r(2, 3), _r(2, 4))),
}

PASSES = {
    "simplify": simplify,
    "constant_fold": constant_fold,
    "fold_affine": fold_affine,
    "dce": dce,
    "cse": cse,
    "fuse": fuse,
    "no_fuse": lambda g: fuse(g, enabled=False),
    "layout": lambda g: layout(fuse(g)[0], "auto", gpu=True),
    "layout_unfused": lambda g: layout(fuse(g, enabled=False)[0], "auto", gpu=True),
    "memory_plan": lambda g: memory_plan(fuse(g)[0]),
}


def _check_same(before: Graph, after: Graph, inputs: tuple[torch.Tensor, ...]) -> None:
    assert_close_tree(interpret(after, list(inputs)), interpret(before, list(inputs)), 1e-6, 1e-6)


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("pass_name", sorted(PASSES))
def test_pass_preserves_meaning(program: str, pass_name: str) -> None:
    fn, inputs = PROGRAMS[program]
    graph = lower(fn, *inputs)
    after, counts = PASSES[pass_name](graph)
    _check_same(graph, after, inputs)
    assert all(isinstance(v, int) and v >= 0 for v in counts.values()), counts
    # Pure: the input graph is untouched (the printer shows no groups on it).
    assert graph.groups is None


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_pass_list_preserves_meaning(program: str) -> None:
    fn, inputs = PROGRAMS[program]
    graph = original = lower(fn, *inputs)
    for _, run in passes(Options()):
        graph, _ = run(graph)
    _check_same(original, graph, inputs)


def test_dce_removes_dead_nodes_and_keeps_inputs() -> None:
    x = _r(4, 6)
    graph = lower(lambda x, unused: x.exp().sum(-1), x, _r(3))
    exp = next(n for n in graph.nodes.values() if n.kind == "pointwise")
    dead = [dataclasses.replace(exp, name=f"dead{k}") for k in range(2)]
    padded = graph.replace_nodes([*graph.nodes.values(), *dead])
    out, counts = dce(padded)
    assert counts == {"removed": 2}
    assert "dead0" not in out.nodes and "dead1" not in out.nodes
    assert out.inputs == graph.inputs and all(i in out.nodes for i in graph.inputs)
    _check_same(padded, out, (x, _r(3)))
    assert dce(out)[1] == {"removed": 0}


def test_cse_merges_duplicates() -> None:
    x = _r(4, 6)
    graph = lower(lambda x: x.sin() + x.sin() * 2 + x.sum(0) + x.sum(0), x)
    out, counts = cse(graph)
    assert counts == {"merged": 2}
    assert sum(n.body is not None and "sin" in repr(n.body) for n in out.nodes.values()) == 1
    _check_same(graph, out, (x,))
    assert cse(out)[1] == {"merged": 0}


def test_cse_merges_nodes_whose_layouts_agree() -> None:
    """``x.sum(-1)``, an output (eager's layout, fixed), beside ``x.std(-1)``,
    whose mean sums the same rows in a node of free layout: one reduction,
    with the output's layout.  Two fixed layouts that differ stay apart."""
    x = _r(8, 16)
    graph = lower(lambda x: (x.sum(-1), x.std(-1)), x)
    row_sums = [
        n for n in graph.nodes.values() if n.kind == "reduction" and repr(n.body).startswith("Load")
    ]
    assert [n.stride for n in row_sums] == [(1,), None]
    out, counts = cse(graph)
    assert counts == {"merged": 1}
    (kept,) = [n for n in out.nodes.values() if n.kind == "reduction" and n.name in out.outputs]
    assert kept.stride == (1,)
    _check_same(graph, out, (x,))
    twice = dataclasses.replace(row_sums[0], name="other", stride=(2,))
    apart = graph.replace_nodes([*graph.nodes.values(), twice], [*graph.outputs, "other"])
    assert "other" in cse(apart)[0].nodes


def test_cse_keeps_random_ops_apart() -> None:
    graph = lower(lambda x: torch.rand_like(x) + torch.rand_like(x), _r(3))
    out, counts = cse(graph)
    assert counts == {"merged": 0}
    assert sum(n.kind == "extern" for n in out.nodes.values()) == 2


@pytest.mark.parametrize("program", ["softmax", "layer_norm"])
def test_fuse_makes_one_kernel_of_a_norm(program: str) -> None:
    fn, inputs = PROGRAMS[program]
    out, counts = fuse(lower(fn, *inputs))
    # Recomputed nodes (casts, copies) are inlined into every reader, in no group.
    compute = [
        n
        for n in out.nodes.values()
        if n.kind in ("pointwise", "reduction") and n.name not in out.recomputed()
    ]
    assert counts["kernels"] == 1 and len(out.groups) == 1
    assert counts["nodes_fused"] == len(compute) - 1
    (group,) = out.groups
    assert set(group.nodes) == {n.name for n in compute}
    assert group.reduce_shape and group.reason.startswith("fused")


def test_fuse_rejects_a_cycle_through_a_matmul() -> None:
    x, w = _r(4, 4), _r(4, 4)
    out, counts = fuse(lower(lambda x, w: torch.relu(x) @ w + torch.relu(x), x, w))
    assert counts["kernels"] == 2 and counts["rejected"] >= 1
    rejected = [d for d in out.decisions if d.outcome == "rejected" and d.reason == "cycle"]
    assert rejected and "would create a cycle through %mm" in rejected[0].detail, out.decisions


def test_fuse_rejects_reductions_over_different_spaces() -> None:
    out, counts = fuse(lower(lambda x: (x.sum(0), x.sum(1)), _r(4, 6)))
    assert counts["kernels"] == 2 and counts["rejected"] == 1
    (rejected,) = [d for d in out.decisions if d.outcome == "rejected"]
    assert rejected.stage == "fuse" and rejected.reason == "reduction_spaces"
    assert "reductions over different iteration spaces" in rejected.detail


def test_fuse_logs_each_accepted_merge_with_bytes_saved() -> None:
    out, counts = fuse(lower(lambda x: (x.exp() + 1).sin(), _r(8)))
    fused = [d for d in out.decisions if d.outcome == "fused"]
    assert counts == {"kernels": 1, "nodes_fused": 2, "rejected": 0}
    assert [d.reason for d in fused] == ["producer_consumer"] * 2
    assert all(d.bytes_saved == 2 * 8 * 4 for d in fused)  # an f32[8] written and read back
    assert all("saves 64 bytes" in d.text() for d in fused)


def test_fuse_on_a_gpu_target_records_the_predicted_time_each_merge_saves() -> None:
    """The bytes saved over the H100's 3.0 TB/s copy bandwidth, and one
    2.5 us launch; the interpreter has no figures, so no times."""
    graph = lower(lambda x: (x.exp() + 1).sin(), _r(8))
    fused = [d for d in fuse(graph, target=H100_SXM)[0].decisions if d.outcome == "fused"]
    assert [d.predicted_s for d in fused] == [(("saved", 64 / 3.0e12 + 2.5e-6),)] * 2
    assert "(predicted: saved 2.50 us)" in fused[0].text()
    assert all(d.predicted_s == () for d in fuse(graph)[0].decisions)


def test_fuse_disabled_gives_one_kernel_per_compute_node() -> None:
    fn, inputs = PROGRAMS["layer_norm"]
    graph = lower(fn, *inputs)
    out, counts = fuse(graph, enabled=False)
    # Recomputed nodes (a widening cast here) are inlined into their readers
    # even so: they never get a kernel of their own.
    recomputed = graph.recomputed()
    assert recomputed
    compute = [
        n
        for n in graph.nodes.values()
        if n.kind in ("pointwise", "reduction") and n.name not in recomputed
    ]
    assert counts["kernels"] == len(compute) == len(out.groups)
    assert counts["nodes_fused"] == 0
    assert out.decisions and all(d.outcome == "inlined" for d in out.decisions)
    assert all(g.reason == "single node" for g in out.groups)


def test_fuse_inlines_constants_into_every_reader() -> None:
    # The -inf fill is read by two kernels (separate by a matmul between them):
    # each recomputes it, and it gets no kernel of its own.
    def fn(x: torch.Tensor, m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        fill = torch.full((), float("-inf"))
        a = torch.where(m, fill, x).softmax(-1) @ w
        return torch.where(m, fill, a).softmax(-1)

    inputs = (_r(4, 4), torch.rand(4, 4) > 0.7, _r(4, 4))
    graph = lower(fn, *inputs)
    (fill,) = [n.name for n in graph.nodes.values() if n.kind == "pointwise" and not n.inputs]
    out, counts = fuse(graph)
    assert counts["kernels"] == 2
    assert all(fill not in g.nodes for g in out.groups)
    inlined = [d for d in out.decisions if d.outcome == "inlined"]
    assert (f"%{fill}", "reads_no_tensor") in [(d.subject, d.reason) for d in inlined]
    _check_same(graph, out, inputs)


def test_fuse_stores_a_constant_that_is_an_output() -> None:
    graph = lower(lambda x: (x + 1, torch.arange(5)), _r(3))
    out, counts = fuse(graph)
    assert counts["kernels"] == 2
    _check_same(graph, out, (_r(3),))


def _updated_in_place(x: torch.Tensor, links: int = 14) -> torch.Tensor:
    """``m[i % 8, i % 3:] += i`` for ``links`` values of ``i`` (a mask built
    as Swin builds its shifted windows'), as functionalization writes it:
    each link reads the one before twice, at the slice it updates and
    everywhere else."""
    m = torch.zeros(8, 8)
    for i in range(links):
        row = m[i % 8].slice_scatter(m[i % 8, i % 3 :] + i, 0, i % 3)
        m = m.select_scatter(row, 0, i % 8)
    return x + m


def test_fuse_splits_a_chain_that_inlining_would_compute_exponentially_often() -> None:
    """In one kernel every link would be computed twice per computation of
    the next: 2**14 times for the first link here (past minutes in codegen
    before).  Merges past ``MAX_INLINED`` operations are refused; every
    kernel stays under it."""
    x = _r(8, 8)
    graph = lower(_updated_in_place, x)
    out, counts = fuse(graph)
    refused = [d for d in out.decisions if d.reason == "too_much_recomputed"]
    assert refused and f"(at most {MAX_INLINED})" in refused[0].detail, refused
    assert counts["kernels"] > 1
    for group in out.groups:
        stored = set(group.stored)
        size = inlined_size(out, list(group.nodes), stored.__contains__)
        assert size <= MAX_INLINED, (group.name, size)
    _check_same(graph, out, (x,))


def test_a_mask_built_by_many_in_place_updates_compiles_and_matches_eager() -> None:
    """The chain of :func:`_updated_in_place` written as Swin writes it, in
    place, through Dynamo and AOTAutograd's functionalization (before the
    two tests below, its compile did not end)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(8, 8)
        for i in range(14):
            m[i % 8, i % 3 :] += i
        return x + m

    assert_matches_eager(fn, _r(8, 8))


def test_constant_fold_walks_a_shared_value_once(monkeypatch) -> None:
    """Finding what a constant-valued node is computed from visits each node
    once: the chain of :func:`_updated_in_place` has 2**14 paths to its
    first link (Swin3D's mask took compiles past minutes).  Each visit
    resolves views with ``view_base``, counted here."""
    visits = []

    def counted(graph: Graph, name: str) -> str:
        visits.append(name)
        assert len(visits) < 100_000, "walked the same nodes again and again"
        return view_base(graph, name)

    x = _r(8, 8)
    graph = lower(_updated_in_place, x)
    monkeypatch.setattr(constant_fold_module, "view_base", counted)
    out, _ = constant_fold(graph)
    _check_same(graph, out, (x,))


def test_inlined_size_counts_each_read_of_an_inlined_node() -> None:
    """``(e + e.flip(0)) * 2`` in one kernel: ``exp(x)`` (2 operations) is
    computed at two positions for each product stored (``mul``, 3: a call,
    a load and a constant; ``add`` 3; the flip's load 1)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        e = x.exp()
        return (e + e.flip(0)) * 2

    graph = lower(fn, _r(6))
    assert list(graph.nodes) == ["arg0_1", "exp", "flip", "add", "mul"], format_graph(graph)
    members = ["exp", "flip", "add", "mul"]
    assert inlined_size(graph, members, lambda m: m == "mul") == 3 + 3 + 1 + 2 * 2
    # Stored too, it is computed once more, for its store.
    assert inlined_size(graph, members, lambda m: m in ("exp", "mul")) == 3 + 3 + 1 + 3 * 2
    assert inlined_size(graph, ["exp"], lambda m: True) == 2


@settings(max_examples=120, derandomize=True, database=None, deadline=None)
@given(program=programs(), data=st.data())
def test_every_pass_preserves_meaning_on_random_programs(program, data) -> None:
    """Random programs (the fusion property tier's generator) with some inputs
    captured as constants, so constant folding has work; each pass of the
    pipeline in turn must keep the interpreter's result."""
    note("Program:\n\n" + program.source)
    fn, inputs = program.build()
    frozen = data.draw(st.integers(0, len(inputs)), label="inputs captured as constants")
    graph = lower_with_constants(fn, tuple(inputs[:frozen]), *inputs[frozen:])
    runtime = list(inputs[frozen:])
    expected = interpret(graph, runtime)
    for name, run in passes(Options(), H100_SXM):
        graph, _ = run(graph)
        note(f"after {name}:\n{format_graph(graph)}")
        assert_close_tree(interpret(graph, runtime), expected, 1e-5, 1e-5)

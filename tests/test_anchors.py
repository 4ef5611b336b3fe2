"""Templates as a protocol (``compiler/anchors.py``): the GEMM is one anchor
kind, asked through the protocol everywhere, and what it lets into its
prologue is priced by the cost model on a GPU target."""

from __future__ import annotations

import re

import torch

from tests.lowering import lower, optimize
from tests.test_target import ROOT, lines_matching
from tilec.anchors import ANCHORS, anchor_of, anchors_in
from tilec.codegen.templates import WRITERS
from tilec.decisions import of_stage
from tilec.gemm import GEMM
from tilec.interpret import interpret
from tilec.options import Options

# A test of the dot reduction's own field: only the GEMM template's module may write it.
DOT_TEST = re.compile(r"reduce_op\s*==\s*(\"dot\"|'dot'|DOT)")


def test_only_the_gemm_template_tests_for_its_anchor():
    found = lines_matching({"dot test": DOT_TEST}, ROOT / "compiler" / "gemm.py")
    assert not found, "\n".join(found)
    assert DOT_TEST.search('if node.reduce_op == "dot":')
    assert DOT_TEST.search((ROOT / "compiler" / "gemm.py").read_text())


def test_every_anchor_kind_has_a_writer():
    assert {a.kind for a in ANCHORS} == set(WRITERS)


def _templated(fn, *inputs, gpu=False):
    return optimize(lower(fn, *inputs), Options(matmul="triton"), gpu=gpu)


def test_a_gemm_is_an_anchor_with_its_reference_semantics():
    """The interpreter runs the anchor by its kind's reference: a batched
    product with a transposed operand, against eager."""
    a, b = torch.randn(2, 5, 7), torch.randn(2, 3, 7)
    graph = _templated(lambda a, b: a @ b.transpose(1, 2), a, b)
    anchored = anchors_in(graph, graph.nodes)
    assert [anchor.kind for anchor, _ in anchored] == ["gemm"]
    ((anchor, node),) = anchored
    assert anchor is GEMM and anchor_of(node) is GEMM
    assert GEMM.problem(graph, node) == (5, 3, 7, torch.float32)
    (out,) = interpret(graph, [a, b])
    torch.testing.assert_close(out, a @ b.transpose(1, 2))
    ordinary = [n for n in graph.nodes.values() if n is not node]
    assert all(anchor_of(n) is None for n in ordinary)


def _prologue_decisions(rows: int, costly: bool, gpu: bool, cols: int = 1024):
    """Fusion's decisions for a product whose left operand is computed from
    narrow data: a cast and a scale, or that and a long chain of ops."""

    # The interpreter has no bf16 dot.
    dtype = torch.bfloat16 if gpu else torch.float32

    def fn(x_q, scale, w):
        x = x_q.to(dtype) * scale
        if costly:
            for _ in range(8):
                x = torch.sin(x) * 1.5 + x
        return x @ w

    x_q = torch.randint(-127, 128, (rows, 512), dtype=torch.int8)
    scale = torch.rand(rows, 1, dtype=dtype)
    w = torch.randn(512, cols, dtype=dtype)
    graph = _templated(fn, x_q, scale, w, gpu=gpu)
    return graph, of_stage(graph.decisions, "fuse")


def _gemm_group(graph) -> set[str]:
    """The members of the kernel that holds the GEMM's anchor."""
    (group,) = [g for g in graph.groups if anchors_in(graph, g.nodes)]
    return set(group.nodes)


def test_a_prologue_pays_on_a_gpu_where_its_recomputation_costs_less_than_a_kernel():
    """The chain of 26 ops per element, recomputed for each of 8 column tiles
    of a small product, costs less than a kernel of its own (mostly its
    launch); so does a dequantization alone."""
    for costly in (False, True):
        graph, decisions = _prologue_decisions(256, costly=costly, gpu=True)
        assert not [d for d in decisions if d.reason == "prologue_too_costly"]
        assert "mul" in _gemm_group(graph)  # the dequantization's multiply


def test_a_costly_prologue_is_priced_out_on_a_gpu():
    """The same chain recomputed for each of 128 column tiles costs more than
    a kernel of its own: the cost model says so, with both times."""
    graph, decisions = _prologue_decisions(256, costly=True, gpu=True, cols=16384)
    rejected = [d for d in decisions if d.reason == "prologue_too_costly"]
    assert rejected and "mul" not in _gemm_group(graph)
    assert all("predicted" in d.detail and " us" in d.detail for d in rejected)


def test_without_figures_the_prologue_rule_counts_ops():
    """The interpreter has no cost figures: the op count rule decides."""
    graph, decisions = _prologue_decisions(32, costly=True, gpu=False)
    rejected = [d for d in decisions if d.reason == "prologue_too_costly"]
    assert rejected and all("ops per element" in d.detail for d in rejected)
    assert "mul" not in _gemm_group(graph)
    graph, cheap = _prologue_decisions(32, costly=False, gpu=False)
    assert not [d for d in cheap if d.reason == "prologue_too_costly"]
    assert "mul" in _gemm_group(graph)

"""Static memory planning: liveness, the arena, and what must stay out of it."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import tilec
from tests.compare import assert_matches_eager
from tests.lowering import lower, optimize
from tests.test_passes import PROGRAMS
from tilec.ir import format_graph
from tilec.passes.memory_plan import memory_plan


def _mlp_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Matmuls between kernels force intermediates into memory.
    for _ in range(4):
        x = F.gelu(x @ w).softmax(-1)
    return x.sum(0)


def _gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w)  # stored: a matmul and the gate read it
    t = h * torch.sigmoid(h @ w)  # h dies here, read where t is written: in place
    return (t @ w).sum(-1)


CASES = {
    **PROGRAMS,
    "mlp_chain": (_mlp_chain, (torch.randn(8, 16), torch.randn(16, 16))),
    "gated": (_gated, (torch.randn(8, 16), torch.randn(16, 16))),
}


@pytest.mark.parametrize("program", sorted(CASES))
def test_live_buffers_never_share_memory(program):
    fn, inputs = CASES[program]
    graph = optimize(lower(fn, *inputs))
    plan = graph.memory
    for a, b in itertools.combinations(plan.offsets, 2):
        (s1, e1), (s2, e2) = plan.lifetimes[a], plan.lifetimes[b]
        in_place = plan.in_place.get(a) == b or plan.in_place.get(b) == a
        if s1 <= e2 and s2 <= e1 and not in_place:
            a_end, b_end = plan.offsets[a] + plan.sizes[a], plan.offsets[b] + plan.sizes[b]
            assert a_end <= plan.offsets[b] or b_end <= plan.offsets[a], (a, b)
    assert all(offset % 256 == 0 for offset in plan.offsets.values())
    assert not set(plan.offsets) & {o for o in graph.outputs if o}


@pytest.mark.parametrize("program", sorted(CASES))
def test_arena_is_at_most_the_naive_peak(program):
    fn, inputs = CASES[program]
    fused = optimize(lower(fn, *inputs))
    _, counts = memory_plan(fused)
    assert counts["arena_bytes"] <= counts["naive_peak_bytes"] <= counts["intermediate_bytes"]
    again, _ = memory_plan(fused)
    assert again.memory == fused.memory  # deterministic


def test_chain_reuses_memory():
    fn, inputs = CASES["mlp_chain"]
    graph = optimize(lower(fn, *inputs))
    _, counts = memory_plan(graph)
    assert counts["planned_buffers"] >= 4
    assert counts["arena_bytes"] < counts["intermediate_bytes"]


@pytest.mark.parametrize("rows", [8, 1])
def test_pointwise_kernel_writes_over_the_input_that_dies_with_it(rows):
    """Also at batch 1: a size-1 dimension is still the kernel's own position."""
    fn, (x, w) = CASES["gated"]
    inputs = (x[:rows], w)
    graph = optimize(lower(fn, *inputs))
    plan = graph.memory
    assert len(plan.in_place) == 1
    ((out, src),) = plan.in_place.items()
    assert plan.offsets[out] == plan.offsets[src]
    assert plan.lifetimes[src][1] == plan.lifetimes[out][0]  # src dies where out is written
    assert f"in place of %{src}" in format_graph(graph)
    assert_matches_eager(fn, *inputs)


def _transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w)
    return ((h.t() + h) * torch.sigmoid(h @ w)) @ w  # reads h[j, i] and h[i, j]


def _shifted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w)
    return ((h[1:] - h[:-1]) * torch.sigmoid(h @ w)[1:]) @ w  # reads the row before too


@pytest.mark.parametrize("fn", [_transposed, _shifted])
def test_no_in_place_where_other_elements_are_read(fn):
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    graph = optimize(lower(fn, x, w))
    plan = graph.memory
    # Both kernels' results are planned and the first dies where the second is written...
    (first, second) = sorted(plan.offsets, key=lambda n: plan.lifetimes[n])
    assert plan.lifetimes[first][1] == plan.lifetimes[second][0]
    # ...but the second reads other elements of it than it writes.
    assert plan.in_place == {}
    assert_matches_eager(fn, x, w)


def test_outputs_and_their_views_stay_out_of_the_arena():
    def fn(x, w):
        h = torch.relu(x @ w)  # a kernel output read by the next matmul only: planned
        y = (h @ w).exp()
        return y.t(), y.sum(-1)  # an output view of a kernel result: not planned

    graph = optimize(lower(fn, torch.randn(4, 8), torch.randn(8, 8)))
    planned = set(graph.memory.offsets)
    exp = next(n for n in graph.nodes.values() if n.body is not None and "exp" in repr(n.body))
    assert exp.name not in planned and planned


def test_outputs_survive_the_next_call():
    w = torch.randn(16, 16)
    earlier = set(tilec.programs())
    compiled = torch.compile(lambda x: _mlp_chain(x, w), backend="tilec")
    with torch.no_grad():
        x1, x2 = torch.randn(8, 16), torch.randn(8, 16)
        first = compiled(x1)
        kept = first.clone()
        second = compiled(x2)
    torch.testing.assert_close(first, kept, atol=0, rtol=0)
    torch.testing.assert_close(second, _mlp_chain(x2, w), atol=1e-5, rtol=1e-5)
    (program,) = [p for name, p in tilec.programs().items() if name not in earlier]
    assert program.arena.numel() > 0
    assert first.untyped_storage().data_ptr() != program.arena.untyped_storage().data_ptr()


def test_summary_reports_the_plan(tmp_path):
    w = torch.randn(16, 16)
    with torch.no_grad():
        torch.compile(lambda x: _mlp_chain(x, w), backend="tilec", options={"dump": str(tmp_path)})(
            torch.randn(8, 16)
        )
    (graph_dir,) = tmp_path.iterdir()
    summary = (graph_dir / "summary.txt").read_text()
    assert "arena_bytes=" in summary and "naive_peak_bytes=" in summary
    (plan,) = graph_dir.glob("*-memory_plan.txt")
    assert "arena:" in plan.read_text()


def test_memory_command_prints_plans_no_larger_than_the_naive_peak(capsys):
    from benchmarks import memory

    assert memory.main(["--models", "mlp,gpt2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["mlp", "gpt2"]
    for _, arena, naive, total, planned in rows:
        assert 0 < int(arena) <= int(naive) <= int(total) and int(planned) > 0

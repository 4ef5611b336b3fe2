"""Graph capture and replay (``mode="reduce-overhead"``): the CPU stand-in
runs the same executor as CUDA graphs, so every rule is checked here; the
``gpu`` tests at the end run real CUDA graphs.

Oracle: eager torch, on every call, with inputs that change between calls.
"""

from __future__ import annotations

import dataclasses
from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tilec
from tests.compare import assert_close_tree
from tilec.pipeline import programs
from tilec.runtime import executors
from tilec.runtime.executors import GraphExecutor, RecordedGraph, StandInGraphs
from tilec.runtime.plan import Plan
from tilec.target import H100_SXM


class Block(nn.Module):
    """Linear layers (library calls), a norm and GELU (kernels), attention
    (a library call whose operands are views)."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, -1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, t, d)
        return x + self.down(nn.functional.gelu(self.up(x)))


def _new_by_kind(before: set) -> dict:
    """The programs compiled since ``before`` (``programs()``'s names), by
    kind (``forward``, ``backward``, ``inference``: their graph's name ends
    so)."""
    return {p.plan.graph.name.split("_")[-1]: p for n, p in programs().items() if n not in before}


def _new_program(before: set[str]):
    (program,) = [p for name, p in programs().items() if name not in before]
    return program


def _calls(model: nn.Module, compiled, count: int, shape=(2, 8, 16)):
    """``count`` calls with fresh inputs: (output, eager output, input) each."""
    results = []
    with torch.no_grad():
        for k in range(count):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(k))
            results.append((compiled(x), model(x), x))
    return results


@pytest.mark.parametrize("how", ["mode", "option"])
def test_replays_match_eager_over_many_calls(how):
    torch.manual_seed(0)
    model = Block().eval()
    before = set(programs())
    if how == "mode":
        compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    else:
        compiled = torch.compile(model, backend="tilec", options={"cudagraphs": True})
    results = _calls(model, compiled, 6)
    for actual, expected, _ in results:
        assert_close_tree(actual, expected, atol=1e-5, rtol=1e-5)
    program = _new_program(before)
    assert isinstance(program.executor, GraphExecutor)
    executor = program.executor
    assert executor.captures == 1  # once, after one warm-up call; replayed 4 times
    graph = executor.graph
    assert isinstance(graph, RecordedGraph)
    # The recorded sequence is the launches and library calls, nothing else.
    plan = program.plan
    recorded = [step for step in graph.steps if step[0] is not executors.keep_strides]
    assert len(recorded) == len(plan.launches()) + len(plan.library_calls())
    # Parameters are used in place; only x is copied into a static buffer.
    assert len(executor.static_inputs) == len(list(model.parameters()))
    assert executor.copied == [
        k for k in range(len(executor.buffers)) if k not in executor.static_inputs
    ]
    assert len(executor.copied) == 1


def test_an_output_kept_from_an_earlier_call_is_never_changed():
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    results = _calls(model, compiled, 5)
    kept = [actual.clone() for actual, _, _ in results]
    for (actual, expected, _), copy in zip(results, kept):
        assert torch.equal(actual, copy)  # later calls did not write into it
        assert_close_tree(actual, expected, atol=1e-5, rtol=1e-5)
    # Two outputs of two replays never share memory.
    assert results[3][0].data_ptr() != results[4][0].data_ptr()


def test_parameters_changed_in_place_are_seen_by_the_replay():
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    _calls(model, compiled, 3)
    with torch.no_grad():
        model.up.weight.mul_(-1)  # same storage: the graph reads it in place
    for actual, expected, _ in _calls(model, compiled, 2):
        assert_close_tree(actual, expected, atol=1e-5, rtol=1e-5)


def test_a_moved_static_input_is_captured_again():
    torch.manual_seed(0)
    model = Block().eval()
    before = set(programs())
    compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    _calls(model, compiled, 3)
    executor = _new_program(before).executor
    x = torch.randn(2, 8, 16)
    args = [executor.buffers[k] for k in range(len(executor.buffers))]
    position = next(iter(sorted(executor.static_inputs)))
    moved = args[position].clone()  # same values, another storage
    args[position] = moved
    args[executor.copied[0]] = x
    with torch.no_grad():
        again = executor(args, {})
        expected = executor.eager(args, {})
    assert executor.captures == 2
    assert_close_tree(again, expected, atol=0, rtol=0)


def test_the_stand_in_refuses_a_tensor_outside_the_static_buffers():
    static, stray = torch.zeros(4), torch.ones(4)
    graph = RecordedGraph([static])
    record = graph.recorder("tilec_k0", lambda a, b: None, returns=False)
    record(static, static[1:])  # a view of a static buffer: fine
    with pytest.raises(RuntimeError, match="tilec_k0 reads a tensor of shape \\(4,\\) that is not"):
        record(static, stray)


def test_an_allocation_during_capture_is_refused(monkeypatch):
    """Every buffer must exist before capture: a plan whose call function
    allocates while captured fails loudly (the check can fail)."""
    source = Plan.source
    monkeypatch.setattr(Plan, "source", lambda self, **kw: source(self, timed=False))
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    # GELU's output is returned: a per-call buffer in the eager plan.
    compiled = torch.compile(
        lambda x: (model(x), torch.nn.functional.gelu(x) * 2),
        backend="tilec",
        mode="reduce-overhead",
    )
    with torch.no_grad():
        compiled(torch.randn(4, 8))
        with pytest.raises(RuntimeError, match="allocated during graph capture"):
            compiled(torch.randn(4, 8))


def _decisions(tmp_path) -> str:
    return "".join(p.read_text() for p in sorted(tmp_path.rglob("cudagraphs.txt")))


def _replays(monkeypatch) -> list[RecordedGraph]:
    """The stand-in graphs replayed from now on, once per replay."""
    replayed: list[RecordedGraph] = []
    replay = RecordedGraph.replay

    def counted(graph: RecordedGraph, *inputs) -> None:
        replayed.append(graph)
        replay(graph, *inputs)

    monkeypatch.setattr(RecordedGraph, "replay", counted)
    return replayed


def test_generic_programs_are_captured_once_per_size_bucket(tmp_path, monkeypatch):
    """A generic program (symbolic sizes) is captured for a bucket's largest
    sizes and replayed for every size in the bucket: its kernels read the
    call's sizes from memory, so results at 5, 7 and 9 from one graph (made
    at 16) equal eager's.  A call in a new bucket captures again."""
    options = {"cudagraphs": True, "max_specializations": 0, "dump": str(tmp_path)}

    def fn(x):
        return x - x.amax(-1, keepdim=True), torch.cat([x, x * 2], 1).sum(0)

    replayed = _replays(monkeypatch)
    compiled = torch.compile(fn, backend="tilec", dynamic=True, options=options)
    lengths = (6, 5, 7, 9, 20, 40, 16, 3)
    with torch.no_grad():
        for n in lengths:
            x = torch.randn(3, n)
            assert_close_tree(compiled(x), fn(x))
    (program,) = (p for name, p in programs().items() if str(tmp_path) in name)
    assert isinstance(program.executor, executors.BucketExecutor)
    # The first call warms up; 5, 7, 9, 16 and 3 share the bucket of 16 (with 3 rows).
    # (Buckets are keyed by the symbols in name order: rows and columns in some order.)
    assert {tuple(sorted(k)) for k in program.executor.graphs} == {(16, 16), (16, 32), (16, 64)}
    assert len(replayed) == len(lengths) - 1
    assert replayed.count(program.executor.graphs[16, 16].graph) == 5
    text = _decisions(tmp_path)
    assert "captured: after one warm-up call, one graph per size bucket" in text
    summary = next(tmp_path.rglob("summary.txt")).read_text()
    assert "graph capture: captured" in summary


def test_generic_program_with_a_library_call_on_symbolic_sizes_runs_eagerly(tmp_path):
    """A convolution over a symbolic length stays a library call (a matmul
    would take the template under graphs: ``passes/matmul.py``)."""
    options = {"cudagraphs": True, "max_specializations": 0, "dump": str(tmp_path)}
    weight = torch.randn(4, 3, 3)

    def fn(x):
        return torch.nn.functional.conv1d(x, weight).relu()

    compiled = torch.compile(fn, backend="tilec", dynamic=True, options=options)
    with torch.no_grad():
        for n in (5, 7, 9):
            x = torch.randn(2, 3, n)
            torch.testing.assert_close(compiled(x), fn(x))
    text = _decisions(tmp_path)
    assert "not captured: dynamic shapes: library call aten.convolution.default" in text, text
    (program,) = (p for name, p in programs().items() if str(tmp_path) in name)
    assert program.executor is program.eager


def test_a_view_at_an_offset_that_depends_on_the_sizes_is_not_captured(tmp_path):
    """``narrow(x, 1, start, 2)`` returned: its offset is ``start``; a graph
    would bake in the one it was captured with."""
    options = {"cudagraphs": True, "max_specializations": 0, "dump": str(tmp_path)}

    def fn(x, start):
        return torch.narrow(x, 1, start, 2)

    compiled = torch.compile(fn, backend="tilec", dynamic=True, options=options)
    with torch.no_grad():
        for start, cols in ((2, 5), (3, 6), (4, 7), (2, 9)):
            x = torch.randn(3, cols)
            torch.testing.assert_close(compiled(x, start), fn(x, start))
    assert "starts at an offset that depends on the sizes" in _decisions(tmp_path)


def test_a_view_of_symbolic_shape_is_returned_from_a_bucket_graph(tmp_path, monkeypatch):
    """A generic program returning views of its buffers (a decoder's
    prefill returns its keys transposed for the cache): each is returned at
    the call's sizes, laid out as eager's, from one graph per bucket."""
    options = {"cudagraphs": True, "max_specializations": 0, "dump": str(tmp_path)}

    def fn(x):
        y = x.sin() * 2
        # (y[:, 1] is of static shape, its stride the call's length.)
        return y.transpose(0, 1), (x + 1).view(-1, 2)[1:], y[:, 1:].unsqueeze(0), y[:, 1]

    replayed = _replays(monkeypatch)
    compiled = torch.compile(fn, backend="tilec", dynamic=True, options=options)
    with torch.no_grad():
        for n in (6, 5, 7, 9, 12):
            x = torch.randn(4, n)
            torch._dynamo.mark_static(x, 0)
            actual, expected = compiled(x), fn(x)
            assert_close_tree(actual, expected)
            assert [a.stride() for a in actual] == [e.stride() for e in expected]
    assert "not captured" not in _decisions(tmp_path)
    assert len(replayed) == 4


def test_a_size_a_bucket_graph_returns_is_the_calls(monkeypatch):
    """A size among a generic program's outputs is computed at each call's
    sizes: the bucket graph returned the size it was captured at (the
    bucket's, 16) for every call (``opinfo_sweep --generic --cudagraphs``,
    ``broadcast_shapes``; views of inputs: ``tests/test_opinfo.py``)."""

    def fn(x):
        return x * 2, x.shape[1] * 3

    replayed = _replays(monkeypatch)
    compiled = torch.compile(
        fn, backend="tilec", dynamic=True, options={"cudagraphs": True, "max_specializations": 0}
    )
    with torch.no_grad():
        for n in (5, 6, 7, 9):
            x = torch.randn(4, n)
            assert_close_tree(compiled(x), fn(x))
    assert len(replayed) == 3


def test_a_generic_program_writes_its_mutated_inputs_back(monkeypatch):
    def fn(x):
        x.mul_(2)
        return x.sum(0)

    replayed = _replays(monkeypatch)
    compiled = torch.compile(
        fn, backend="tilec", dynamic=True, options={"cudagraphs": True, "max_specializations": 0}
    )
    with torch.no_grad():
        for n in (5, 6, 9, 30, 7):
            x, y = torch.randn(3, n), None
            y = x.clone()
            torch.testing.assert_close(compiled(x), fn(y))
            torch.testing.assert_close(x, y)
    assert len(replayed) == 4


def test_buckets_whose_copies_cost_more_than_the_launches_saved_run_eagerly(monkeypatch):
    """On a target with cost figures, a bucket is captured only where the
    replay's copies of the inputs and outputs of symbolic shape (a dynamic
    KV cache, in and out) cost less than the launches it saves."""

    def fn(cache, new):
        return torch.cat([cache, new], 2) * 2

    compiled = torch.compile(
        fn, backend="tilec", options={"cudagraphs": True, "max_specializations": 0}
    )
    with torch.no_grad():
        for n in (5, 6, 9):
            cache, new = torch.randn(1, 4, n, 8), torch.randn(1, 4, 1, 8)
            torch._dynamo.mark_dynamic(cache, 2)  # the length alone is symbolic
            torch.testing.assert_close(compiled(cache, new), fn(cache, new))
    (program,) = programs().values()
    (symbol,) = program.plan.symbols
    assert program.bucket_refusal({symbol.name: 16}) is None  # no figures: always captured
    program.target = H100_SXM
    # One launch saves 2.5 - 0.66 us; the cache and the result (4 x 8 fp32
    # per position) are read and written once more each: 256 bytes a position.
    assert program.bucket_refusal({symbol.name: 1024}) is None
    refused = program.bucket_refusal({symbol.name: 65536})
    assert refused is not None and "costs more than the 1 launches a replay saves" in refused
    executor = program.executor
    monkeypatch.setattr(executor, "refuses", program.bucket_refusal)
    cache, new = torch.randn(1, 4, 40000, 8), torch.randn(1, 4, 1, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(cache, new), fn(cache, new))
    assert executor.eager_calls == 1 and list(executor.refused.values()) == [refused]


def test_buckets_past_the_limit_run_eagerly(monkeypatch):
    monkeypatch.setattr(executors, "BUCKET_LIMIT", 2)
    replayed = _replays(monkeypatch)
    compiled = torch.compile(
        lambda x: x.exp() + 1,
        backend="tilec",
        dynamic=True,
        options={"cudagraphs": True, "max_specializations": 0},
    )
    with torch.no_grad():
        for n in (5, 6, 20, 40, 80, 7):
            x = torch.randn(n)
            torch.testing.assert_close(compiled(x), x.exp() + 1)
    (program,) = programs().values()
    assert sorted(program.executor.graphs) == [(16,), (32,)]
    assert program.executor.eager_calls == 2  # 40 and 80
    assert len(replayed) == 3  # 6, 20 and 7


def test_a_bucket_whose_static_inputs_keep_moving_stops_alone(monkeypatch, tmp_path):
    """A parameter that moves at every call of one bucket: after
    RECAPTURE_LIMIT captures that bucket runs eagerly, the other buckets
    keep their graphs, and the decision says so (the program is still
    captured)."""
    calls = []
    call = executors.BucketExecutor.__call__

    def recorded(self, inputs, sizes):
        calls.append((list(inputs), dict(sizes)))
        return call(self, inputs, sizes)

    monkeypatch.setattr(executors.BucketExecutor, "__call__", recorded)
    torch.manual_seed(0)
    model = nn.Linear(8, 8).eval()
    options = {"cudagraphs": True, "max_specializations": 0, "dump": str(tmp_path)}
    compiled = torch.compile(model, backend="tilec", dynamic=True, options=options)
    with torch.no_grad():
        for n in (5, 6, 20):
            x = torch.randn(n, 8)
            assert_close_tree(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    (program,) = (p for name, p in programs().items() if str(tmp_path) in name)
    executor = program.executor
    inputs, sizes = calls[1]  # n = 6: the bucket of 16
    (key,) = (k for k in executor.graphs if 16 in k)
    static = sorted(executor.graphs[key].static_inputs)
    assert static
    with torch.no_grad():
        for _ in range(executors.RECAPTURE_LIMIT + 2):
            moved = list(inputs)
            moved[static[0]] = inputs[static[0]].clone()  # same values, another storage
            assert_close_tree(executor(moved, sizes), executor.eager(moved, sizes))
    assert key not in executor.graphs and "moved" in executor.refused[key]
    assert len(executor.graphs) == 1  # the bucket of 32 keeps its graph
    with torch.no_grad():
        x = torch.randn(20, 8)
        assert_close_tree(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert program.capture.outcome == "captured" and "no longer" in program.cudagraphs
    assert "bucket_stopped" in _decisions(tmp_path)


def _trainee() -> nn.Module:
    """Linear layers (library calls), LayerNorm, GELU and BatchNorm (which
    writes its running statistics: inputs the forward mutates)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.BatchNorm1d(16), nn.Linear(16, 4)
    ).train()


def _train(model: nn.Module, run, steps: int) -> list[torch.Tensor]:
    """``steps`` SGD steps of ``run`` (``model``, compiled or not) on fresh
    inputs; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for k in range(steps):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(k))
        optimizer.zero_grad()
        loss = run(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def test_training_steps_are_captured_and_replayed_with_eagers_results(tmp_path):
    """The forward and the backward are each captured once (after a warm-up
    call) and replayed: parameters, BatchNorm's running statistics and the
    losses over five SGD steps are eager's.  The parameters a forward saves
    for its backward come back as the caller's tensors, not copies, so the
    backward reads them in place and never captures again."""
    model, twin = _trainee(), _trainee()
    before = set(programs())
    compiled = torch.compile(
        twin, backend="tilec", options={"cudagraphs": True, "dump": str(tmp_path)}
    )
    expected, actual = _train(model, model, 5), _train(twin, compiled, 5)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(twin.state_dict(), model.state_dict(), atol=1e-5, rtol=1e-5)
    text = _decisions(tmp_path)
    assert "only inference graphs" not in text
    new = _new_by_kind(before)
    forward, backward = new["forward"].executor, new["backward"].executor
    assert forward.captures == 1 and forward.replays == 4
    assert backward.captures == 1 and backward.replays == 4
    assert forward.static_moves == backward.static_moves == 0
    # The activations the forward saves come back as its graph's memory,
    # not copies, and autograd let go of them before each next forward.
    assert forward.lent_baseline and forward.lent_busy == 0
    assert len(backward.borrowed) == len(forward.lent_baseline)  # read where they are
    # The backward's static inputs are the parameters the forward saved.
    names = new["backward"].plan.graph.inputs
    assert {names[k] for k in backward.static_inputs} <= {f"primals_{k}" for k in range(1, 20)}
    assert backward.static_inputs
    del new, forward, backward


def _accumulate(
    model: nn.Module, run, steps: int, forwards: int = 3, held: list | None = None
) -> None:
    """``steps`` times: ``forwards`` forwards on fresh inputs, then one
    backward of their summed losses (gradient accumulation).  The inputs
    are kept (in ``held``, else until the return), so none comes back at an
    address an earlier one had: an input at the warm-up's address is read
    in place, and captured again when it moves, which would make the
    counts depend on the allocator."""
    held = [] if held is None else held
    for k in range(steps):
        losses = []
        for j in range(forwards):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(forwards * k + j))
            held.append(x)
            losses.append(run(x).pow(2).mean())
        sum(losses).backward()


def test_a_lent_activation_still_held_is_never_written_over():
    """Three forwards before one backward: the second and third find the
    activations the first's replay lent still held by autograd (for the
    backward to come), so they run eagerly into new memory rather than
    replay over them; the gradients and running statistics are eager's.
    Replaying regardless gave every gradient wrong."""
    model, twin = _trainee(), _trainee()
    before = set(programs())
    compiled = torch.compile(twin, backend="tilec", options={"cudagraphs": True})
    _accumulate(model, model, 4)
    _accumulate(twin, compiled, 4)
    for mine, theirs in zip(twin.parameters(), model.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(twin.state_dict(), model.state_dict(), atol=1e-5, rtol=1e-5)
    new = _new_by_kind(before)
    forward = new["forward"].executor
    assert forward.lent_baseline
    # Step 1: a warm-up call, a replay, one call held off; then a replay
    # and two held off each step.
    assert (forward.captures, forward.replays, forward.lent_busy) == (1, 4, 7)
    del new, forward


def _lending(model: nn.Module, twin: nn.Module, held: list, copy_s: float | None) -> tuple:
    """``twin`` compiled for the CPU stand-in, its warm-up step (one
    forward and backward) run beside ``model``'s, its backward's copies
    priced at ``copy_s`` a replay (None: no figures, the stand-in's own):
    (the compiled twin, its forward's and its backward's executors)."""
    before = set(programs())
    compiled = torch.compile(twin, backend="tilec", options={"cudagraphs": True})
    _accumulate(model, model, 1, forwards=1)
    _accumulate(twin, compiled, 1, forwards=1, held=held)
    new = _new_by_kind(before)
    forward, backward = new["forward"].executor, new["backward"].executor
    if copy_s is not None:
        backward.copy_seconds = lambda nbytes: copy_s
    return compiled, forward, backward


def test_a_backward_reads_the_activations_its_forward_lent_in_place():
    """The backward's first capture reads in place the activations its
    forward lent (they stay where the forward's graph keeps them), keeping
    their addresses, not tensors on them: once autograd lets go of them,
    the forward finds them free and replays every step, and the backward
    replays too; the gradients are eager's."""
    model, twin, held = _trainee(), _trainee(), []
    compiled, forward, backward = _lending(model, twin, held, None)
    _accumulate(model, model, 5, forwards=1)
    _accumulate(twin, compiled, 5, forwards=1, held=held)
    for mine, theirs in zip(twin.parameters(), model.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(twin.state_dict(), model.state_dict(), atol=1e-5, rtol=1e-5)
    assert (forward.captures, forward.replays, forward.lent_busy) == (1, 5, 0)
    assert (backward.captures, backward.replays) == (1, 5)
    lent = forward.lent_memory()
    assert len(backward.borrowed) == len(lent) == len(forward.lent_baseline) == 4
    assert set(backward.borrowed) <= set(backward.in_place)
    assert all(backward.buffers[k] is None for k in backward.borrowed)
    # Nothing but the forward's own tensors is on the memory it lent.
    for k, count in forward.lent_baseline.items():
        assert torch._C._storage_Use_Count(forward.outputs[k].untyped_storage()._cdata) == count
    del forward, backward


class _Attention(nn.Module):
    """Attention through SDPA (a library call on the CPU), whose output and
    a transposed view of it the forward saves: two lent outputs on one
    storage."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(2, 8, 16))


def test_a_replay_copies_the_bytes_it_says(monkeypatch):
    """``GraphExecutor.replay_bytes`` is what a replayed training step
    copies in and out (counted at the copies), which leaves out what the
    forward lends and the backward borrows."""
    model, twin, held = _trainee(), _trainee(), []
    compiled, forward, backward = _lending(model, twin, held, None)
    _accumulate(twin, compiled, 1, forwards=1, held=held)  # the captures
    copied = []
    copy_all = executors._copy_all
    monkeypatch.setattr(
        executors, "_copy_all", lambda dst, src: copied.append(dst) or copy_all(dst, src)
    )
    _accumulate(twin, compiled, 1, forwards=1, held=held)
    assert (forward.replays, backward.replays) == (2, 2)
    assert sum(t.nbytes for dst in copied for t in dst) == (
        forward.replay_bytes + backward.replay_bytes
    )
    assert forward.lent_baseline and backward.borrowed  # copied by neither
    del forward, backward


def test_a_backward_holds_nothing_on_memory_lent_twice():
    """Two lent outputs on one storage (SDPA's result and a view of it),
    read by two inputs of the backward: neither input's tensor is kept, so
    the forward replays every step; the gradients are eager's."""
    torch.manual_seed(0)
    model = _Attention()
    twin = deepcopy(model)
    before = set(programs())
    compiled = torch.compile(twin, backend="tilec", options={"cudagraphs": True})
    for k in range(4):
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(k))
        for m, run in ((model, model), (twin, compiled)):
            m.zero_grad()
            run(x).pow(2).sum().backward()
        for mine, theirs in zip(twin.parameters(), model.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)
    new = _new_by_kind(before)
    forward, backward = new["forward"].executor, new["backward"].executor
    storages = [forward.outputs[k].untyped_storage().data_ptr() for k in forward.lent_baseline]
    assert len(set(storages)) < len(storages)  # a storage lent twice
    assert (forward.replays, forward.lent_busy) == (3, 0)
    assert (backward.captures, backward.replays) == (1, 3)
    assert len(backward.borrowed) == len(forward.lent_baseline)
    assert all(backward.buffers[k] is None for k in backward.borrowed)
    del new, forward, backward


@pytest.mark.parametrize("copy_s", [None, 1.0], ids=["no-figures", "copies-pay"])
def test_accumulated_forwards_after_a_backward_read_lent_memory_in_place(copy_s):
    """Plain steps (the backward reading the lent activations in place),
    then three forwards before each backward: the backward is called on
    the first forward's lent memory and on the others' new memory in turn;
    what moves is copied (no figures), or captured again where copies had
    paid for it; the gradients and running statistics are eager's."""
    model, twin, held = _trainee(), _trainee(), []
    compiled, forward, backward = _lending(model, twin, held, copy_s)
    _accumulate(model, model, 3, forwards=1)
    _accumulate(twin, compiled, 3, forwards=1, held=held)
    assert len(backward.borrowed) == 4 and backward.captures == 1
    _accumulate(model, model, 3)
    _accumulate(twin, compiled, 3, held=held)
    for mine, theirs in zip(twin.parameters(), model.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(twin.state_dict(), model.state_dict(), atol=1e-5, rtol=1e-5)
    # Each step: a replay and two calls held off.
    assert (forward.captures, forward.replays, forward.lent_busy) == (1, 6, 6)
    assert backward.captures > 1  # the activations moved
    del forward, backward


def test_a_replay_makes_borrowed_tensors_on_the_calls_inputs():
    """The stand-in records a tensor on borrowed memory as where it lies,
    holding none, and makes it again on the replaying call's input: a view
    at an offset, of another dtype, read by a recorded step."""
    base = torch.arange(12, dtype=torch.float32)
    graph = RecordedGraph([base], {base.untyped_storage().data_ptr(): 1})
    seen = []
    record = graph.recorder("step", lambda t, u: seen.append((t.clone(), u.clone())), False)
    record(base[2:8].view(2, 3), base.view(torch.int32)[:2])
    ((fn, args, _, _),) = graph.steps
    assert not any(isinstance(a, torch.Tensor) for a in args)
    graph.replay([None, base])
    base += 1  # the replay reads the memory as it is now
    graph.replay([None, base])
    assert len(seen) == 2
    torch.testing.assert_close(seen[0][0], torch.arange(2.0, 8.0).view(2, 3))
    torch.testing.assert_close(seen[1][0], torch.arange(3.0, 9.0).view(2, 3))
    assert torch.equal(seen[0][1], torch.arange(2, dtype=torch.float32).view(torch.int32))


class GatedMLP(nn.Module):
    """Phi-3's MLP: one projection chunked into gate and up, whose halves
    (strided views of one buffer) the forward saves for its backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate_up = nn.Linear(8, 32)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(nn.functional.silu(gate) * up)


def test_a_strided_activation_saved_for_the_backward_keeps_its_layout():
    """A replayed forward's outputs are copied out with the layout its
    graph made (the chunks' strides), and a backward's buffers are laid out
    as its kernels read them: the chunks copied out dense were read with
    the view's strides, and the gradients were garbage (Phi-3's, NaN)."""
    model, twin = GatedMLP(), GatedMLP()
    compiled = torch.compile(twin, backend="tilec", options={"cudagraphs": True})
    expected, actual = _train(model, model, 4), _train(twin, compiled, 4)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(twin.state_dict(), model.state_dict(), atol=1e-5, rtol=1e-5)


class ExpandedIndices(nn.Module):
    """ALBERT's token types: indices gathered (from inputs, not constants
    folded away), then expanded over the batch (``rows``: stride 0 in the
    first dimension) or over the positions (stride 0 in the last); the
    embedding's backward reads the expanded view, which the forward saves."""

    def __init__(self, rows: bool):
        super().__init__()
        torch.manual_seed(0)
        self.rows = rows
        self.embed = nn.Embedding(4, 8)

    def forward(self, x: torch.Tensor, types: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        if self.rows:  # x: (2, 6, 8)
            ids = torch.gather(types[None], 1, order[None]).expand(2, 6)
        else:  # x: (6, 2, 8)
            ids = torch.gather(types[:, None], 0, order[:, None]).expand(6, 2)
        return (x * self.embed(ids)).sum()


@pytest.mark.parametrize("rows", [True, False], ids=["batch", "positions"])
def test_an_expanded_activation_saved_for_the_backward_keeps_its_layout(rows):
    """An expanded view the forward saves (its elements share memory) is
    copied out of the replayed forward with its strides, and into the
    backward's buffer through the memory it spans: a dense copy, which the
    backward's kernels would read with the view's strides, was refused by
    the copy into the backward's buffer (ALBERT's and ELECTRA's gradients
    raised under ``--cudagraphs``)."""
    model, twin = ExpandedIndices(rows), ExpandedIndices(rows)
    before = set(programs())
    compiled = torch.compile(twin, backend="tilec", options={"cudagraphs": True})
    for k in range(4):
        shape = (2, 6, 8) if rows else (6, 2, 8)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(k))
        types, order = torch.tensor([0, 1, 2, 3, 1, 0, 2, 2]), torch.tensor([7, 6, 5, 4, 3, 2])
        for module, run in ((model, model), (twin, compiled)):
            module.zero_grad()
            run(x, types, order).backward()
        torch.testing.assert_close(twin.embed.weight.grad, model.embed.weight.grad)
    new = _new_by_kind(before)
    forward, backward = new["forward"].executor, new["backward"].executor
    del new
    # The warm-up call, then a capture and three replays.
    assert forward.replays == backward.replays == 3
    saved = [n for n in backward.input_nodes if 0 in n.buffer_stride]
    assert saved, "the backward reads no expanded view: the test tests nothing"


def test_copies_into_buffers_whose_elements_share_memory():
    """``_copy_all``: same strides, the memory spanned (windows that overlap
    too); a dense source into an expanded buffer, the first element of
    each expanded dimension; any other overlap, an error that says so."""
    base = torch.arange(12.0)
    windows = base.as_strided((4, 6), (2, 1))  # each row overlaps the next
    into = torch.empty_strided((4, 6), (2, 1))
    executors._copy_all([into], [windows])
    assert torch.equal(into, windows)
    for stride in ((0, 1), (1, 0)):
        buffer = torch.empty_strided((3, 4), stride)
        dense = torch.arange(12.0).reshape(3, 4)
        executors._copy_all([buffer, torch.empty(2)], [dense, torch.ones(2)])
        assert torch.equal(
            buffer, dense[:1].expand(3, 4) if stride == (0, 1) else dense[:, :1].expand(3, 4)
        )
    executors._copy_all([torch.empty_strided((0, 3), (1, 0))], [torch.empty(0, 3)])
    with pytest.raises(RuntimeError, match="share memory other than along expanded dimensions"):
        executors._copy_all([torch.empty_strided((4, 6), (2, 1))], [torch.zeros(4, 6)])


def test_dropout_in_a_captured_training_step_draws_new_masks():
    """The seed of a replayed forward is drawn again on every replay (a
    library call the graph records), so each step's mask is new; the
    backward uses that step's mask."""
    dropout = nn.Dropout(0.5).train()
    compiled = torch.compile(dropout, backend="tilec", options={"cudagraphs": True})
    masks = []
    for _ in range(4):
        x = torch.ones(64, 32, requires_grad=True)
        y = compiled(x)
        y.sum().backward()
        kept = y != 0
        torch.testing.assert_close(x.grad, kept.float() * 2)
        torch.testing.assert_close(y, kept.float() * 2)
        masks.append(kept)
    assert all(not torch.equal(masks[k], masks[k + 1]) for k in range(3))
    assert 0.4 < torch.stack(masks).float().mean().item() < 0.6


def test_training_graphs_of_symbolic_sizes_run_eagerly_with_a_reason(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    compiled = torch.compile(
        model,
        backend="tilec",
        dynamic=True,
        options={"cudagraphs": True, "dump": str(tmp_path), "max_specializations": 0},
    )
    for n in (3, 5):
        x = torch.randn(n, 8)
        compiled(x).sum().backward()
    assert "graph of symbolic sizes: training graphs are captured at static sizes only" in (
        _decisions(tmp_path)
    )


def test_training_graphs_whose_copies_cost_more_than_the_launches_saved_are_refused():
    """On a target with cost figures a training graph is captured only where
    a replay's copies (inputs that are not static in, every output out: the
    activations a forward saves) cost less than the launches it saves."""
    model, twin = _trainee(), _trainee()
    before = set(programs())
    _train(twin, torch.compile(twin, backend="tilec", options={"cudagraphs": True}), 1)
    new = [p for n, p in programs().items() if n not in before]
    for program in new:
        assert program.training_refusal(program.executor.static_inputs) is None  # no figures
        program.target = H100_SXM
        assert program.training_refusal(program.executor.static_inputs) is None  # a few KB
        program.target = dataclasses.replace(
            H100_SXM, memory_bandwidth=dataclasses.replace(H100_SXM.memory_bandwidth, value=1e6)
        )
        refused = program.training_refusal(program.executor.static_inputs)
        assert refused is not None and "costs more than the" in refused
    del new, model


def test_a_backward_prices_the_activations_its_forward_lends_as_read_in_place():
    """A backward's compile knows which of its inputs its forward lends
    (``lent_inputs``: those its graph reads where they lie), and its
    capture price copies only the others."""
    twin = _trainee()
    before = set(programs())
    _train(twin, torch.compile(twin, backend="tilec", options={"cudagraphs": True}), 3)
    new = _new_by_kind(before)
    forward, backward = new["forward"], new["backward"]
    assert len(forward.lent_outputs) == 4 and forward.lent_inputs == frozenset()
    assert backward.lent_inputs == frozenset(backward.executor.borrowed)
    static = backward.executor.static_inputs
    graph = backward.plan.graph
    lent_bytes = sum(int(graph.nodes[graph.inputs[k]].nbytes) for k in backward.lent_inputs)
    priced = backward.replay_copies(static)
    backward.lent_inputs = frozenset()
    assert lent_bytes > 0 and backward.replay_copies(static) == priced + lent_bytes
    del new, forward, backward


def test_a_fallback_with_host_effects_is_not_captured(tmp_path):
    def fn(x):
        return torch.linalg.inv(x @ x.mT + torch.eye(4)) + 1  # inv's check reads its info

    compiled = torch.compile(
        fn, backend="tilec", options={"cudagraphs": True, "dump": str(tmp_path)}
    )
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 4)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-4, rtol=1e-4)
    assert tilec.stats()["fallbacks"]
    assert (
        "ATen fallback with_effects of aten._linalg_check_errors.default has effects on the host"
        in _decisions(tmp_path)
    )


def _top3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.topk(x.exp(), 3, dim=-1)  # topk falls back to ATen
    return values * 2, indices + 1


def test_a_device_only_fallback_is_captured_and_replayed(tmp_path, monkeypatch):
    """An ATen fallback that is all device work (topk: a MoE router's) is
    captured with the kernels around it, as Inductor captures its own, and
    each replay computes it again from the call's inputs."""
    replayed = _replays(monkeypatch)
    before = set(programs())
    compiled = torch.compile(
        _top3, backend="tilec", options={"cudagraphs": True, "dump": str(tmp_path)}
    )
    with torch.no_grad():
        for k in range(4):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(k))
            assert_close_tree(compiled(x), _top3(x))
    assert tilec.stats()["fallbacks"] == {"aten.topk.default": 1}
    assert "captured: after one warm-up call, then replayed" in _decisions(tmp_path)
    assert len(replayed) == 3
    program = _new_program(before)
    assert program.executor.captures == 1
    assert any("topk" in str(fn) for fn, *_ in replayed[0].steps)


def test_a_capture_that_fails_in_a_fallback_runs_eagerly_with_the_reason(monkeypatch):
    """A fallback that synchronizes fails a CUDA capture; the program then
    runs eagerly, and says why.  A failure in a program without fallbacks
    is tilec's bug: it is raised."""

    def failing(self, job):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(StandInGraphs, "capture", failing)
    before = set(programs())
    compiled = torch.compile(_top3, backend="tilec", options={"cudagraphs": True})
    with torch.no_grad():
        for k in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(k))
            assert_close_tree(compiled(x), _top3(x))
    program = _new_program(before)
    assert program.cudagraphs == (
        "not captured: capture failed in an ATen fallback, so it runs eagerly: "
        "CUDA error: operation not permitted when stream is capturing"
    )
    assert program.executor.captures == 1  # tried once, not on every call
    del program
    torch._dynamo.reset()
    no_fallback = torch.compile(
        lambda x: x.exp() * 2, backend="tilec", options={"cudagraphs": True}
    )
    with torch.no_grad(), pytest.raises(RuntimeError, match="operation not permitted"):
        for _ in range(2):
            no_fallback(torch.randn(4))


def test_stand_in_is_the_backend_on_a_cpu():
    model = nn.Linear(4, 4).eval()
    before = set(programs())
    compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    _calls(model, compiled, 2, shape=(3, 4))
    assert isinstance(_new_program(before).executor.backend, StandInGraphs)


@pytest.mark.gpu
def test_cuda_graphs_replay_matches_eager_and_keeps_outputs():
    torch.manual_seed(0)
    model = Block().eval().cuda()
    before = set(programs())
    compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    results = []
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(2, 8, 16, device="cuda")
            results.append((compiled(x), model(x)))
    kept = [a.clone() for a, _ in results]
    for (actual, expected), copy in zip(results, kept):
        assert torch.equal(actual, copy)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    executor = _new_program(before).executor
    assert isinstance(executor, GraphExecutor)
    assert executor.captures == 1
    assert isinstance(executor.graph, torch.cuda.CUDAGraph)


@pytest.mark.gpu
def test_cuda_graphs_capture_a_device_only_fallback_and_refuse_a_host_check():
    """Real CUDA graphs: topk (an ATen fallback) captured and replayed with
    eager's results over inputs that change; linalg.inv's error check, which
    reads its info on the host, runs eagerly."""
    before = set(programs())
    compiled = torch.compile(_top3, backend="tilec", mode="reduce-overhead")
    with torch.no_grad():
        for k in range(4):
            x = torch.randn(5, 8, device="cuda", generator=_cuda_generator(k))
            assert_close_tree(compiled(x), _top3(x))
    executor = _new_program(before).executor
    assert isinstance(executor.graph, torch.cuda.CUDAGraph)
    assert executor.captures == 1 and executor.replays == 2

    def inverse(x):
        return torch.linalg.inv(x @ x.mT + torch.eye(4, device=x.device)) + 1

    before = set(programs())
    compiled = torch.compile(inverse, backend="tilec", mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 4, device="cuda")
            torch.testing.assert_close(compiled(x), inverse(x), atol=1e-4, rtol=1e-4)
    assert "has effects on the host" in _new_program(before).cudagraphs


def _cuda_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.gpu
def test_cuda_graphs_replay_training_steps_with_eagers_results():
    """Real CUDA graphs of a training step (BatchNorm writing its statistics,
    dropout drawing its seed in the graph): five SGD steps give eager's
    parameters (no dropout) and new masks every step (dropout)."""
    model, twin = _trainee().cuda(), _trainee().cuda()
    before = set(programs())
    compiled = torch.compile(twin, backend="tilec", mode="reduce-overhead")

    def steps(m, run):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.05)
        for k in range(5):
            x = torch.randn(6, 8, device="cuda", generator=_cuda_generator(k))
            optimizer.zero_grad()
            run(x).pow(2).mean().backward()
            optimizer.step()

    steps(model, model)
    steps(twin, compiled)
    torch.testing.assert_close(twin.state_dict(), model.state_dict(), atol=1e-4, rtol=1e-4)
    executors_ = [p.executor for n, p in programs().items() if n not in before]
    graphs = [e for e in executors_ if isinstance(e.graph, torch.cuda.CUDAGraph)]
    assert len(graphs) == 2 and all(e.captures == 1 and e.replays == 4 for e in graphs)
    (forward,) = [e for e in graphs if e.plan.graph.name.endswith("forward")]
    (backward,) = [e for e in graphs if e.plan.graph.name.endswith("backward")]
    assert forward.lent_baseline and forward.lent_busy == 0
    # The backward reads them where they lie, holding none of them.
    assert len(backward.borrowed) == len(forward.lent_baseline)
    assert all(backward.buffers[k] is None for k in backward.borrowed)

    # Gradient accumulation: a replay never writes over activations held.
    model, twin = _trainee().cuda(), _trainee().cuda()
    compiled = torch.compile(twin, backend="tilec", mode="reduce-overhead")
    cuda_run = lambda m: lambda x: m(x.cuda())  # noqa: E731
    _accumulate(model, cuda_run(model), 4)
    _accumulate(twin, cuda_run(compiled), 4)
    for mine, theirs in zip(twin.parameters(), model.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-4, rtol=1e-4)

    dropout = torch.compile(nn.Dropout(0.5).train(), backend="tilec", mode="reduce-overhead")
    masks = []
    for _ in range(4):
        x = torch.ones(64, 32, device="cuda", requires_grad=True)
        y = dropout(x)
        y.sum().backward()
        torch.testing.assert_close(x.grad, (y != 0).float() * 2)
        masks.append(y != 0)
    assert all(not torch.equal(masks[k], masks[k + 1]) for k in range(3))


@pytest.mark.gpu
def test_generic_programs_on_cuda_graphs_replay_per_size_bucket():
    """Real CUDA graphs of a generic program: kernels that read their sizes
    from device memory give eager's results at every size of a bucket."""

    def fn(x, y):
        z = torch.cat([x, y], 1)
        return torch.softmax(z * 2, -1), z.sum(0)

    compiled = torch.compile(
        fn, backend="tilec", dynamic=True, options={"cudagraphs": True, "max_specializations": 0}
    )
    with torch.no_grad():
        for n in (6, 5, 7, 9, 20, 33, 11):
            x, y = torch.randn(3, n, device="cuda"), torch.randn(3, 1, device="cuda")
            assert_close_tree(compiled(x, y), fn(x, y))
    (program,) = programs().values()
    graphs = program.executor.graphs
    assert {tuple(sorted(k)) for k in graphs} == {(16, 16), (16, 32), (16, 64)}
    assert all(isinstance(g.graph, torch.cuda.CUDAGraph) for g in graphs.values())


def test_an_input_that_keeps_its_storage_is_read_in_place():
    """Like a static KV cache: the same tensor, updated in place between calls,
    is not copied into the graph (the replay reads it where it is); once a
    call passes another tensor, that input is copied from then on (one more
    capture, then no more)."""
    torch.manual_seed(0)
    model = Block().eval()
    before = set(programs())
    compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    state = torch.randn(2, 8, 16)
    with torch.no_grad():
        for k in range(4):
            state.copy_(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(k)))
            assert_close_tree(compiled(state), model(state), atol=1e-5, rtol=1e-5)
        executor = _new_program(before).executor
        assert executor.copied == [] and executor.captures == 1
        for k in range(3):
            x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(10 + k))
            assert_close_tree(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert len(executor.copied) == 1 and executor.demoted == set(executor.copied)
    assert executor.captures == 2


def _state_calls(model, compiled, states, start=0):
    """Call ``compiled`` on each tensor of ``states`` after filling it with
    new values in place (a KV cache written between calls); compared with
    eager each time."""
    with torch.no_grad():
        for k, state in enumerate(states):
            state.copy_(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(start + k)))
            assert_close_tree(compiled(state), model(state), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("copy_s", [1.0, 0.0])
def test_a_copied_input_is_read_in_place_once_its_copies_cost_a_capture(copy_s):
    """With cost figures (here: copying the input costs 1 s a replay, or
    nothing): an input that moved between the warm-up and the capture is
    copied; staying put, it is read in place as soon as its copies have
    cost what the capture took (1 s: after one replay), never where copies
    are free.  Read in place, when it moves again after the graph served
    replays whose copies would have cost more than a capture (a new
    ``generate``'s KV cache), it is captured again in place; where copies
    are free it stays copied and nothing is captured again."""
    torch.manual_seed(0)
    model = Block().eval()
    before = set(programs())
    compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    first, second, third = (torch.zeros(2, 8, 16) for _ in range(3))
    _state_calls(model, compiled, [first])  # the warm-up call
    executor = _new_program(before).executor
    executor.copy_seconds = lambda nbytes: copy_s
    _state_calls(model, compiled, [second], start=1)
    assert executor.captures == 1 and executor.copied == [0]
    _state_calls(model, compiled, [second] * 3, start=2)
    if copy_s:  # one replay's copy paid for the capture: in place from the next call
        assert executor.captures == 2 and executor.copied == [] and executor.replays == 3
    else:
        assert executor.captures == 1 and executor.copied == [0]
    _state_calls(model, compiled, [third] * 2, start=5)  # moved after replays
    assert executor.captures == (3 if copy_s else 1)
    assert executor.copied == ([] if copy_s else [0]) and executor.demoted == set()


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, big: torch.Tensor, small: torch.Tensor) -> torch.Tensor:
        return self.lin(big) * small


def test_only_the_inputs_that_pay_for_the_capture_are_read_in_place():
    """Two copied inputs that stay put: the big one's copies cost 1 s a
    replay, the small one's a nanosecond.  The big one's pay for a capture
    after one replay, and only it is read in place from then on: the small
    one, like a token id whose storage happens to come back, stays copied
    (read in place along with the big one, it would cost a capture of its
    own as soon as it moved)."""
    torch.manual_seed(0)
    model = Scaled().eval()
    before = set(programs())
    compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    pairs = [(torch.randn(64, 16), torch.randn(16)) for _ in range(2)]
    with torch.no_grad():
        compiled(*pairs[0])  # the warm-up call
        executor = _new_program(before).executor
        executor.copy_seconds = lambda nbytes: 1.0 if nbytes > 1024 else 1e-9
        for _ in range(4):
            assert_close_tree(compiled(*pairs[1]), model(*pairs[1]), atol=1e-5, rtol=1e-5)
    assert executor.captures == 2
    assert [executor.buffers[k].shape for k in executor.copied] == [(16,)]


def test_without_cost_figures_a_moved_input_stays_copied():
    """On a target without cost figures (the CPU) a moved input that seemed
    stable is copied from then on, however long it then stays put."""
    torch.manual_seed(0)
    model = Block().eval()
    before = set(programs())
    compiled = torch.compile(model, backend="tilec", mode="reduce-overhead")
    first, second = torch.zeros(2, 8, 16), torch.zeros(2, 8, 16)
    _state_calls(model, compiled, [first] * 4)
    executor = _new_program(before).executor
    assert executor.copy_seconds is None and executor.copied == []
    _state_calls(model, compiled, [second] * 6, start=4)
    assert executor.captures == 2 and executor.copied == [0] and executor.demoted == {0}


def test_under_graphs_a_matmul_over_symbolic_sizes_takes_the_template(tmp_path):
    """Without graphs the interpreter keeps a plain matmul in the library;
    under graphs, where the library call would keep the generic program out,
    it becomes the GEMM template (the decision says why) and the program is
    captured.  A static program's matmul is chosen as before."""

    def fn(x):
        return (x @ x.t()).relu()

    def decisions(options: dict) -> list:
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="tilec", dynamic=True, options=options)
        with torch.no_grad():
            for n in (5, 7, 9, 20):
                x = torch.randn(n, 4)
                torch.testing.assert_close(compiled(x), fn(x))
        program = list(programs().values())[-1]
        return program, [d for d in program.graph.decisions if d.stage == "matmul"]

    _, (plain,) = decisions({"max_specializations": 0})
    assert plain.outcome == "library"
    program, (replayed,) = decisions({"max_specializations": 0, "cudagraphs": True})
    assert replayed.outcome == "template" and replayed.reason == "replayed_symbolic"
    assert len(program.executor.graphs) == 2 and not program.plan.library_calls()
    _, (static,) = decisions({"max_specializations": 4, "specialize": "first", "cudagraphs": True})
    assert static.outcome == "library"

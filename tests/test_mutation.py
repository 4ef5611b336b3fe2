"""Inputs the graph writes (AOTAutograd's input mutations kept in the graph):
``Graph.mutations``, and scatters storing into their input
(``passes/in_place.py``).  Oracle: eager, on the outputs and on the inputs'
values after the call; and the IR interpreter."""

from __future__ import annotations

import gc

import torch

import tilec
from tests.compare import assert_close_tree


def _cache_step(x, pos, cache):
    """A KV-cache write read before (its old sum) and after (a product)."""
    old = cache.sum()
    cache.index_copy_(2, pos, x)
    return cache @ cache.transpose(-1, -2), old


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 2, 1, 4, generator=g),
        torch.tensor([3]),
        torch.randn(1, 2, 8, 4, generator=g),
    )


def _compare(fn, *inputs, options=None, calls=1):
    """``fn`` compiled and eager on copies of ``inputs``, ``calls`` times:
    the same results and the same inputs afterwards; returns the program."""
    mine = [t.clone() for t in inputs]
    theirs = [t.clone() for t in inputs]
    compiled = torch.compile(fn, backend="tilec", options=options)
    with torch.no_grad():
        for _ in range(calls):
            assert_close_tree(compiled(*mine), fn(*theirs), 1e-6, 1e-6)
    assert_close_tree(mine, theirs, 1e-6, 1e-6)
    gc.collect()
    programs = list(tilec.programs().values())
    return programs[-1] if programs else None


def test_a_cache_written_in_place_read_before_and_after():
    """The scatter stores into the cache itself: no init copy of the cache,
    no copy back; the old value's reader runs before it."""
    program = _compare(_cache_step, *_inputs())
    assert tilec.stats()["fallbacks"] == {}
    # The old value's sum, then the scatter: no kernel copies the cache.
    templates = [s.kernel.template for s in program.launches()]
    assert templates == ["persistent", "scatter"], templates
    assert "write_input" not in program.plan.source()
    # The scatter's kernel stores into the cache argument itself.
    scatter = program.launches()[1]
    (written,) = program.graph.mutations.values()
    assert scatter.args[-1] == program.plan.inputs()[written].var, scatter.args
    decisions = [d for d in program.graph.decisions if d.stage == "memory"]
    assert [d.outcome for d in decisions] == ["in place"], decisions


def test_the_ir_interpreter_writes_inputs_too():
    _compare(_cache_step, *_inputs(), options={"interpret": True})


def test_accumulating_index_put_in_place():
    def fn(idx, values, table):
        table.index_put_((idx,), values, accumulate=True)
        return table * 2

    idx = torch.tensor([0, 2, 2, 5])
    values = torch.randn(4, 3)
    program = _compare(fn, idx, values, torch.randn(6, 3))
    assert [d.outcome for d in program.graph.decisions if d.stage == "memory"] == ["in place"]


def test_a_value_that_is_not_a_scatter_is_written_back():
    """A counter and a scaled buffer: computed by kernels, then written into
    their inputs after every step."""

    def fn(x, counter, buf):
        counter += 1
        buf.mul_(x.mean())
        return buf + counter

    program = _compare(fn, torch.randn(5), torch.zeros((), dtype=torch.int64), torch.randn(5))
    assert program.plan.source().count("write_input") == 2


def test_old_value_read_with_the_new_one_is_copied_not_overwritten():
    """The old value and the new one in one expression: the scatter cannot
    store into the input (the old value would be gone); it is copied, and
    the dump says why."""

    def fn(x, pos, cache):
        old = cache.clone()
        cache.index_copy_(2, pos, x)
        return old - cache

    program = _compare(fn, *_inputs())
    (decision,) = [d for d in program.graph.decisions if d.stage == "memory"]
    assert decision.outcome == "copied" and decision.reason == "read_after", decision


def test_batchnorm_running_statistics_in_training():
    """The forward graph of a training step writes BatchNorm's running mean
    and variance and its batch counter, as eager does."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    mine = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    mine.load_state_dict(eager.state_dict())
    compiled = torch.compile(mine, backend="tilec")
    for seed in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
        eager(x).square().sum().backward()
        compiled(x).square().sum().backward()
    for (name, a), (_, b) in zip(mine.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(a, b, msg=name)
    for a, b in zip(mine.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_replayed_graphs_write_their_inputs():
    """Under graph capture (the CPU stand-in): a cache whose storage stays
    is written in place by the replay; a counter passed as a new tensor each
    call is written back into that tensor."""
    x, pos, cache = _inputs()
    compiled = torch.compile(_cache_step, backend="tilec", options={"cudagraphs": True})
    expected = cache.clone()
    with torch.no_grad():
        for step in range(4):
            p = torch.tensor([step])
            got = compiled(x + step, p, cache)
            want = _cache_step(x + step, p, expected)
            assert_close_tree(got, want, 1e-6, 1e-6)
            assert_close_tree(cache, expected, 1e-6, 1e-6)

    def count(x, counter):
        counter += 1
        return x * counter

    compiled = torch.compile(count, backend="tilec", options={"cudagraphs": True})
    with torch.no_grad():
        for step in range(4):
            counter = torch.full((), step)
            out = compiled(torch.ones(3), counter)
            assert counter.item() == step + 1 and out.tolist() == [step + 1] * 3


def test_a_frozen_model_keeps_its_written_buffer_an_input():
    """``freeze`` turns parameters and buffers into constants, but a buffer
    the forward writes is state: it stays an input and is written."""

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

        def forward(self, x):
            self.calls += 1
            return self.linear(x) * self.calls

    eager, mine = Counting(), Counting()
    mine.load_state_dict(eager.state_dict())
    compiled = torch.compile(mine, backend="tilec", options={"freeze": True})
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3)
            assert_close_tree(compiled(x), eager(x), 1e-6, 1e-6)
    assert mine.calls.item() == eager.calls.item() == 3


def test_a_reader_of_the_old_value_that_needs_the_scatters_kernel():
    """``v`` is computed in the scatter's kernel and read, with the old
    cache, by another kernel: that kernel cannot run before the scatter, so
    the scatter is copied (ordering it first made a cycle)."""

    def fn(x, pos, cache):
        v = x * 2
        r = cache * v
        cache.index_copy_(2, pos, v)
        return r, cache * 1

    program = _compare(fn, *_inputs())
    (decision,) = [d for d in program.graph.decisions if d.stage == "memory"]
    assert decision.outcome == "copied" and decision.reason == "read_after", decision

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
    exact = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).double()
    mine.load_state_dict(eager.state_dict())
    exact.load_state_dict(eager.state_dict())
    compiled = torch.compile(mine, backend="tilec")
    for seed in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
        eager(x).square().sum().backward()
        compiled(x).square().sum().backward()
        exact(x.double()).square().sum().backward()
    for (name, a), (_, b) in zip(mine.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(a, b, msg=name)
    # The gradients against float64: BatchNorm's backward cancels terms of
    # about 36 down to 0.04 (the linear weight's) and to 0 (its bias), so
    # float32's error there is some 1e-5, in eager as in tilec, and which of
    # the two is nearer depends on the CPU's summation order.
    for a, b, e in zip(mine.parameters(), eager.parameters(), exact.parameters()):
        for grad in (a.grad, b.grad):
            torch.testing.assert_close(grad.double(), e.grad, atol=1e-4, rtol=1e-4)


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


def test_a_kernel_reading_the_old_value_beside_the_new_one():
    """``b * a`` (the old ``b``) and ``a + b`` (the new) are fused into one
    kernel: neither node needs the other, but the kernel reads the old value
    and needs the scatter's, so the scatter cannot store into ``b`` (the
    order it would need made a cycle, and the compile failed)."""

    def fn(a, b, idx):
        x = b * a
        b.index_put_((idx,), a[idx] * 3)
        return x, a + b

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    program = _compare(fn, a, b, torch.tensor([2, 0]), calls=2)
    assert tilec.stats()["fallbacks"] == {}
    # The scatter's init copy, the scatter, and one kernel storing both outputs.
    stored = [s.kernel.group.stored for s in program.launches()]
    assert len(stored) == 3 and any(len(names) == 2 for names in stored), stored
    (decision,) = _memory_decisions(program).values()
    assert decision == ("copied", "read_after"), decision


def _memory_decisions(program) -> dict[str, tuple[str, str]]:
    return {
        d.subject: (d.outcome, d.reason) for d in program.graph.decisions if d.stage == "memory"
    }


def test_a_pointwise_new_value_is_stored_into_its_input():
    """An optimizer-like step: each new value is computed by a kernel that
    reads the old one at the element it writes, so it stores into the input
    itself and the call copies nothing back."""

    def step(p, grad, buf):
        buf.mul_(0.9).add_(grad)
        p.add_(buf, alpha=-0.1)

    p, grad, buf = torch.randn(7, 5), torch.randn(7, 5), torch.randn(7, 5)
    program = _compare(step, p, grad, buf, calls=3)
    assert "write_input" not in program.plan.source()
    assert set(_memory_decisions(program).values()) == {("in place", "input_written")}
    # The kernel stores into the inputs it reads, through their own
    # pointers: it has no output argument, and nothing is allocated.
    (launch,) = program.launches()
    assert not any(arg.is_output for arg in launch.kernel.args), launch.kernel.args
    assert "empty" not in program.plan.source()


def test_a_new_value_read_elsewhere_in_its_kernel_is_copied():
    """``x.copy_(x.flip(0) + 1)``: the kernel reads element ``n - 1 - i``
    while writing element ``i``; written in place, it would read values it
    has already overwritten."""

    def fn(x):
        x.copy_(x.flip(0) + 1)

    program = _compare(fn, torch.randn(9), calls=2)
    (decision,) = _memory_decisions(program).values()
    assert decision == ("copied", "same_kernel"), decision
    assert program.plan.source().count("write_input") == 1


def test_a_read_of_the_old_value_by_a_library_call_runs_first():
    """The old value's product is a library call: it runs before the kernel
    that overwrites the input."""

    def fn(x, y, w):
        product = x @ w
        x.mul_(y)
        return product

    program = _compare(fn, torch.randn(4, 6), torch.randn(4, 6), torch.randn(6, 3), calls=2)
    assert _memory_decisions(program) == {"%mul": ("in place", "input_written")}
    assert "write_input" not in program.plan.source()
    order = [type(s).__name__ for s in program.plan.steps if type(s).__name__ != "ViewStep"]
    assert order == ["LibraryStep", "LaunchStep"], order


def _two_caches_step(k, v, pos, k_cache, v_cache):
    """A decoder layer's cache writes: the rotated key and the value at one
    position, each into its own cache, read after."""
    k_cache.index_copy_(2, pos, k * 2 - k.flip(-1))
    v_cache.index_copy_(2, pos, v + 1)
    return k_cache @ v_cache.transpose(-1, -2)


def test_key_and_value_cache_writes_share_one_kernel():
    """Two scatters over updates of one shape are one kernel, each storing
    into its own cache (no copy of either); against eager, twice (the second
    call sees the first call's writes), and the IR interpreter alike."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 1, 4, generator=g).unsqueeze(0), torch.randn(1, 2, 1, 4, generator=g)
    caches = torch.randn(1, 2, 8, 4, generator=g), torch.randn(1, 2, 8, 4, generator=g)
    program = _compare(_two_caches_step, k, v, torch.tensor([5]), *caches, calls=2)
    assert tilec.stats()["fallbacks"] == {}
    (scatter,) = [s.kernel for s in program.launches() if s.kernel.template == "scatter"]
    assert [program.graph.nodes[n].kind for n in scatter.group.stored] == ["scatter"] * 2
    assert sorted(program.graph.in_place.values()) == sorted(
        program.graph.inputs[i] for i in program.graph.mutations.values()
    )
    assert "write_input" not in program.plan.source()
    _compare(_two_caches_step, k, v, torch.tensor([2]), *caches, options={"interpret": True})

"""Calls of compiled programs from several threads or streams at once
(``Program.__call__``).  Every call of a program uses the same arena, chain
counters and, once captured, graph buffers: calls run one after another
(the program's lock), and on a GPU a call on another stream than the last
call's waits for that stream's work first.  On the CPU every program's
call holds one lock besides: Triton's interpreter is not thread-safe."""

from __future__ import annotations

import contextlib
import sys
import threading

import pytest
import torch

from tilec.runtime.program import Program


def _steps(x: torch.Tensor) -> torch.Tensor:
    """Three kernels, two intermediates in the arena: a softmax over rows,
    its sum over columns, and what reads both."""
    h = torch.softmax(x, -1)
    c = h.sum(0, keepdim=True)
    return torch.tanh(h - c) * 2


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x - x.mean(-1, keepdim=True)) * 3


def test_threads_calling_compiled_programs_at_once_match_eager():
    """Three threads, each calling two compiled functions (one program
    each) with inputs of its own: every result is eager's.  Without the
    lock, the interpreter failed inside (two threads patching its
    builtins) and calls of one program shared its arena."""
    torch._dynamo.reset()
    steps = torch.compile(_steps, backend="tilec")
    scaled = torch.compile(_scaled, backend="tilec")
    steps(torch.randn(8, 16))  # compiled before the threads start
    scaled(torch.randn(8, 16))
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(4):
                x = torch.randn(8, 16, generator=g)
                with torch.no_grad():
                    torch.testing.assert_close(steps(x), _steps(x))
                    torch.testing.assert_close(scaled(x), _scaled(x))
        except BaseException as failure:  # re-raised by the test's thread
            failures.append(failure)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often, inside kernels too
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    if failures:
        raise failures[0]


class _Stream:
    """A stand-in for ``torch.cuda.Stream``: records the streams it waited for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[str] = []

    def wait_stream(self, other: _Stream) -> None:
        self.waited.append(other.name)


def test_a_call_on_another_stream_waits_for_the_last_calls_stream(monkeypatch):
    """Without a GPU, torch's stream functions are replaced by stand-ins:
    a call waits for the stream of the call before when its own differs,
    never within a graph the caller is capturing."""
    s1, s2, s3 = _Stream("s1"), _Stream("s2"), _Stream("s3")
    current, capturing = [s1], [False]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    program = Program.__new__(Program)
    program.device = torch.device("cuda", 0)
    program._lock, program._stream = threading.RLock(), None
    calls = []
    program._run = lambda inputs, sizes: calls.append(current[0].name) or []

    def call_on(stream: _Stream, captured: bool = False) -> None:
        current[0], capturing[0] = stream, captured
        program()

    call_on(s1)
    call_on(s1)
    call_on(s2)
    call_on(s3, captured=True)  # inside the caller's capture: no wait
    call_on(s1)
    assert calls == ["s1", "s1", "s2", "s3", "s1"]
    assert (s1.waited, s2.waited, s3.waited) == (["s2"], ["s1"], [])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_calls_on_two_streams_without_a_sync_match_eager(mode):
    """One program called on two streams back to back, no sync between:
    the calls' kernels would overlap (64 MB a buffer) and share the arena
    and, captured, the graph's input buffers.  Each result is eager's."""
    torch._dynamo.reset()
    compiled = torch.compile(_steps, backend="tilec", mode=mode)
    xs = [torch.randn(4096, 4096, device="cuda") for _ in range(3)]
    for _ in range(3):  # warm-up, capture, a replay
        compiled(xs[0])
    expected = [_steps(x) for x in xs[1:]]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(3):
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
        results = []
        for stream, x in zip(streams, xs[1:]):
            with torch.cuda.stream(stream):
                results.append(compiled(x))
        torch.cuda.synchronize()
        for actual, wanted in zip(results, expected):
            torch.testing.assert_close(actual, wanted)

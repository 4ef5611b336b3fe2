"""Graphs whose tensors are on more than one device: a CPU step counter
beside CUDA tensors (``transformers``' static KV cache keeps its length in a
0-dim CPU tensor until the first call moves it).  Kernels run on the graph's
device; an op that touches a tensor on another device runs in ATen, as eager
runs it (a counted fallback, so such a graph is not captured in a CUDA graph).

Without a GPU the lowering is checked on fake CUDA tensors; the ``gpu``
tests run the same graphs on CUDA against eager.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tilec.lower import graph_device, lower_graph
from tilec.lower_ops import RULES
from tilec.pipeline import programs
from tilec.runtime.program import Program, constant_device


def _step(x: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A static cache's update: positions from a counter, the counter advanced."""
    positions = torch.arange(x.shape[-1], device=x.device) + count
    return x * positions, count + x.shape[-1]


def _fake_cuda_graph() -> torch.fx.GraphModule:
    with FakeTensorMode():
        x = torch.empty(3, 4, device="cuda")
        count = torch.empty((), dtype=torch.int64)
    return make_fx(_step, tracing_mode="fake")(x, count)


def test_the_graph_device_is_the_accelerator_beside_a_cpu_scalar():
    gm = _fake_cuda_graph()
    assert [n.meta["val"].device.type for n in gm.graph.nodes if n.op == "placeholder"] == [
        "cuda",
        "cpu",
    ]
    assert graph_device(gm) == torch.device("cuda", 0)


def test_the_graph_device_reads_dynamo_example_values():
    """Dynamo's graphs carry ``example_value``, not ``val``: the backend picks
    CUDA graphs (or the CPU stand-in) from what this returns."""
    gm = torch.fx.symbolic_trace(lambda x, y: x + y)
    with FakeTensorMode():
        fake = torch.empty(2, device="cuda")
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta["example_value"] = fake
    assert graph_device(gm) == torch.device("cuda", 0)
    for node in gm.graph.nodes:
        node.meta.pop("example_value", None)
    assert graph_device(gm) == torch.device("cpu")


def test_ops_that_touch_a_cpu_tensor_run_in_aten_on_a_cuda_graph():
    """The counter's reads become ATen fallbacks, counted and marked with the
    device they touch; the rest stays in kernels."""
    graph, fallbacks = lower_graph(_fake_cuda_graph(), "step", RULES, {})
    assert fallbacks == {"aten.add.Tensor (on cpu)": 2}
    externs = [n for n in graph.nodes.values() if n.kind == "extern"]
    assert [n.extern.device for n in externs] == ["cpu", "cpu"]
    # ``arange`` and the product read only CUDA tensors: still lowered.
    assert any(n.kind == "pointwise" for n in graph.nodes.values())
    assert all(n.extern is None for n in graph.nodes.values() if n.kind == "pointwise")


def _counted(x: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU counter advanced by a literal: a constant on the CPU."""
    return x * 2, count + torch.tensor(5)


def test_a_constant_only_cpu_fallbacks_read_stays_on_the_cpu():
    """Moved to the GPU with the rest, ``torch.tensor(5)`` would make the
    counter's sum a CUDA tensor, where eager's is on the CPU; a constant a
    kernel reads goes to the program's device."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, 4, device="cuda")
        scale = torch.empty(4, device="cuda")
        gm = make_fx(lambda x, count: _counted(x * scale, count))(
            x, torch.empty((), dtype=torch.long)
        )
    graph, fallbacks = lower_graph(gm, "step", RULES, {})
    assert fallbacks == {
        "aten.lift_fresh_copy.default (on cpu)": 1,
        "aten.add.Tensor (on cpu)": 1,
    }
    cuda = torch.device("cuda", 0)
    places = {
        graph.constants[name].device.type: constant_device(graph, name, cuda)
        for name in graph.constants
    }
    assert places == {"cpu": torch.device("cpu"), "cuda": cuda}


def test_a_cpu_only_graph_lowers_as_before():
    x, count = torch.randn(3, 4), torch.tensor(2)
    graph, fallbacks = lower_graph(make_fx(_step)(x, count), "step", RULES, {})
    assert fallbacks == {}
    assert all(n.kind != "extern" for n in graph.nodes.values())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_cpu_step_counter_beside_cuda_tensors_matches_eager(mode):
    torch.manual_seed(0)
    before = set(programs())
    compiled = torch.compile(_step, backend="tilec", mode=mode)
    for k in range(4):
        x = torch.randn(3, 4, device="cuda")
        count = torch.tensor(k)
        actual, expected = compiled(x, count), _step(x, count)
        torch.testing.assert_close(actual, expected)
        assert actual[1].device == expected[1].device
    (program,) = [p for name, p in programs().items() if name not in before]
    if mode:
        assert program.cudagraphs.startswith("not captured: ATen fallback"), program.cudagraphs


@pytest.mark.gpu
def test_a_cpu_constant_beside_cuda_tensors_keeps_eagers_devices():
    compiled = torch.compile(_counted, backend="tilec")
    for k in range(3):
        x, count = torch.randn(3, 4, device="cuda"), torch.tensor(k)
        actual, expected = compiled(x, count), _counted(x, count)
        torch.testing.assert_close(actual, expected)
        assert [t.device for t in actual] == [t.device for t in expected]


def test_a_cuda_program_runs_with_its_device_current(monkeypatch):
    """Triton's launchers and graph capture use the current device, so a
    program runs under a guard of its own device (a model on ``cuda:1``
    while device 0 is current).  Without a GPU torch's guard is replaced
    by one that records what is current."""
    current = ["cuda:0"]

    class Guard:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def __enter__(self) -> None:
            self.before, current[0] = current[0], str(self.device)

        def __exit__(self, *exc: object) -> None:
            current[0] = self.before

    seen = []
    program = Program.__new__(Program)
    program.device = torch.device("cuda", 1)
    program._lock = threading.RLock()
    program._order_after_last_call = lambda: None  # streams: tests/test_concurrency.py
    program._run = lambda inputs, sizes: seen.append(current[0]) or [inputs[0]]
    monkeypatch.setattr(torch.cuda, "device", Guard)
    assert program(torch.ones(1))[0].item() == 1
    assert seen == ["cuda:1"] and current == ["cuda:0"]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_model_on_the_second_gpu_matches_eager_while_the_first_is_current(mode):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU()).to("cuda:1")
    compiled = torch.compile(model, backend="tilec", mode=mode)
    torch.cuda.set_device(0)
    for _ in range(3):
        x = torch.randn(8, 32, device="cuda:1")
        actual = compiled(x)
        torch.testing.assert_close(actual, model(x))
        assert actual.device == x.device
    assert torch.cuda.current_device() == 0

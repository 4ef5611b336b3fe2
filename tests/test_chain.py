"""Dependent kernels chained into one launch (option ``chain``,
``passes/chain.py``): each stage's programs wait inside the kernel for
the stages before it.

Oracles: eager torch (a decode of the tiny LLaMA over 32 tokens, called
and replayed; programs of pointwise ops and reductions), the same graph
without the option, and the sm_90 PTX (the finished count's release comes
after a barrier that follows the stores).  The Triton interpreter runs
programs one after another in ticket order, so it checks the stages'
order, the arguments and the counters' bookkeeping, not the GPU's memory
ordering or a wait: ``benchmarks.gpu_check``'s launch section runs a
chained kernel on a GPU."""

from __future__ import annotations

import gc
import re

import pytest
import torch

import tilec
from benchmarks.sm90 import compile_kernel
from tests.compare import assert_close_tree, run_tilec
from tests.test_generate import _static_cache_generate, _tiny_llama
from tilec import cost
from tilec.codegen.kernel import prefetched
from tilec.codegen.record import kernel_entry
from tilec.passes.chain import sync_name
from tilec.target import H100_SXM


def _layers(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Kernels each reading what the one before wrote: a product, a
    softmax, a column sum (another reduction layout), a row norm."""
    a = torch.softmax(x @ w, -1)
    b = torch.relu(a.sum(0, keepdim=True) * x)
    return (b / b.sum(1, keepdim=True)).amax(0) + a.mean()


def _program() -> tilec.Program:
    gc.collect()
    (program,) = tilec.programs().values()
    return program


def _chained(program: tilec.Program) -> list:
    return [s.kernel for s in program.launches() if s.kernel.stages]


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["called", "replayed"])
def test_a_chain_of_reductions_matches_eager_call_after_call(cudagraphs):
    """One launch of four stages (one of them two independent kernels
    combined) gives eager's values, and the same again on every call: the
    last program sets the counters back to 0."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 32, generator=g), torch.randn(32, 32, generator=g)
    expected = _layers(x, w)
    compiled = torch.compile(
        _layers, backend="tilec", options={"chain": True, "cudagraphs": cudagraphs}
    )
    for _ in range(3):
        assert_close_tree(compiled(x, w), expected, atol=1e-5, rtol=1e-5)
    program = _program()
    (kernel,) = [s.kernel for s in program.launches()]
    assert kernel.template == "chained" and [len(s) for s in kernel.stages] == [1, 2, 1, 1]
    # A stage waits for the end of the stage before: the combined stage's
    # two parts for the first stage's one program range (END0), the third
    # stage for the combination's second part (END2), the last for END3.
    waits = re.findall(r"sync \+ 1, END(\d+)", kernel.source)
    assert sorted(waits) == ["0", "0", "2", "3"], waits
    assert kernel.source.count("    _chain_wait(finished, count)\n") == 4
    counters = program.graph.constants[sync_name(kernel.group.name)]
    assert counters.dtype == torch.int32 and not counters.any()


def test_off_by_default_nothing_is_chained():
    torch._dynamo.reset()
    x, w = torch.randn(64, 32), torch.randn(32, 32)
    assert_close_tree(run_tilec(_layers, x, w), _layers(x, w), atol=1e-5, rtol=1e-5)
    program = _program()
    assert len(program.launches()) == 4 and not _chained(program)
    assert not [c for c in program.graph.constants if c.endswith("_sync")]


def test_static_cache_decode_with_chained_kernels_matches_eager():
    """32 greedy tokens of the tiny LLaMA under ``reduce-overhead`` with
    its decode GEMVs as reductions and every kernel but the attention
    chained: eager's tokens.  A decode step is a launch for the attention
    of each layer and one chained kernel between two attentions (the
    output product and cache write, the MLP, the next layer's norm and q/k/v
    product), as many stages as the unchained kernels."""
    compiled = _static_cache_generate(
        "cpu", matmul="triton", gemv_reduction=True, split_combine=True, chain=True
    )
    layers = _tiny_llama().config.num_hidden_layers
    decode = [p for p in compiled if len(p.graph.mutations) > 2]
    assert decode
    for program in decode:
        templates = [s.kernel.template for s in program.launches()]
        assert templates == ["chained", "attention"] * layers + ["chained"], templates
        for kernel in _chained(program):
            assert not program.graph.constants[sync_name(kernel.group.name)].any()
            # The products' weights (inputs no kernel writes) are loaded
            # before their stage waits; the activations after.
            waiting = [f for f in kernel.source.split("@triton.jit") if "    _chain_wait(" in f]
            early = [f.split("    _chain_wait(")[0].count("tl.load(") for f in waiting]
            assert waiting and max(early) >= 1, kernel.name


def test_a_stage_loads_what_no_stage_writes_before_it_waits():
    """``prefetched``: index arithmetic, loads of stable pointers and what
    follows from them alone go first; a load through a pointer a stage
    writes, what reads it, a store, an atomic, a name assigned twice and a
    block's lines stay after the wait, each side in its order."""
    body = [
        "    x = program * 4 + tl.arange(0, 4)",
        "    w = tl.load(in1 + x)",
        "    a = tl.load(in0 + x)",
        "    wf = w.to(tl.float32)",
        "    y = a * wf",
        "    acc = tl.zeros([4], tl.float32)",
        "    for k in range(2):",
        "        acc += tl.load(in1 + k)",
        "    z = acc + wf",
        "    n = tl.atomic_add(in1, 0)",
        "    d = _chain_done(in1, 4)",
        "    s = x + 1",
        "    s = s + 1",
        "    tl.store(out0 + x, y + z)",
    ]
    before, after = prefetched(body, {"in1"})
    assert before == [body[0], body[1], body[3]]
    assert after == [line for line in body if line not in before]


def test_the_chained_kernel_compiles_for_sm90_and_publishes_after_a_barrier():
    """sm_90 PTX: every release (the finished count) comes after a CTA
    barrier that follows the stores before it; nothing spills."""
    torch._dynamo.reset()
    x, w = torch.randn(64, 32), torch.randn(32, 32)
    run_tilec(_layers, x, w, options={"chain": True})
    program = _program()
    (kernel,) = _chained(program)
    result = compile_kernel(kernel_entry(program.graph, kernel.group, kernel))
    assert result["ok"], result.get("error")
    assert result["publishes_after_barrier"] is True
    assert not result.get("spill_bytes")


def test_a_chain_is_priced_stage_after_stage():
    """The cost model: the stages' times one after another, the waits
    between them at the target's ``chain_wait_s``, and one launch."""
    stages = [cost.kernel(H100_SXM, n, programs=p) for n, p in ((1e6, 132), (4e6, 8), (2e5, 1))]
    chained = cost.chain(H100_SXM, stages, replayed=True)
    busy = sum(max(s.memory_s, s.compute_s) for s in stages)
    wait = H100_SXM.chain_wait_s.value
    assert chained.launch_s == cost.launch_seconds(H100_SXM, True)
    assert chained.seconds == pytest.approx(busy + 2 * wait + chained.launch_s)
    assert chained.bound == "stages"

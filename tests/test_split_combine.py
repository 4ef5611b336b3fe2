"""Split-KV attention combined inside its own kernel (option
``split_combine``, ``passes/attention_split.combine_in_kernel``): the last
of a row tile's programs to finish, counted by an atomic, combines the
chunks' partial results.

Oracles: eager torch over several decode positions (outputs and caches),
the same graph without the option, and the sm_90 PTX (the counter's
release comes after a barrier that follows every partial result's store).
The Triton interpreter runs programs one after another, so it checks the
arithmetic and the counter's bookkeeping, not the GPU's memory ordering:
``benchmarks.gpu_check`` runs it on a GPU."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import tilec
from benchmarks.sm90 import compile_kernel, publishes_after_barrier
from tests.compare import assert_close_tree, run_tilec
from tests.test_attention import _qkv, _relative
from tests.test_attention_cache import Step
from tests.test_generate import _tiny_llama
from tilec.attention import SPLIT_ACC
from tilec.codegen.record import kernel_entry
from tilec.runtime.program import Program

# Positions past 512 split the 640-position cache into two chunks of 384
# and 256 keys (4 heads fill 4 of 132 SMs): the first, the last, one in
# each chunk, and back to the start.
POSITIONS = (0, 1, 300, 639, 383, 384, 5)


def _decode(options: dict, cache: int = 640) -> tilec.Program:
    """Steps of a ``cache``-position static cache through tilec and
    eagerly (positions within it): outputs and caches equal at every step;
    returns the program."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Step(cache=cache).eval()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tilec", options=options)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for position in (p for p in POSITIONS if p < cache):
            x, pos = torch.randn(1, 1, 32, generator=g), torch.tensor([position])
            assert_close_tree(compiled(x, pos), eager(x, pos), atol=2e-5, rtol=2e-5)
            assert_close_tree(model.k_cache, eager.k_cache, atol=1e-6, rtol=1e-6)
            assert_close_tree(model.v_cache, eager.v_cache, atol=1e-6, rtol=1e-6)
    gc.collect()
    (program,) = tilec.programs().values()
    return program


def _attention(program) -> list:
    return [s.kernel for s in program.launches() if s.kernel.template == "attention"]


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["called", "replayed"])
def test_decode_steps_combine_the_chunks_in_the_attention_kernel(cudagraphs):
    """Every step equals eager's, called or replayed (the CPU stand-in):
    the counters are back at 0 after each launch.  No kernel but the
    attention reads the partial results, and its counters are a constant
    the program keeps."""
    program = _decode({"split_combine": True, "cudagraphs": cudagraphs})
    graph = program.graph
    (kernel,) = _attention(program)
    assert "sp = pid % 2" in kernel.source and "tl.atomic_add(" in kernel.source
    (acc,) = [n for n in graph.nodes.values() if n.reduce_op == SPLIT_ACC]
    partials = {acc.name, acc.name[:-4] + "_max", acc.name[:-4] + "_sum"}
    for step in program.launches():
        reads = {a.buffer for a in step.kernel.args if not a.is_output}
        assert step.kernel is kernel or not reads & partials, step.kernel.name
    (counter,) = [c for c in graph.constants if c.endswith("_done")]
    assert graph.constants[counter].dtype == torch.int32
    assert not graph.constants[counter].any()  # the live buffer on the CPU
    # The kernel's bytes count the partial results read back and the counters.
    assert partials <= set(kernel.reads) and counter in kernel.reads


def test_off_by_default_the_chunks_have_a_kernel_of_their_own():
    """Without the option the attention kernel has no counter, and a
    second kernel reads the partial results."""
    program = _decode({})
    (kernel,) = _attention(program)
    assert "atomic" not in kernel.source
    assert not [c for c in program.graph.constants if c.endswith("_done")]


def test_a_combined_result_with_a_fused_reader_keeps_its_kernel():
    """flex_attention's log-sum-exp is scaled in its combining kernel
    (fusion put the reader there): that kernel stays and reads the
    partial results; the output is combined in the attention kernel."""
    q, k, v = _qkv(m=1, n=700)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, return_lse=True)

    with torch.no_grad():
        expected = fn(q, k, v)
    torch._dynamo.reset()
    got = run_tilec(fn, q, k, v, options={"split_combine": True})
    assert_close_tree(got, expected, 2e-5, 2e-5)
    (program,) = tilec.programs().values()
    templates = [s.kernel.template for s in program.launches()]
    assert templates[0] == "attention" and len(templates) == 2, templates
    (kernel,) = _attention(program)
    assert "tl.atomic_add(" in kernel.source


def test_the_kernel_compiles_for_sm90_and_publishes_after_a_barrier():
    """sm_90 PTX: the counter's add is acquire-release at GPU scope and
    comes after a CTA barrier that follows the partial results' stores;
    the partial results are read back past L1 (``ld.global.cg``).  The
    combine over a constant count of chunks (8 here) is unrolled, so its
    loads go out together: in a loop, TinyLlama's decode attention (4
    chunks) waited for them chunk after chunk (10 loads in the loop)."""
    program = _decode({"split_combine": True}, cache=2048)
    (kernel,) = _attention(program)
    assert kernel.source.count("for chunk in tl.static_range(0, 8):") == 2
    result = compile_kernel(kernel_entry(program.graph, kernel.group, kernel))
    assert result["ok"], result.get("error")
    assert result["publishes_after_barrier"] is True
    assert not result.get("spill_bytes")


def test_the_ptx_check_tells_an_unordered_release():
    """``publishes_after_barrier`` on PTX written here: a release after a
    barrier after the stores; a store after the barrier; no release."""
    ordered = "st.global.b32 [%rd1], %r1;\nbar.sync 0;\n@%p1 atom.global.gpu.acq_rel.add.u32 %r2"
    unordered = "bar.sync 0;\nst.global.b32 [%rd1], %r1;\n@%p1 atom.global.gpu.release.add.u32"
    assert publishes_after_barrier(ordered) is True
    assert publishes_after_barrier(unordered) is False
    assert publishes_after_barrier("st.global.b32 [%rd1], %r1;\natom.global.gpu.relaxed") is None


def test_a_dynamic_cache_generate_combines_over_a_symbolic_chunk_count():
    """transformers' ``DynamicCache``: the generic decode program splits
    the keys in chunks of a fixed length, their number a function of the
    cache's length (one here); its attention kernels count to that number.
    Two generates of 16 tokens under CUDA graphs (the CPU stand-in, one
    capture per size bucket) give eager's tokens."""
    torch._dynamo.reset()
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    settings = {"max_new_tokens": 16, "do_sample": False}
    before = set(tilec.programs())
    with torch.no_grad():
        expected = model.generate(ids, **settings)
        model.forward = torch.compile(
            model.forward, backend="tilec", options={"cudagraphs": True, "split_combine": True}
        )
        assert torch.equal(model.generate(ids, **settings), expected)
        assert torch.equal(model.generate(ids, **settings), expected)
    generic = [p for n, p in tilec.programs().items() if n not in before and "generic" in n]
    assert generic
    for program in generic:
        kernels = _attention(program)
        assert len(kernels) == 2  # two layers
        assert all(k.sizes and "tl.atomic_add(" in k.source for k in kernels)


@pytest.mark.parametrize(
    "device, dtype",
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)],
)
def test_the_last_program_sees_every_chunk(device, dtype):
    """A decode row of 2 heads against 8192 keys splits into 32 chunks of
    256: 64 programs count on 2 counters (on a GPU at once, on many SMs).
    With q = 0 every key weighs the same and V's column c is 1 on chunk
    c's keys only, so the output is exactly 1/32 in columns 0 to 31 and 0
    beyond: a chunk the last program missed (or read stale) shows as a 0
    or a 1/31.  Several launches (200 on a GPU), each exact."""
    torch._dynamo.reset()
    keys, chunk = 8192, 256
    q = torch.zeros(1, 2, 1, 64, dtype=dtype, device=device)
    k = torch.randn(1, 2, keys, 64, generator=torch.Generator().manual_seed(0))
    v = torch.zeros(1, 2, keys, 64)
    v[:, :, torch.arange(keys), torch.arange(keys) // chunk] = 1.0
    k, v = k.to(device, dtype), v.to(device, dtype)

    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v

    expected = torch.zeros(1, 2, 1, 64, dtype=dtype, device=device)
    expected[..., : keys // chunk] = 1 / 32
    compiled = torch.compile(fn, backend="tilec", options={"split_combine": True})
    with torch.no_grad():
        for _ in range(200 if device == "cuda" else 3):
            assert torch.equal(compiled(q, k, v), expected)
    (program,) = tilec.programs().values()
    (kernel,) = _attention(program)
    assert "sp = pid % 32" in kernel.source and "tl.atomic_add(" in kernel.source


def test_the_program_is_built_outside_the_tracers_fake_mode(monkeypatch):
    """The counters are CPU constants that a GPU program copies to its
    device when it is built; under the tracer's fake tensor mode that copy
    fails (the first GPU run: "Please convert all Tensors to FakeTensors").
    On a CPU the copy is no copy, so this checks the mode itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes: list[bool] = []
    built = Program.__init__

    def init(self, *args, **kwargs):
        modes.append(any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack()))
        built(self, *args, **kwargs)

    monkeypatch.setattr(Program, "__init__", init)
    torch._dynamo.reset()
    q, k, v = torch.zeros(1, 2, 1, 64), torch.randn(1, 2, 1024, 64), torch.randn(1, 2, 1024, 64)

    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v

    compiled = torch.compile(fn, backend="tilec", options={"split_combine": True})
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v))
    (program,) = tilec.programs().values()
    assert program.graph.constants and modes == [False]

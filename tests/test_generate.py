"""LLM decode end to end: ``transformers``' ``generate`` with the model's
forward compiled by tilec.  Oracle: the tokens eager ``generate`` produces."""

from __future__ import annotations

import pytest
import torch

import tilec
from benchmarks.zoo import MODELS
from tilec.pipeline import programs
from tilec.runtime.executors import BucketExecutor, GraphExecutor, RecordedGraph

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> torch.nn.Module:
    """The zoo's tiny LLaMA (max_position_embeddings 64: room for 8 + 32 tokens)."""
    torch.manual_seed(0)
    return MODELS["llama"].build("tiny").model.model.eval()


# Under reduce-overhead, 32 tokens after 8: lengths in three size buckets.
@pytest.mark.parametrize(("mode", "tokens"), [(None, 16), ("reduce-overhead", 32)])
def test_dynamic_cache_decode_compiles_a_few_programs_once(mode, tokens):
    """Every decode step has a new length: the generic program serves them
    all (prefill, one generic program for decode, and at most one more), and a
    second generate compiles nothing.  The generic program's attention over
    the cache's symbolic length is the attention template, one kernel per
    layer, not torch's SDPA op (a library call).  Under ``reduce-overhead``
    the generic program is captured once per size bucket (the CPU stand-in
    here): the lengths 9 to 40 of the first generate make three, which the
    second reuses.  (Without graphs 16 tokens cover the generic program.)"""
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    settings = {"max_new_tokens": tokens, "do_sample": False}
    with torch.no_grad():
        expected = model.generate(ids, **settings)
        model.forward = torch.compile(model.forward, backend="tilec", mode=mode)
        first = model.generate(ids, **settings)
        compiled = tilec.stats()["graphs"]
        second = model.generate(ids, **(settings | {"max_new_tokens": 8}))
    assert torch.equal(first, expected)
    assert torch.equal(second, expected[:, : 8 + 8])
    assert expected.shape[1] == 8 + tokens
    assert compiled <= 3, compiled
    assert tilec.stats()["graphs"] == compiled  # the second generate compiled nothing
    assert not tilec.stats()["fallbacks"]
    generic = [p for name, p in programs().items() if name.endswith("_generic")]
    assert generic
    for program in generic:
        attention = [s for s in program.launches() if s.kernel.template == "attention"]
        assert len(attention) == 2 and all(s.kernel.sizes for s in attention)  # two layers
        library = {str(s.node.extern.target) for s in program.plan.library_calls()}
        assert not [op for op in library if "scaled_dot_product" in op], library
        if mode is None:
            continue
        executor = program.executor
        assert isinstance(executor, BucketExecutor), program.cudagraphs
        # One symbol per cache tensor (keys and values of two layers), all the same length.
        buckets = sorted({tuple(set(key)) for key in executor.graphs})
        assert buckets == [(16,), (32,), (64,)], buckets
        assert executor.eager_calls == 0
        assert all(isinstance(g.graph, RecordedGraph) for g in executor.graphs.values())


def _static_cache_generate(device: str, **options) -> list:
    """Greedy generate with the static cache, eager and under
    ``reduce-overhead`` (with tilec ``options``, if any): asserts equal
    tokens and no fallbacks but the cache's length counter, which starts as
    a CPU tensor and which the first call moves to the model's device (ATen,
    ``tests/test_devices.py``); returns the programs it compiled."""
    model = _tiny_llama().to(device)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    settings = {"max_new_tokens": 32, "do_sample": False, "cache_implementation": "static"}
    before = set(programs())
    # ``cudagraphs`` is what reduce-overhead means to tilec; torch.compile
    # takes a mode or options, not both.
    how = {"options": {"cudagraphs": True, **options}} if options else {"mode": "reduce-overhead"}
    with torch.no_grad():
        expected = model.generate(ids, **settings)
        model.forward = torch.compile(model.forward, backend="tilec", fullgraph=True, **how)
        actual = model.generate(ids, **settings)
    assert torch.equal(actual, expected)
    fallbacks = tilec.stats()["fallbacks"]
    if device == "cpu":
        assert not fallbacks
    else:
        assert set(fallbacks) <= {"aten._to_copy.default (on cpu)"}, fallbacks
    return [p for name, p in programs().items() if name not in before]


def test_static_cache_decode_replays_captured_programs():
    """Static KV cache with ``mode="reduce-overhead"``, 32 new tokens: the
    cache writes are kernels (no fallbacks), so prefill and decode programs
    are captured and replayed (the CPU stand-in here); the tokens equal
    eager's.  The cache is written where it is (``passes/in_place.py``):
    no kernel, library call or copy of a decode step moves as many bytes as
    a layer's cache, but the attention reading it."""
    compiled = _static_cache_generate("cpu")
    replayed = [
        p.executor for p in compiled if isinstance(p.executor, GraphExecutor) and p.executor.graph
    ]
    assert replayed, [p.cudagraphs for p in compiled]
    # The cache tensors keep their storage between calls, so they are read
    # in place: only the token ids and positions are copied into the graph.
    for executor in replayed:
        assert len(executor.copied) <= 3, executor.copied
    # Prefill creates the caches (outputs); decode programs write them.
    decode = [p for p in compiled if len(p.graph.mutations) > 2]
    assert decode, [p.graph.mutations for p in compiled]
    for program in decode:
        graph = program.graph
        caches = {
            graph.inputs[k] for k in graph.mutations.values() if graph.nodes[graph.inputs[k]].shape
        }
        assert len(caches) == 4  # keys and values of 2 layers (and a length counter each)
        # No copy back of a cache, nor of a length counter (a pointwise
        # kernel's new value, stored into the counter itself).
        assert set(graph.in_place.values()) == {graph.inputs[k] for k in graph.mutations.values()}
        assert "write_input" not in program.plan.source()
        cache_bytes = min(int(graph.nodes[c].nbytes) for c in caches)
        for step in program.launches():
            moved = step.kernel.bytes_read + step.kernel.bytes_written
            assert step.kernel.template == "attention" or moved < cache_bytes, step.kernel.name
        for step in program.plan.library_calls():
            assert not caches & set(step.node.inputs), step.node.name


def test_static_cache_decode_with_gemv_reduction_matches_eager():
    """The option ``gemv_reduction``: each decode step's products (one row;
    float32, under the interpreter taken as templates only when forced) are
    sum reductions, the mean square of every RMS norm before one is
    computed in the product's kernel (a row statistic), and the 32 tokens
    are eager's."""
    compiled = _static_cache_generate("cpu", matmul="triton", gemv_reduction=True)
    decode = [p for p in compiled if len(p.graph.mutations) > 2]
    assert decode
    for program in decode:
        graph = program.graph
        outcomes = {d.outcome for d in graph.decisions if d.stage == "matmul"}
        assert outcomes == {"reduction"}, outcomes
        # Reductions over fewer rows than their kernel's: the row statistics.
        # (each part of a kernel that combines several: ``passes/combine.py``).
        statistics = [
            n
            for group in graph.groups
            for part in group.parts or (group,)
            for n in part.nodes
            if graph.nodes[n].kind == "reduction" and graph.nodes[n].shape != part.shape
        ]
        # Two norms a layer and the final one, before the head.
        assert len(statistics) == 2 * _tiny_llama().config.num_hidden_layers + 1, statistics


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_each_generate_reads_its_new_static_cache_in_place(monkeypatch, device):
    """transformers makes a new static cache for every ``generate``: the
    decode program's graph, whose replays read the last cache in place, is
    captured again for the new one, still in place (not copied in and out
    at every step), where copying a cache for as many steps as a
    ``generate`` made costs more than a capture.  On the CPU priced with a
    device on which this tiny cache copies as slowly as a large one would
    (1 MB/s); on a GPU with its own figures, where copying this cache is
    the cheaper choice, only the tokens are checked.  Tokens equal eager's
    in every ``generate``."""
    import dataclasses

    from tilec.runtime import program as program_module
    from tilec.target import H100_SXM, Figure

    if device == "cpu":
        slow = dataclasses.replace(H100_SXM, memory_bandwidth=Figure(1e6, "assumed", "this test"))
        targets = type("SlowCopies", (), {"for_device": staticmethod(lambda d: slow)})
        monkeypatch.setattr(program_module, "Target", targets)
    model = _tiny_llama().to(device)
    settings = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
    prompts = [
        torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(seed)).to(device)
        for seed in range(3)
    ]
    before = set(programs())
    with torch.no_grad():
        expected = [model.generate(ids, **settings) for ids in prompts]
        model.forward = torch.compile(
            model.forward, backend="tilec", mode="reduce-overhead", fullgraph=True
        )
        for k, ids in enumerate(prompts):
            assert torch.equal(model.generate(ids, **settings), expected[k]), k
            if device == "cuda":
                continue
            (decode,) = (
                p
                for name, p in programs().items()
                if name not in before and len(p.graph.mutations) > 2
            )
            executor = decode.executor
            caches = set(decode.graph.mutations.values())
            assert not caches & set(executor.copied), (k, executor.copied)
            assert executor.captures == k + 1, k  # one capture per generate


@pytest.mark.gpu
def test_static_cache_decode_on_cuda_graphs_matches_eager():
    graphs = [getattr(p.executor, "graph", None) for p in _static_cache_generate("cuda")]
    assert any(isinstance(g, torch.cuda.CUDAGraph) for g in graphs)

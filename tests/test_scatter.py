"""Indexed stores (``index_put``, the scatter family) against eager torch.

Each case runs through tilec's kernels (the Triton interpreter on CPU) and
through the IR interpreter, must match eager, must not fall back to ATen, and
must have run the scatter's own kernel (``template == "scatter"``), so a
regression to a fallback or to another lowering fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import tilec
from benchmarks.zoo import MODELS
from tests.compare import assert_matches_eager, run_tilec
from tests.lowering import gpu_kernels, new_programs

aten = torch.ops.aten


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def randint(lo: int, hi: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=_gen(seed))


def distinct(size: int, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` distinct positions in ``range(size)``, some written as negative
    indices: a plain store with duplicates keeps an unspecified one."""
    pos = torch.randperm(size, generator=_gen(seed))[:count]
    return torch.where(torch.arange(count) % 2 == 1, pos - size, pos)


def scatter_kernels(before: set[str]) -> list:
    """The kernels launched for scatters: one per group storing a scatter
    node, alone or a part of a combined kernel (``passes/combine.py``)."""
    return [
        launch.kernel
        for program in new_programs(before)
        for launch in program.launches()
        for group in launch.kernel.group.parts or (launch.kernel.group,)
        if not group.init and any(program.graph.nodes[n].kind == "scatter" for n in group.stored)
    ]


def check(fn: Callable, *inputs: Any, updates: int = 1, **tolerances: Any) -> None:
    """``fn`` through tilec's kernels and the IR interpreter vs eager, with no
    fallback and ``updates`` scatter kernels in the kernel run."""
    for options in ({"interpret": True}, {}):
        torch._dynamo.reset()
        tilec.reset_stats()
        before = set(tilec.programs())
        assert_matches_eager(fn, *inputs, options=options, **tolerances)
        assert tilec.stats()["fallbacks"] == {}, tilec.stats()["fallbacks"]
    assert len(scatter_kernels(before)) == updates


def falls_back(fn: Callable, *inputs: Any) -> dict[str, int]:
    """The fallbacks of ``fn`` through tilec (whose result must still match eager)."""
    assert_matches_eager(fn, *inputs)
    return tilec.stats()["fallbacks"]


# ----------------------------------------------------------------- index_put


def test_index_put_one_index():
    x, v = randn(7, 4), randn(3, 4, seed=1)
    check(lambda x, i, v: aten.index_put(x, [i], v), x, distinct(7, 3), v)


def test_index_put_two_and_three_indices_broadcast_against_each_other():
    x = randn(4, 5, 6)
    a, b = distinct(4, 3, seed=1).view(3, 1), distinct(5, 2, seed=2)
    check(lambda x, a, b, v: aten.index_put(x, [a, b], v), x, a, b, randn(3, 2, 6, seed=3))
    c = distinct(6, 2, seed=4)
    check(lambda x, a, b, c, v: aten.index_put(x, [a, b, c], v), x, a, b, c, randn(3, 2, seed=5))


def test_index_put_slices_before_and_between_indices():
    x = randn(3, 4, 5, 6)
    i, j = distinct(4, 2, seed=1), distinct(6, 2, seed=2)
    # After a slice: the indexed dimension stays in place, updates [3, 2, 5, 6].
    check(lambda x, i, v: aten.index_put(x, [None, i], v), x, i, randn(3, 2, 5, 6, seed=3))
    # Not adjacent (a slice between): torch puts the broadcast dims first, [2, 3, 5].
    check(lambda x, i, j, v: aten.index_put(x, [None, i, None, j], v), x, i, j, randn(2, 3, 5))


def test_index_put_broadcasts_values():
    x, i = randn(6, 5), distinct(6, 3)
    check(lambda x, i, v: aten.index_put(x, [i], v), x, i, randn(5, seed=1))
    check(lambda x, i, v: aten.index_put(x, [None, i.remainder(5)], v), x, i, randn(1, seed=2))


def test_index_put_python_style_indexing_assignment():
    def fn(x, i, v):
        y = x.clone()
        y[:, i] = v
        return y

    check(fn, randn(4, 9), distinct(9, 4), randn(4, 4, seed=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16])
def test_index_put_accumulate_sums_duplicates(dtype):
    x = randn(5, 3).mul(10).to(dtype)
    i = torch.tensor([1, -4, 1, 0, 4, 1])  # 1 and -4 are the same row
    v = randn(6, 3, seed=1).mul(10).to(dtype)
    check(lambda x, i, v: aten.index_put(x, [i], v, True), x, i, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_index_put_half_precision_values(dtype):
    x, v = randn(8, 4, dtype=dtype), randn(3, 4, dtype=dtype, seed=1)
    check(lambda x, i, v: aten.index_put(x, [i], v), x, distinct(8, 3), v)


def test_index_put_duplicates_without_accumulate_store_one_of_them():
    x, i, v = randn(5), torch.tensor([2, 2, -3, 0]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    with torch.no_grad():
        out = run_tilec(lambda x, i, v: aten.index_put(x, [i], v), x, i, v)
    assert out[2].item() in (1.0, 2.0, 3.0)
    assert out[0].item() == 4.0
    assert torch.equal(out[[1, 3, 4]], x[[1, 3, 4]])


@pytest.mark.parametrize("position", [5, -6])
def test_out_of_range_positions_raise(position):
    """As in torch; tilec's kernels (and its IR interpreter) name the op
    (more cases in tests/test_bounds.py)."""
    x, i, v = randn(5), torch.tensor([1, position, 3]), torch.tensor([1.0, 2.0, 3.0])
    for options in ({"interpret": True}, {}):
        torch._dynamo.reset()
        with pytest.raises(IndexError, match="dimension 0 with size 5 in aten.index_put"):
            run_tilec(lambda x, i, v: aten.index_put(x, [i], v), x, i, v, options=options)


def test_boolean_mask_index_put_falls_back():
    x, m = randn(6), torch.tensor([True, False, True, False, False, True])
    fallbacks = falls_back(lambda x, m: aten.index_put(x, [m], torch.tensor(1.0)), x, m)
    assert sum(fallbacks.values()) >= 1


def test_bf16_accumulate_is_atomic_on_gpus_and_falls_back_in_the_interpreter():
    x, i, v = randn(5, dtype=torch.bfloat16), torch.tensor([1, 1]), randn(2, dtype=torch.bfloat16)
    fn = lambda x, i, v: aten.index_put(x, [i], v, True)  # noqa: E731
    assert falls_back(fn, x, i, v) == {"aten.index_put.default": 1}
    sources = [kernel.source for _, kernel in gpu_kernels(fn, x, i, v)]
    assert any("tl.atomic_add" in source for source in sources)


def test_generic_variant_of_symbolic_sizes():
    def fn(x, i, v):
        return aten.index_put(x, [i], v * 2, True).sin()

    compiled = torch.compile(fn, backend="tilec", dynamic=True, options={"max_specializations": 0})
    before = set(tilec.programs())
    for n in (5, 7, 9):
        x, i, v = randn(n, 4), randint(-n, n, n + 2, seed=n), randn(n + 2, 4, seed=1)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, i, v), fn(x, i, v))
    assert tilec.stats()["fallbacks"] == {} and tilec.stats()["graphs"] == 1
    assert len(scatter_kernels(before)) == 1


# ------------------------------------------------------------ scatter family


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_src(dim):
    x, src = randn(4, 6), randn(5, 7, seed=1)
    # A permutation along dim: distinct positions, so the result is defined.
    index = torch.stack([torch.randperm(6 if dim else 4, generator=_gen(k)) for k in range(3)])
    index = index[:, :3] if dim else index.t()[:3, :3]
    check(lambda x, i, s: torch.scatter(x, dim, i, s), x, index, src)


def test_scatter_value():
    x, index = randn(3, 5), torch.tensor([[0, 3], [2, 1], [4, 1]])
    check(lambda x, i: torch.scatter(x, 1, i, 2.5), x, index)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_add_sums_duplicates(dim):
    x, src = randn(4, 5), randn(7, 7, seed=1)
    # More updates than positions along dim: duplicates.
    shape, size = ((6, 5), 4) if dim == 0 else ((4, 6), 5)
    index = randint(0, size, *shape, seed=2)
    check(lambda x, i, s: torch.scatter_add(x, dim, i, s), x, index, src)


def test_scatter_add_int64():
    x, index, src = randint(-9, 9, 3, 4), randint(0, 3, 5, 4, seed=1), randint(-9, 9, 5, 4, seed=2)
    check(lambda x, i, s: torch.scatter_add(x, 0, i, s), x, index, src)


@pytest.mark.parametrize("reduce", ["sum", "amax", "amin"])
def test_scatter_reduce(reduce):
    x, index, src = randint(-9, 9, 3, 4), randint(0, 3, 5, 4, seed=1), randint(-9, 9, 5, 4, seed=2)
    check(lambda x, i, s: torch.scatter_reduce(x, 0, i, s, reduce), x, index, src)


@pytest.mark.parametrize(
    ("reduce", "dtype"), [("prod", torch.float32), ("amax", torch.float32), ("mean", torch.float32)]
)
def test_scatter_reduce_without_an_atomic_falls_back(reduce, dtype):
    x, index, src = randn(3, 4, dtype=dtype), randint(0, 3, 5, 4, seed=1), randn(5, 4, seed=2)
    fn = lambda x, i, s: torch.scatter_reduce(x, 0, i, s, reduce)  # noqa: E731
    assert falls_back(fn, x, index, src) == {"aten.scatter_reduce.two": 1}


# --------------------------------------------------------------- in context


def kernels_of(node: str) -> list:
    (program,) = [p for p in tilec.programs().values() if node in p.graph.nodes]
    return [launch.kernel for launch in program.launches()]


def test_pointwise_before_and_after_a_scatter():
    """The base computed by the init kernel, the values by the scatter's
    kernel; readers after it in kernels of their own."""

    def fn(x, i, v):
        return aten.index_put(x.exp(), [i], v * 2 + 1, True).sin()

    check(fn, randn(6, 8), torch.tensor([0, 3, 3, -1]), randn(4, 8, seed=1))
    init, update, after = kernels_of("index_put")
    assert init.group.init and init.group.nodes == ("exp",)
    assert update.template == "scatter" and len(update.group.nodes) == 3  # mul, add, scatter
    assert after.template == "pointwise" and not after.group.init


def test_a_base_read_elsewhere_is_copied():
    def fn(x, i, v):
        base = x.exp()
        return aten.index_put(base, [i], v), base * 3

    check(fn, randn(6, 8), distinct(6, 2), randn(2, 8, seed=1))
    kernels = kernels_of("index_put")
    (init,) = [k for k in kernels if k.group.init]
    assert init.group.nodes == () and len(kernels) == 3  # exp (and base * 3), copy, scatter


def test_static_kv_cache_update_mutates_the_input_like_eager():
    def step(cache, pos, k):
        aten.index_put_(cache, (None, None, pos), k)
        return (cache * 2).sum(-1)

    cache, k = randn(2, 3, 8, 4), randn(2, 3, 1, 4, seed=1)
    pos = torch.tensor([5])
    expected_cache = cache.clone()
    expected = step(expected_cache, pos, k)
    before = set(tilec.programs())
    compiled = torch.compile(step, backend="tilec", fullgraph=True)
    with torch.no_grad():
        out = compiled(cache, pos, k)
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(out, expected)
    assert tilec.stats()["fallbacks"] == {}
    (kernel,) = scatter_kernels(before)
    assert kernel.bytes_written == k.numel() * 4


def test_tiny_llama_static_cache_generate_has_no_fallbacks():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    # The zoo's tiny LLaMA (room for 64 positions: 6 + 8 here; test_generate
    # decodes 32 tokens under reduce-overhead).
    model = MODELS["llama"].build("tiny").model.model.eval()
    ids = torch.randint(0, 128, (1, 6), generator=_gen(0))
    kwargs = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    before = set(tilec.programs())
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        model.forward = torch.compile(model.forward, backend="tilec", fullgraph=True)
        tokens = model.generate(ids, **kwargs)
    assert torch.equal(tokens, expected)
    stats = tilec.stats()
    assert stats["fallbacks"] == {}
    # Prefill and decode: each writes keys and values of both layers natively.
    # In the prefill a layer's key and value writes share a kernel; in the
    # decode step attention does not wait for them (passes/attention_cache.py),
    # so both layers' writes share one.
    assert stats["graphs"] == 2
    writes = [
        sorted(
            len([n for n in group.stored if program.graph.nodes[n].kind == "scatter"])
            for launch in program.launches()
            for group in launch.kernel.group.parts or (launch.kernel.group,)
            if not group.init
        )
        for program in new_programs(before)
    ]
    assert sorted([w for w in counts if w] for counts in writes) == [[2, 2], [4]], writes

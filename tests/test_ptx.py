"""PTX tier: every kernel tilec generates compiles for sm_90, without a GPU.

The Triton interpreter accepts code the GPU compiler rejects, so the kernels
the interpreter tiers ran on the CPU are compiled here for an H100 target
(``triton.compile`` with ``GPUTarget("cuda", 90, 32)``: ttir, ttgir, llir,
PTX and, through the bundled ptxas, a cubin).

Kernels come from two places: every kernel the session generated before this
module ran (``tests/conftest.py`` sets ``$TILEC_RECORD_KERNELS`` for the
session and orders this module last; a background process compiles them as
they are recorded, ``tests/ptx_background.py``), and a corpus generated here
for a GPU target, which also covers the ops that only a GPU runs
(libdevice).  Kernels are deduplicated by source.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from benchmarks.sm90 import compile_kernel
from tests import ptx_background
from tests.lowering import gpu_kernels
from tests.ptx_background import digest
from tests.test_attention_sdpa import _padding_causal
from tilec.codegen.cache import write_source
from tilec.codegen.record import ENV, kernel_entry, sizes_in_memory_entry
from tilec.options import Options
from tilec.target import H100_SXM

# Below this many kernels, starting worker processes costs more than it saves.
PARALLEL_FROM = 40
# How long the tier waits for the tests in other xdist workers to finish,
# then for the background compiler to finish the kernel it is compiling.
OTHERS_WAIT_S = 2400
BACKGROUND_WAIT_S = 300


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b)


def _gelu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w1) @ w2


def _casts(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h, b = x.half(), x.bfloat16()
    # bfloat16 constants: made in float32 and cast (the interpreter has none).
    constants = torch.full_like(b, 0.1), torch.where(b > 0, b, -2.7)
    return (h * 2).float() + b.float(), (h + 1).sum(-1), (b * b).to(torch.bfloat16), *constants


def _gather(table: torch.Tensor, ids: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return F.embedding(ids, table), torch.gather(x, 1, ids), x.index_select(0, ids[0])


def _cat_pad(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cat([x, y.exp()], dim=1), (1, 2, 0, 1), value=0.5)


def _libdevice(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.asin(x.clamp(-1, 1)) + torch.atan2(x, y) + torch.acos(y.tanh()) + x.atan()


def _own_formulas(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.abs() ** y, torch.erfc(x), torch.atanh(x.clamp(-0.9, 0.9)), torch.tanh(y)


def _int_and_bool(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x > 0).any(-1), (i % 3 == 0).all(-1), torch.where(x > 0, i, -i).sum(-1), x.argmin(0)


def _shifts(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Shifts guard amounts out of range (undefined in LLVM): 8-bit and 64-bit."""
    return a << b, a >> b, u >> b.to(torch.uint8), a.long() << 40 >> b


def _scatters(
    cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    aten = torch.ops.aten
    counts = torch.zeros(4, 16, dtype=torch.int64)
    return (
        aten.index_put(cache, [None, None, pos], k),
        aten.index_put(cache.bfloat16(), [None, None, pos], k.bfloat16()),
        aten.index_put(cache[0, 0], [pos], k[0, 0], True),
        aten.index_put(cache[0, 0].half(), [pos], k[0, 0].half(), True),
        aten.index_put(cache[0, 0].bfloat16(), [pos], k[0, 0].bfloat16(), True),
        counts.scatter_add(0, index, index),
        counts.scatter_reduce(0, index, index * 3, "amax"),
        torch.zeros(4, 16).scatter(0, index, 1.5),
    )


def _size_scalars(x: torch.Tensor) -> torch.Tensor:
    """Floats computed from sizes, and a size computed with floats (an
    ``arange`` length): in the generic variant, float64 math on the size
    arguments inside the kernels."""
    labels = torch.arange(x.shape[0]) % x.shape[1]
    scaled = x * torch.full_like(x, x.shape[-1] ** -0.5)
    steps = torch.arange(0.5, x.shape[0] * 1.5, 0.75).sum()
    return scaled + F.cross_entropy(x, labels, label_smoothing=0.1) + steps


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# name -> (function, inputs): the programs that cover each kind of kernel.
CORPUS: dict[str, tuple[Callable, tuple[torch.Tensor, ...]]] = {
    "softmax": (lambda x: torch.softmax(x, -1), (_r(8, 100),)),
    "log_softmax_dim0": (lambda x: torch.log_softmax(x, 0), (_r(33, 7),)),
    "layer_norm": (_layer_norm, (_r(4, 6, 64), _r(64), _r(64))),
    "gelu_mlp": (_gelu_mlp, (_r(8, 32), _r(32, 64), _r(64, 16))),
    "argmax": (lambda x: (x.argmax(-1), x.max(-1).values), (_r(16, 40),)),
    "looped_reduction": (lambda x: (x - x.mean(-1, keepdim=True)).exp().sum(-1), (_r(3, 5000),)),
    "looped_argmax": (lambda x: x.argmax(-1), (_r(2, 9000),)),
    "casts": (_casts, (_r(4, 33),)),
    "gather": (
        _gather,
        (_r(50, 16), torch.randint(0, 16, (3, 16)), _r(16, 16)),
    ),
    "cat_pad": (_cat_pad, (_r(4, 5), _r(4, 3))),
    "libdevice": (_libdevice, (_r(64), _r(64))),
    "int_and_bool": (_int_and_bool, (_r(5, 9), torch.randint(-9, 9, (5, 9)))),
    "transpose_sum": (lambda x: x.t().contiguous().sum(0) + x.sum(1), (_r(48, 48),)),
    "scatter": (
        _scatters,
        (_r(2, 4, 16, 8), torch.tensor([3, -1]), _r(2, 4, 2, 8), torch.randint(0, 4, (6, 16))),
    ),
    "size_scalars": (_size_scalars, (_r(8, 10),)),
    # The prelude's own formulas: pow through float64, erfc's bit mask.
    "own_formulas": (_own_formulas, (_r(64), _r(64))),
    "shifts": (
        _shifts,
        (
            torch.randint(-9, 9, (64,), dtype=torch.int8),
            torch.randint(-9, 9, (64,), dtype=torch.int8),
            torch.randint(0, 255, (64,), dtype=torch.uint8),
        ),
    ),
}


def _gemm_bias_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w + b)


def _int8_linear(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x @ (w_q.to(x.dtype) * scale[:, None]).t()


# GEMM templates (codegen/gemm.py) for each operand dtype, at row counts that
# pick each tile configuration (small-M, up to 64 rows, larger), with an
# epilogue; and an int8 weight dequantized in the prologue.
GEMM_ROWS = (8, 48, 256)
for _dtype in (torch.float16, torch.bfloat16, torch.float32):
    for _rows in GEMM_ROWS:
        CORPUS[f"gemm_{_dtype}_{_rows}"] = (
            _gemm_bias_gelu,
            tuple(t.to(_dtype) for t in (_r(_rows, 256), _r(256, 256), _r(256))),
        )
    CORPUS[f"gemm_int8_weight_{_dtype}"] = (
        _int8_linear,
        (
            _r(8, 256).to(_dtype),
            torch.randint(-127, 128, (256, 256), dtype=torch.int8),
            _r(256).to(_dtype),
        ),
    )


def _prologue_gemm(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return torch.exp(-a.abs()) @ b.mT + r


def _abs_gemm(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return a.abs() @ b.mT + r


# fp32 GEMMs with a prologue, at sizes no multiple of 16 (scalar accesses):
# the 64 x 64 FMA tile at its register limit.  With 4 warps these spilled
# (40 and 8 bytes on triton 3.8; a random GEMM chain of test_gemm found it).
CORPUS["gemm_fp32_prologue_odd"] = (_prologue_gemm, (_r(40, 5), _r(33, 5), _r(40, 33)))
CORPUS["gemm_fp32_abs_odd"] = (_abs_gemm, (_r(40, 37), _r(40, 37), _r(40, 40)))

# pow in a GEMM's epilogue, computed in float64 (``_pow``): libdevice's
# float64 log2 and exp2 beside the accumulator.
CORPUS["gemm_pow_epilogue"] = (
    lambda x, w, b: (x @ w + b).abs() ** 1.7,
    tuple(t.bfloat16() for t in (_r(256, 256), _r(256, 256), _r(256))),
)


def _relative(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx).to(score.dtype) * 0.1


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _packed(b, h, q_idx, kv_idx):
    """Documents of 64 positions packed together: a mask no linear constraint
    captures, so kernels walk the block mask's lists."""
    return (q_idx // 64 == kv_idx // 64) & (q_idx >= kv_idx)


def _flex_causal_relative(m: int, n: int, mask_mod: Callable = _causal) -> Callable:
    """Causal attention (or ``mask_mod``'s) of ``m`` query rows against
    ``n`` positions with a relative-position score, GQA: the op called with
    its block mask's tensors as inputs (a BlockMask's real tensors cannot be
    traced in)."""
    parts = create_block_mask(mask_mod, None, None, m, n, "cpu").as_tuple()
    tensors = [k for k, part in enumerate(parts) if isinstance(part, torch.Tensor)]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *blocks: torch.Tensor):
        block_mask = list(parts)
        for position, block in zip(tensors, blocks):
            block_mask[position] = block
        scale = q.shape[-1] ** -0.5
        options = {"OUTPUT_LOGSUMEXP": False, "OUTPUT_MAX": False}
        return flex_attention_hop(q, k, v, _relative, tuple(block_mask), scale, options, (), ())[0]

    return fn, [parts[k] for k in tensors]


def _flex_training(
    m: int, n: int, mask_mod: Callable = _causal
) -> tuple[Callable, list[torch.Tensor]]:
    """The gradients of :func:`_flex_causal_relative`'s attention for an
    output gradient ``do``: its forward and the backward template's kernels."""
    forward, blocks = _flex_causal_relative(m, n, mask_mod)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *blocks):
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            return torch.autograd.grad(forward(q, k, v, *blocks), (q, k, v), do)

    return fn, blocks


def _flex_alibi(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor):
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx).to(score.dtype)

    return flex_attention(q, k, v, score_mod=alibi)


# Attention templates (codegen/attention.py) for each operand dtype, at head
# dimensions 64 and 128, a decode row (one query, long KV), GQA, and a score
# reading a buffer (ALiBi's slopes per head); the backward's
# (codegen/attention_grad.py) at both head dimensions, GQA, and with packed
# documents (both walking the block mask's lists).
for _dtype in (torch.float16, torch.bfloat16, torch.float32):
    for _m, _n, _e in ((256, 256, 64), (128, 128, 128), (1, 1024, 64)):
        _fn, _blocks = _flex_causal_relative(_m, _n)
        _qkv = (_r(1, 4, _m, _e), _r(1, 2, _n, _e), _r(1, 2, _n, _e))
        CORPUS[f"attention_{_dtype}_{_m}x{_n}x{_e}"] = (
            _fn,
            (*(t.to(_dtype) for t in _qkv), *_blocks),
        )
    for _m, _n, _e, _mask in ((256, 256, 64, _causal), (128, 128, 128, _causal),
                              (256, 256, 64, _packed)):  # fmt: skip
        _fn, _blocks = _flex_training(_m, _n, _mask)
        _qkv = (_r(1, 4, _m, _e), _r(1, 2, _n, _e), _r(1, 2, _n, _e), _r(1, 4, _m, _e))
        CORPUS[f"attention_backward_{_dtype}_{_m}x{_n}x{_e}_{_mask.__name__}"] = (
            _fn,
            (*(t.to(_dtype) for t in _qkv), *_blocks),
        )
    CORPUS[f"attention_alibi_{_dtype}"] = (
        _flex_alibi,
        (*(_r(2, 4, 100, 64).to(_dtype) for _ in range(3)), _r(4)),
    )

# Corpus programs also compiled as the generic variant is (sizes as i32 arguments).
GENERIC = ("softmax", "layer_norm", "looped_reduction", "cat_pad", "size_scalars")


# SDPA of the generic variant: symbolic query and key lengths (their symbols
# as i32 arguments), batch, heads and head dimension static, routed to the
# attention template at 1024 x 1024 hints (the GPU target keeps float32 in
# the library).
SYMBOLIC_LENGTHS: dict[str, tuple[Callable, tuple[torch.Tensor, ...], tuple]] = {
    f"sdpa_symbolic_lengths_{_dtype}": (
        _padding_causal,
        (
            *(_r(1, 16, 1024, 64).to(_dtype) for _ in range(3)),
            torch.ones(1, 1024, dtype=torch.long),
        ),
        ((2,), (2,), (2,), (1,)),
    )
    for _dtype in (torch.float16, torch.bfloat16)
}


# A decode row over a cache of symbolic length, as a program under CUDA
# graphs gets it (split over chunks of the keys, their number symbolic;
# without graphs the GPU target prices the library faster).
DECODE_SYMBOLIC_CACHE = (
    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    (_r(1, 32, 1, 64).bfloat16(), _r(1, 4, 2048, 64).bfloat16(), _r(1, 4, 2048, 64).bfloat16()),
    ((), (2,), (2,)),
)


def _corpus_entries() -> list[dict[str, Any]]:
    """Recorded-style entries for the corpus kernels."""
    entries = []
    programs = [(*CORPUS[name], False) for name in CORPUS]
    programs += [(*CORPUS[name], True) for name in GENERIC]
    for name, (fn, inputs, generic) in zip([*CORPUS, *GENERIC], programs):
        # Every GEMM configuration is compiled, whichever side ``auto`` would take.
        options = Options(matmul="triton") if name.startswith("gemm_") else None
        for graph, kernel in gpu_kernels(fn, *inputs, generic=generic, options=options):
            entries.append(kernel_entry(graph, kernel.group, kernel))
            if kernel.sizes:  # and as a graph captured for a size bucket launches it
                entries.append(sizes_in_memory_entry(entries[-1], kernel))
    symbolic = [(*case, None) for case in SYMBOLIC_LENGTHS.values()]
    symbolic.append((*DECODE_SYMBOLIC_CACHE, Options(cudagraphs=True)))
    for fn, inputs, dynamic, options in symbolic:
        kernels = gpu_kernels(fn, *inputs, generic=True, dynamic=dynamic, options=options)
        for graph, kernel in kernels:
            entries.append(kernel_entry(graph, kernel.group, kernel))
            if kernel.sizes:
                entries.append(sizes_in_memory_entry(entries[-1], kernel))
    return entries


def _recorded_entries() -> list[dict[str, Any]]:
    path = os.environ.get(ENV)
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _compile_all(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(entries) < PARALLEL_FROM:
        return [compile_kernel(e) for e in entries]
    # spawn, not fork: the parent has torch's thread pools running.
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        return list(pool.map(compile_kernel, entries, chunksize=4))


@pytest.fixture(scope="module")
def corpus() -> list[dict[str, Any]]:
    return _corpus_entries()


def _background_results(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """What the session's background compiler (``tests/ptx_background.py``)
    compiled, by source digest, stopped once every other test has finished
    (in any xdist worker)."""
    files = ptx_background.Files(Path(request.config.tilec_scratch))
    if not files.started:
        return {}
    # Under xdist, the tests of other workers may still be running.
    others = {item.nodeid for item in request.session.items if item.path != request.path}
    left = ptx_background.wait_finished(files, others, OTHERS_WAIT_S)
    if left:
        shown = ", ".join(sorted(left)[:5])
        pytest.fail(f"{len(left)} other tests had not finished after {OTHERS_WAIT_S} s: {shown}")
    problem = ptx_background.finish(files, BACKGROUND_WAIT_S)
    if problem:
        pytest.fail(problem)
    return ptx_background.read_results(files.results)


@pytest.fixture(scope="module")
def compiled(corpus, tmp_path_factory, request) -> list[dict[str, Any]]:
    """Every distinct kernel of the session and of the corpus, compiled for
    sm_90: by the background compiler as far as it got, the rest here."""
    unique: dict[str, dict[str, Any]] = {}
    for entry in [*_recorded_entries(), *corpus]:
        unique.setdefault(digest(entry["source"]), entry)
    done = _background_results(request)
    missing = [entry for key, entry in unique.items() if key not in done]
    # A fresh Triton cache: a cache hit would skip ptxas and its spill report.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
        here = _compile_all(missing)
    return [done[key] for key in unique if key in done] + here


def test_corpus_covers_gpu_only_ops(corpus):
    sources = "\n".join(e["source"] for e in corpus)
    for fn in ("libdevice.asin", "libdevice.acos", "libdevice.atan", "libdevice.atan2"):
        assert fn in sources, f"no corpus kernel calls {fn}"
    # Both reduction strategies and a pointwise kernel are in the corpus.
    assert "for roff in range" in sources
    assert "rbase = tl.arange" in sources
    # Indexed stores: plain and atomic.
    for atomic in ("tl.atomic_add", "tl.atomic_max"):
        assert atomic in sources, f"no corpus kernel calls {atomic}"


def test_corpus_covers_every_gemm_configuration(corpus):
    """Each tile configuration of the GEMM template, for each operand dtype."""
    configs = {
        (e["constexprs"]["BLOCK_M"], e["signature"]["in0"])
        for e in corpus
        if "BLOCK_K" in e["constexprs"]  # GEMMs (attention has BLOCK_M too)
    }
    for dtype in ("*fp16", "*bf16"):
        assert {m for m, d in configs if d == dtype} == {16, 64, 128}, (dtype, configs)
    assert {m for m, d in configs if d == "*fp32"} == {16, 64}, configs  # FMA: at most 64


def test_corpus_covers_attention_in_every_dtype(corpus):
    """One attention kernel per corpus program, for each operand dtype, and
    over symbolic lengths in the 16-bit types."""
    # (Not the variants that read their sizes from memory: they call these.)
    attention = [
        e for e in corpus if "row_max" in e["source"] and "size_values" not in e["signature"]
    ]
    dtypes = {e["signature"]["in0"] for e in attention}
    assert dtypes == {"*fp16", "*bf16", "*fp32"}, dtypes
    programs = sum(1 for name in CORPUS if name.startswith("attention_")) + len(SYMBOLIC_LENGTHS)
    assert len(attention) == programs + 1  # and the split decode row over a symbolic cache
    assert any("sp = pid % ((" in e["source"] for e in attention)  # a symbolic chunk count
    symbolic = [e for e in attention if "i32" in e["signature"].values()]
    assert {e["signature"]["in0"] for e in symbolic} == {"*fp16", "*bf16"}


def test_every_kernel_compiles_for_sm90(compiled):
    failed = [r for r in compiled if not r["ok"]]
    report = "\n\n".join(f"{r['name']} in {r['path']}:\n{r['error']}" for r in failed)
    assert not failed, f"{len(failed)} of {len(compiled)} kernels fail to compile:\n{report}"
    assert all(r["ptx"] > 0 for r in compiled)


def test_every_release_atomic_follows_a_barrier(compiled):
    """A kernel that publishes its stores with a release atomic (a split
    attention combined in its own kernel) has every thread's stores
    before it (``sm90.publishes_after_barrier``)."""
    unordered = [r["name"] for r in compiled if r.get("publishes_after_barrier") is False]
    assert not unordered, unordered


def test_every_kernel_fits_the_shared_memory_of_a_block(compiled):
    """No kernel asks for more shared memory than an sm_90 block may have
    (``Target.shared_memory_per_block``): ptxas accepts it, and the launch
    fails on the GPU.  A decode GEMV's pipelined K steps come nearest."""
    limit = H100_SXM.shared_memory_per_block
    over = [(r["name"], r["shared"]) for r in compiled if r.get("shared", 0) > limit]
    assert not over, over


# A spill ptxas chose with registers to spare, not one forced by them: at
# most this many bytes (spill stores and loads), by a kernel taking at most
# STACK_REGISTERS registers of the 255 a thread may have.  The float32
# attention backward (16 x 16 tiles, FMA dots) spilled 8 to 32 bytes at 56
# to 80 registers with every warp count tried (2, 4 or 8) on one triton or
# another (3.6, the GPU machine's, at the 8 it takes; 3.7 and 3.8 at 2 or
# 4).  What the test is for, a tile too large for the registers, spilled
# 0.8 to 7.8 KB at 255 (GEMM epilogues computing dropout or GELU's
# backward, before ``gemm.fit_epilogue``).
STACK_BYTES = 32
STACK_REGISTERS = 128


def forced_spill(result: dict[str, Any]) -> bool:
    """Whether a kernel compiled by ``sm90.compile_kernel`` spilled more
    than the few bytes ptxas keeps on the stack by choice (above)."""
    spilled = result.get("spill_bytes", 0)
    if not spilled:
        return False
    return spilled > STACK_BYTES or result.get("registers", 255) > STACK_REGISTERS


def test_a_spill_counts_unless_small_with_registers_to_spare():
    assert not forced_spill({"spill_bytes": 0, "registers": 255})
    assert not forced_spill({"spill_bytes": 16, "registers": 64})
    assert forced_spill({"spill_bytes": 48, "registers": 64})
    assert forced_spill({"spill_bytes": 16, "registers": 255})
    assert forced_spill({"spill_bytes": 16})  # registers unknown


def test_no_register_spills(compiled, corpus):
    """No kernel spills for want of registers (:func:`forced_spill`)."""
    reported = [r for r in compiled if "spill_bytes" in r]
    by_name = {e["name"]: e for e in [*_recorded_entries(), *corpus]}
    if not reported:
        pytest.skip("this Triton does not expose the ptxas log (no spill counts)")
    # With the source: the scratch folder holding the path is gone after the run.
    spilled = [
        f"{r['name']}: {r['spill_bytes']} bytes at {r.get('registers')} registers "
        f"({by_name[r['name']]['constexprs']}, {by_name[r['name']]['num_warps']} warps):\n"
        f"{by_name[r['name']]['source']}"
        for r in reported
        if forced_spill(r)
    ]
    assert not spilled, "register spills:\n" + "\n".join(spilled)


def test_generic_kernels_with_size_arguments_are_compiled_too(corpus, compiled):
    """Kernels of the generic variant (sizes as i32 arguments) are in the corpus,
    and so among those the tests above compile for sm_90."""
    generic = [e for e in corpus if "i32" in e["signature"].values()]
    assert len(generic) >= len(GENERIC)
    ok = {(r["name"], r["path"]) for r in compiled if r["ok"]}
    assert all((e["name"], str(write_source(e["source"]))) in ok for e in generic)


def test_generic_kernels_reading_sizes_from_memory_are_compiled_too(corpus, compiled):
    """The variant a graph captured for a size bucket launches (sizes loaded
    from an ``*i32`` argument) compiles for sm_90 for every generic kernel."""
    generic = [e for e in corpus if "i32" in e["signature"].values()]
    loaded = [e for e in corpus if e["signature"].get("size_values") == "*i32"]
    assert len(loaded) == len(generic) >= len(GENERIC)
    assert all("tl.load(size_values + " in e["source"] for e in loaded)
    ok = {(r["name"], r["path"]) for r in compiled if r["ok"]}
    assert all((e["name"], str(write_source(e["source"]))) in ok for e in loaded)


def test_bounds_checks_are_kept_on_the_gpu():
    """Kernels that check indices loaded from memory (``tl.device_assert``)
    keep the check in their PTX: compiled with ``launch.CHECKED``, as
    launched; without ``debug`` Triton would drop it.  (A check the compiler
    proves true, of an index computed in the kernel, may go.)"""
    kernels = [
        (graph, kernel)
        for name in ("gather", "scatter")
        for graph, kernel in gpu_kernels(CORPUS[name][0], *CORPUS[name][1])
        if "tl.device_assert" in kernel.source
    ]
    # Four checks or more, some in kernels combined into one launch.
    assert sum(kernel.source.count("tl.device_assert") for _, kernel in kernels) >= 4
    entries = [kernel_entry(graph, kernel.group, kernel) for graph, kernel in kernels]
    results = _compile_all(entries)
    dropped = [f"{r['name']} in {r['path']}" for r in results if not (r["ok"] and r["asserts"])]
    assert not dropped, "device asserts dropped:\n" + "\n".join(dropped)

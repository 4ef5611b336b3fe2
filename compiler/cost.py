"""The cost model: predicted seconds of kernels, GEMMs and launches on a Target.

One model, used by the compiler's choices (``passes/matmul.py``: a GEMM
template or the library) and by the reports (``benchmarks/static.py``,
``benchmarks/gpu_check.py``, which compares it with measurements), so the
compiler decides by the numbers the reports show.  Every figure comes from
the :class:`~tilec.target.Target` (each with its source and basis:
measured, datasheet or assumed); this module holds the rules alone:

* a kernel or library call takes the larger of its memory time (bytes read
  and written over the target's copy bandwidth) and its compute time, plus
  one launch (per kernel of a CUDA graph replay when ``replayed``);
* a GEMM computes at the library's FLOP/s for its operands' dtype, or at the
  template's (the library's times the stated template efficiency,
  ``target.TEMPLATE_EFFICIENCY``), divided by its *wave efficiency*: a GEMM
  of ``t`` output tiles runs in ``ceil(t / SMs)`` waves, and the last,
  partial wave leaves SMs idle (132 tiles fill an H100 once; 133 take two
  waves).  The template's tiles are the ones codegen launches
  (``compiler/gemm.py``).  The library is assumed to lose nothing to
  waves (:data:`LIBRARY_WAVES`): cuBLAS picks among many tile shapes and
  splits K to fill the GPU, and its figure is a measured average rate;
* a library call of fused attention computes at the target's attention
  rate (FlashAttention-2's published H100 figure), at most the GEMM rate;
* pointwise and reduction kernels compute at the fp32 rate without tensor
  cores, which in practice leaves them memory-bound;
* a template GEMM's K loop takes at least one memory round trip (the
  target's ``round_trip_s``, measured where every step waited) per
  ``num_stages - 1`` steps (:func:`k_loop_seconds`, :data:`ASYNC_STEPS`),
  or with tiles of at most 16 rows ``few_row_step_s`` per step (measured);
  the template's tiles run in waves (as many per SM as their shared
  memory allows), their loops one wave after another and their bytes at
  the share of the bandwidth each wave's programs reach: what bounds a
  GEMV whose programs each stream a thin slice; the library's GEMV (at
  most 16 FLOPs a byte) streams at the target's measured
  ``library_few_row_share`` of the bandwidth;
* a kernel of ``p`` programs (a Triton kernel's grid, a template's tiles)
  moves its bytes at no more than ``min(1, p / SMs)`` of the copy bandwidth
  (:func:`fill`, :data:`FILL`): a GEMV over 32 column tiles on 132 SMs
  streams its weight at a quarter of the bandwidth.  The library is assumed
  to fill the GPU, as for waves.

A target without figures (the Triton interpreter) has no cost model:
:func:`has_figures` says so, and the compiler's choices fall back to rules
that need no times.  Measured values replace a figure by replacing it in the
target (``dataclasses.replace``), not by changing these rules.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from tilec.target import Target

LIBRARY_WAVES = (
    "assumed: the library loses nothing to wave quantization (cuBLAS chooses among many tile "
    "shapes and splits K to fill the GPU; its FLOP/s figure is a measured average rate)"
)


class Work(NamedTuple):
    """What a library call (or the template replacing it) computes: FLOPs,
    bytes of its operands and result, and its operands' dtype."""

    flops: int
    nbytes: int
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one launch, with the parts they come from."""

    memory_s: float
    compute_s: float
    launch_s: float
    # The serial round trips of a template's K loop (:func:`k_loop_seconds`).
    latency_s: float = 0.0
    # A chained kernel's stages, one after another, and the waits between
    # them (:func:`chain`).
    stages_s: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s, self.latency_s) + self.stages_s + self.launch_s

    @property
    def bound(self) -> str:
        """What limits it: ``memory``, ``compute``, ``latency`` or ``launch``."""
        parts = {
            "memory": self.memory_s,
            "compute": self.compute_s,
            "latency": self.latency_s,
            "stages": self.stages_s,
            "launch": self.launch_s,
        }
        return max(parts, key=parts.__getitem__)


FILL = (
    "assumed: each program streams at most one SM's share of the copy bandwidth, so a grid "
    "of p < SMs programs reaches p / SMs of it (a lower bound: one SM alone can pull more "
    "than its share; not measured)"
)


def fill(programs: int | None, sm_count: int) -> float:
    """Share of the copy bandwidth a kernel of ``programs`` programs reaches
    (:data:`FILL`); 1 where the grid is unknown (None)."""
    if programs is None or programs <= 0:
        return 1.0
    return min(1.0, programs / sm_count)


def has_figures(target: Target) -> bool:
    """Whether the target has the figures this model needs (a GPU's)."""
    return target.memory_bandwidth is not None and target.launch_s is not None


def launch_seconds(target: Target, replayed: bool = False) -> float:
    """One launch: through the host's launch path, or in a CUDA graph replay."""
    figure = target.replay_s if replayed else target.launch_s
    if figure is None:
        raise ValueError(f"tilec: the {target.name} has no launch-cost figures")
    return figure.value


def chain(target: Target, stages: list[Prediction], replayed: bool = False) -> Prediction:
    """One launch of a chained kernel (``passes/chain.py``): its ``stages``
    (each predicted as a kernel of its own) one after another, each after
    the first waiting for the one before (the target's ``chain_wait_s``)."""
    if target.chain_wait_s is None:
        raise ValueError(f"tilec: the {target.name} has no figure for a chained kernel's wait")
    busy = sum(s.seconds - s.launch_s for s in stages)
    waits = (len(stages) - 1) * target.chain_wait_s.value
    return Prediction(0.0, 0.0, launch_seconds(target, replayed), stages_s=busy + waits)


def memory_seconds(target: Target, nbytes: float, programs: int | None = None) -> float:
    """Time to move ``nbytes`` (read plus written) at the target's copy
    bandwidth, by a grid of ``programs`` programs (:func:`fill`)."""
    if target.memory_bandwidth is None:
        raise ValueError(f"tilec: the {target.name} has no memory-bandwidth figure")
    return nbytes / target.memory_bandwidth.value / fill(programs, target.sm_count)


def kernel(
    target: Target,
    nbytes: float,
    flops: float = 0,
    replayed: bool = False,
    programs: int | None = None,
) -> Prediction:
    """A pointwise or reduction kernel moving ``nbytes`` and computing ``flops``
    (at the fp32 rate without tensor cores) over ``programs`` programs (None:
    a grid that fills the GPU)."""
    vector = dict(target.library_flops).get("fp32")
    compute = flops / vector.value if vector is not None and flops else 0.0
    memory = memory_seconds(target, nbytes, programs)
    return Prediction(memory, compute, launch_seconds(target, replayed))


ASYNC_STEPS = (
    "assumed for tiles of more than 16 rows: a K loop whose loads Triton copies "
    "asynchronously num_stages deep keeps num_stages - 1 steps in flight, so it waits one "
    "round trip per num_stages - 1 steps (fits the measured 128 x 128 tiles of 197 to 1024 x "
    "768 x 3072 and 1024 x 2048 x 5632 within 10 %); 16-row tiles were measured not to gain "
    "from it (few_row_step_s)"
)
# The most rows a tile may have for its K steps to take ``few_row_step_s``.
FEW_ROWS = 16


@dataclasses.dataclass(frozen=True)
class KLoop:
    """A GEMM template's K loop: ``steps`` steps of a ``rows``-row tile, its
    loads ``stages`` deep, ``resident`` programs of it on an SM at once (by
    their shared memory)."""

    steps: int
    stages: int
    rows: int
    resident: int = 1


KEY_STEPS = (
    "assumed: a step of the attention template's loop over key blocks (a dot with the "
    "block's keys, the softmax update, a dot with its values) takes what a GEMM template's K "
    "step of the same tile rows takes (k_loop_seconds): a decode step's 16-row tile pays "
    "few_row_step_s a step, measured on the GEMV's loop (one load and one dot a step), not "
    "on attention's"
)


def resident_programs(
    target: Target, shared_bytes: int, warps: int, registers: int | None = None
) -> int:
    """How many programs of a kernel share an SM at once, by the shared
    memory each takes, its threads and, where known, the ``registers``
    each thread takes (allocated per warp in the target's units); at
    least one."""
    by_registers = target.max_blocks_per_sm
    if registers is not None:
        unit = target.register_allocation_unit
        per_warp = math.ceil(max(registers, 1) * target.warp_size / unit) * unit
        by_registers = target.registers_per_sm // (per_warp * warps)
    return max(
        1,
        min(
            target.shared_memory_per_sm // max(1, shared_bytes),
            target.max_threads_per_sm // (warps * target.warp_size),
            target.max_blocks_per_sm,
            by_registers,
        ),
    )


def k_loop_seconds(target: Target, loop: KLoop) -> float:
    """The least time one program's K loop takes.  A tile of at most
    :data:`FEW_ROWS` rows takes the target's ``few_row_step_s`` per step,
    whatever its stages (measured: a decode GEMV's steps did not overlap).
    A larger one, its loads copied asynchronously ``stages`` deep
    (:data:`ASYNC_STEPS`), one memory round trip (``round_trip_s``) per
    ``stages - 1`` steps.  A GEMV's programs each stream a thin slice of
    the weight, so this, not the bandwidth, can bound it.  0 without the
    figures."""
    if target.round_trip_s is None or loop.steps <= 0:
        return 0.0
    if loop.rows <= FEW_ROWS and target.few_row_step_s is not None:
        return loop.steps * target.few_row_step_s.value
    return math.ceil(loop.steps / max(1, loop.stages - 1)) * target.round_trip_s.value


def attention(
    target: Target, flops: float, nbytes: float, dtype: torch.dtype, replayed: bool = False
) -> Prediction:
    """A library call of fused attention (torch's SDPA) computing ``flops``
    and moving ``nbytes``: at the target's attention rate, never above its
    library GEMM rate for ``dtype`` (fp32 attention has no tensor cores)."""
    if target.attention_flops is None:
        raise ValueError(f"tilec: the {target.name} has no attention FLOP/s figure")
    rate = min(target.attention_flops.value, target.peak_flops(dtype).value)
    return Prediction(
        memory_seconds(target, nbytes), flops / rate, launch_seconds(target, replayed)
    )


def attention_template(
    target: Target,
    flops: float,
    nbytes: float,
    dtype: torch.dtype,
    tiles: int,
    key_loop: KLoop | None = None,
) -> Prediction:
    """tilec's attention template computing ``flops`` (of the tiles it
    visits) and moving ``nbytes`` over ``tiles`` programs: at the target's
    measured template attention rate, never above its GEMM template rate
    for ``dtype``, over whole waves of programs.  Its programs' loops over
    key blocks (``key_loop``: the longest one's steps) take what a GEMM
    template's K loop of the same tile rows takes (:data:`KEY_STEPS`), once
    per wave of ``key_loop.resident`` programs an SM."""
    if target.attention_template_flops is None:
        raise ValueError(f"tilec: the {target.name} has no attention template FLOP/s figure")
    rate = min(target.attention_template_flops.value, target.peak_flops(dtype, True).value)
    compute = flops / rate / wave_efficiency(tiles, target.sm_count)
    memory = memory_seconds(target, nbytes, tiles)
    latency = 0.0
    if key_loop is not None:
        waves = math.ceil(tiles / (target.sm_count * key_loop.resident))
        latency = waves * k_loop_seconds(target, key_loop)
    return Prediction(memory, compute, launch_seconds(target), latency)


def wave_efficiency(tiles: int, sm_count: int) -> float:
    """Share of the SMs' time a grid of ``tiles`` tiles keeps busy: 1 when the
    tiles fill whole waves, less when the last wave is partial."""
    if tiles <= 0:
        return 1.0
    waves = math.ceil(tiles / sm_count)
    return tiles / (waves * sm_count)


def output_tiles(m: int, n: int, tile: tuple[int, int], batch: int = 1) -> int:
    """Output tiles of a ``batch`` of ``m x n`` products in ``tile``-sized tiles."""
    return batch * math.ceil(m / tile[0]) * math.ceil(n / tile[1])


def gemm(
    target: Target,
    flops: float,
    nbytes: float,
    dtype: torch.dtype,
    *,
    template: bool,
    tiles: int | None = None,
    replayed: bool = False,
    k_loop: KLoop | None = None,
    convolution: bool = False,
) -> Prediction:
    """A GEMM of ``dtype`` operands computing ``flops`` and moving ``nbytes``:
    by the library, or (``template``) by tilec's GEMM template, over ``tiles``
    output tiles (:func:`output_tiles`; None: no wave quantization, for calls
    whose tiling is unknown, such as a convolution) whose K loops are
    ``k_loop`` (:func:`k_loop_seconds`).  A template's tiles run in waves
    of ``resident`` per SM: its loops one wave after another, and its bytes
    at the share of the bandwidth its waves' programs reach (a wave of 44
    programs after one of 132 streams at a third of it: measured, 176
    16 x 64 tiles of a decode GEMV took 17 us for 46 MB on an H200).  The
    library's product of at most 16 FLOPs a byte (not a ``convolution``,
    which was not measured) streams at ``library_few_row_share``."""
    rate = target.peak_flops(dtype, template=template).value
    efficiency = 1.0 if tiles is None else wave_efficiency(tiles, target.sm_count)
    compute = flops / rate / efficiency
    if template and k_loop is not None and tiles is not None:
        waves = math.ceil(tiles / (target.sm_count * k_loop.resident))
        share = min(1.0, tiles / (waves * target.sm_count))
        memory = memory_seconds(target, nbytes) / share
        latency = waves * k_loop_seconds(target, k_loop)
    else:
        memory = memory_seconds(target, nbytes, tiles if template else None)
        latency = 0.0
    # At most about 16 rows of 16-bit operands.
    library_gemv = not (template or convolution) and flops <= FEW_ROWS * nbytes
    if library_gemv and target.library_few_row_share is not None:
        memory /= target.library_few_row_share.value
    return Prediction(memory, compute, launch_seconds(target, replayed), latency)

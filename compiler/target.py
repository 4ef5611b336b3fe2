"""The one model of the device kernels run on: :class:`Target`.

A ``Target`` is built once per compiled graph (``compiler/pipeline.py``,
:meth:`Target.for_device`) and handed to every pass and codegen step that
depends on the device; the static report builds a named one
(:meth:`Target.named`).  Nothing else in tilec asks torch about the device
or writes a hardware number: capabilities (what a kernel may use), limits
(shared memory, registers, SMs) and the figures of the performance model
(memory bandwidth, FLOP/s, launch costs) are fields here.

The target changes launch parameters (block sizes, warps), never the kernel
source, with two exceptions that change the source on every target alike:
the TF32 setting (the ``input_precision`` of an fp32 ``tl.dot``) and
``libdevice`` (ops that need it are lowered only where it exists).

Every figure of the performance model says where its number comes from: a
:class:`Figure` is ``measured`` (on the hardware), ``datasheet`` (the
vendor's specification) or ``assumed`` (a stated guess, to be replaced by a
measurement).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

KiB = 1024

Basis = Literal["measured", "datasheet", "assumed"]


@dataclasses.dataclass(frozen=True)
class Figure:
    """A number of the performance model and where it comes from."""

    value: float
    basis: Basis
    source: str

    def __str__(self) -> str:
        return f"{self.value:g} ({self.basis}: {self.source})"


# fp8 (e4m3) dots run on CUDA GPUs of this compute capability and newer (Ada, Hopper).
FP8_CAPABILITY = (8, 9)
# Programmatic dependent launch: compute capability 9.0 (Hopper) and newer
# (CUDA C++ Programming Guide, "Programmatic Dependent Launch and Synchronization").
PDL_CAPABILITY = (9, 0)

# Element types with an atomic add, max and min on sm_90, as (combine, dtype).
# Triton's float atomic max/min do not propagate NaN as torch does.
GPU_ATOMICS = frozenset(
    {("sum", dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)}
    | {
        (combine, dtype)
        for combine in ("sum", "max", "min")
        for dtype in (torch.int32, torch.int64)
    }
)
# The Triton interpreter has no bf16 atomic add.
INTERPRETER_ATOMICS = GPU_ATOMICS - {("sum", torch.bfloat16)}

# Shared memory (KiB) per SM and per block (the opt-in maximum), and resident
# blocks per SM, by compute capability: the CUDA C++ Programming Guide's
# technical specifications per compute capability.  For a device whose
# properties do not say.
SM_LIMITS: dict[tuple[int, int], tuple[int, int, int]] = {
    (7, 0): (96, 96, 32),
    (7, 5): (64, 64, 16),
    (8, 0): (164, 163, 32),
    (8, 6): (100, 99, 16),
    (8, 7): (164, 163, 16),
    (8, 9): (100, 99, 24),
    (9, 0): (228, 227, 32),
}
# Shared memory per block of a GPU that neither reports it nor is in the
# table: 64 KiB (AMD's LDS; ROCm's properties have no opt-in maximum).
UNREPORTED_SHARED_MEMORY = 64 * KiB

# What tilec's GEMM template reaches of the library's rate (same operands).
TEMPLATE_EFFICIENCY = 0.85
TEMPLATE_SOURCE = (
    "the library's figure x 0.85, from the project issue's statement that published H100 "
    "measurements of plain Triton matmuls reach 0.85-0.95 of cuBLAS on large bf16 shapes (the "
    "low end; assumed for fp16, tf32 and fp8 too).  Checked on an H200 for bf16: the bare "
    "template reached 0.80-0.85 of cuBLAS at 1024 x {3072, 5632, 32000} x {768, 2048}, and "
    "0.42-0.74 at smaller shapes (benchmarks/results/gpu/2026-11-26-nvidia-h200, gemms section)"
)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where kernels run: the Triton interpreter or a GPU, as one value.

    Built by :meth:`for_device`, :meth:`named` or :data:`INTERPRETER`; frozen
    and hashable (lowering tables are cached by target)."""

    name: str
    # Kernels run in the Triton interpreter (on CPU tensors), not on a GPU.
    interpret: bool
    # CUDA compute capability (major, minor); None: not a CUDA device.
    capability: tuple[int, int] | None

    # --- limits (of one SM, one block, one thread)
    sm_count: int
    warp_size: int
    shared_memory_per_sm: int  # bytes
    shared_memory_per_block: int  # bytes, the opt-in maximum a kernel may use
    registers_per_sm: int
    registers_per_thread: int  # the most one thread may use
    register_allocation_unit: int  # registers, allocated per warp in units of this
    max_threads_per_sm: int
    max_threads_per_block: int
    max_blocks_per_sm: int
    limits_source: str

    # --- launch heuristics (codegen/launch.py ``blocks``): the largest
    # pointwise block, looped reduction block (RBLOCK) and reduction tile
    # (XBLOCK x RBLOCK), in elements.  The interpreter pays per program, so
    # it gets large blocks; a GPU blocks sized for occupancy and 128-bit accesses.
    max_pointwise_block: int
    max_looped_rblock: int
    max_reduction_tile: int

    # --- capabilities
    bf16_dot: bool  # ``tl.dot`` on bf16 operands (the interpreter has none)
    libdevice: bool  # libdevice calls run (not in the interpreter)
    # fp32 ``tl.dot`` in TF32: torch's setting, read once, when the target is built.
    tf32: bool
    # (combine, dtype) pairs with an atomic, for scatters that combine.
    atomics: frozenset[tuple[str, torch.dtype]]
    # Programmatic dependent launch (CUDA, compute capability 9.0+): a
    # kernel launched with it may start before the one it follows ends
    # (``griddepcontrol`` in PTX; the option ``pdl``).
    programmatic_launch: bool = False

    # --- performance model; None / empty: no figures for this device
    memory_bandwidth: Figure | None = None  # bytes/s, read + written, as a copy gets
    memory_bandwidth_peak: Figure | None = None  # bytes/s, the specification
    library_flops: tuple[tuple[str, Figure], ...] = ()  # FLOP/s of the library's GEMMs
    template_flops: tuple[tuple[str, Figure], ...] = ()  # FLOP/s of tilec's GEMM template
    # FLOP/s of the library's fused attention (16-bit operands; never above
    # the library's GEMM rate for the operands' dtype).
    attention_flops: Figure | None = None
    # FLOP/s of tilec's attention template (16-bit operands; FLOPs of the tiles
    # it computes; never above its GEMM template rate for the operands' dtype).
    attention_template_flops: Figure | None = None
    launch_s: Figure | None = None  # seconds per kernel launch without CUDA graphs
    replay_s: Figure | None = None  # seconds per kernel in a CUDA graph replay
    # Seconds a chain's stage waits, inside one kernel, for the stage before
    # it to finish (``passes/chain.py``; ``cost.chain``).
    chain_wait_s: Figure | None = None
    # Seconds of one memory round trip of a GEMM template's K loop: a step
    # that waits for its own loads takes one (``cost.k_loop_seconds``).
    round_trip_s: Figure | None = None
    # Seconds of one K step of a few-row GEMM template tile (``BLOCK_M`` 16,
    # a decode GEMV's), however many steps its pipeline keeps in flight
    # (``cost.k_loop_seconds``).
    few_row_step_s: Figure | None = None
    # Share of the copy bandwidth the library's GEMM of a few rows (a decode
    # GEMV) reaches (``cost.gemm``).
    library_few_row_share: Figure | None = None

    @property
    def fp8_dot(self) -> bool:
        """Whether ``tl.dot`` takes float8 e4m3 operands (compute capability 8.9+)."""
        return self.capability is not None and self.capability >= FP8_CAPABILITY

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    def peak_flops(self, dtype: torch.dtype, template: bool = False) -> Figure:
        """FLOP/s of a GEMM of ``dtype`` operands, by the library or (``template``)
        by tilec's template.  fp32 operands multiply in TF32 where ``tf32`` is on."""
        kind = OPERAND_KINDS.get(dtype)
        if kind == "fp32" and self.tf32:
            kind = "tf32"
        figures = dict(self.template_flops if template else self.library_flops)
        if kind not in figures:
            side = "template" if template else "library"
            raise ValueError(f"tilec: no {side} FLOP/s figure for {dtype} GEMMs on {self.name}")
        return figures[kind]

    @classmethod
    def named(cls, name: str, *, tf32: bool = False) -> Target:
        """A known GPU by name (``"h100-sxm"``, ``"h200"``), with its figures,
        for predictions made without it; ``tf32``: torch's TF32 setting to
        assume (off by default, as in torch)."""
        if name not in KNOWN:
            raise ValueError(f"tilec: unknown target {name!r}; known: {', '.join(KNOWN)}")
        return dataclasses.replace(KNOWN[name], tf32=tf32)

    @classmethod
    def for_device(cls, device: torch.device) -> Target:
        """The target of kernels that run on ``device``: a CUDA GPU as its
        properties describe it (with the figures of a known model, matched by
        name), anything else the Triton interpreter.  Reads torch's TF32
        setting (``torch.backends.cuda.matmul``) now, once."""
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        if device.type != "cuda":
            return dataclasses.replace(INTERPRETER, tf32=tf32)
        return from_properties(torch.cuda.get_device_properties(device), tf32)


# Operand dtypes of the FLOP/s figures.
OPERAND_KINDS = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8",
}


# The template's fp32 rate (no TF32: Triton's FMA dot), measured: the median
# of the zoo's four fp32 template kernels timed alone on an H200, per full
# wave of their tiles (5.0, 5.0, 6.4 and 23 TFLOP/s; 64 x 64 x 16 tiles),
# a tenth of what 0.85 x the library's 67 TFLOP/s had assumed.
TEMPLATE_FP32 = Figure(
    5.7e12,
    "measured",
    "median of the zoo's fp32 GEMM template kernels (bert, t5 attention products, 64 x 64 x 16 "
    "tiles, Triton's FMA dot) timed alone on an H200, per full wave: 5.0-23 TFLOP/s "
    "(benchmarks/results/gpu/2026-11-26-nvidia-h200, kernels section); the H100's SMs are "
    "the same GH100 SMs",
)


def _template(library: dict[str, Figure]) -> tuple[tuple[str, Figure], ...]:
    """The template's figures: the library's times the stated efficiency,
    except where measured (fp32)."""
    return tuple(
        (
            kind,
            TEMPLATE_FP32
            if kind == "fp32"
            else Figure(f.value * TEMPLATE_EFFICIENCY, "assumed", TEMPLATE_SOURCE),
        )
        for kind, f in library.items()
    )


def _h100_library() -> dict[str, Figure]:
    bf16 = Figure(
        800e12,
        "measured",
        "large bf16 cuBLAS GEMM on an H100, about 800 TFLOP/s (project issue 12)",
    )
    return {
        "bf16": bf16,
        "fp16": Figure(
            800e12,
            "assumed",
            "bf16's measured cuBLAS rate: fp16 has the same tensor-core peak "
            "(989 TFLOP/s dense, NVIDIA H100 datasheet)",
        ),
        "tf32": Figure(
            494.7e12, "datasheet", "H100 SXM TF32 tensor-core peak, dense (NVIDIA H100 datasheet)"
        ),
        "fp32": Figure(
            67e12,
            "datasheet",
            "H100 SXM FP32 peak without tensor cores (NVIDIA datasheet): torch's default fp32 "
            "matmul does not use TF32",
        ),
        "fp8": Figure(
            1600e12,
            "assumed",
            "twice bf16's measured rate, as the datasheet's dense peaks are (1979 vs 989 TFLOP/s)",
        ),
    }


_H100_LIBRARY = _h100_library()

# Compute capability 9.0 (CUDA C++ Programming Guide), 132 SMs (H100 SXM5 and H200).
_SM90 = dict(
    capability=(9, 0),
    sm_count=132,
    warp_size=32,
    shared_memory_per_sm=228 * KiB,
    shared_memory_per_block=227 * KiB,
    registers_per_sm=65536,
    registers_per_thread=255,
    register_allocation_unit=256,
    max_threads_per_sm=2048,
    max_threads_per_block=1024,
    max_blocks_per_sm=32,
    programmatic_launch=True,
    limits_source=(
        "CUDA C++ Programming Guide, technical specifications of compute capability 9.0 "
        "(and its occupancy calculator's register allocation unit); 132 SMs: NVIDIA's H100 "
        "SXM5 / H200 specifications (the H100 PCIe card has 114)"
    ),
)
# Looped reductions take 2048-element chunks: with 8 warps, two 128-bit fp32
# loads per thread per iteration.  At 1024 (4 per thread) triton 3.8's ptxas
# (which declares the block size exactly, ``.reqntid``) capped a three-
# accumulator reduction at 32 registers and spilled; at 2048 it does not, and
# triton 3.7's neither (tests/test_ptx.py checks every kernel of the suite).
_GPU_BLOCKS = dict(max_pointwise_block=1024, max_looped_rblock=2048, max_reduction_tile=4096)
_LAUNCHES = dict(
    launch_s=Figure(
        2.5e-6,
        "assumed",
        "per kernel or library launch without CUDA graphs: a typical small-kernel launch "
        "cost, not a measurement",
    ),
    replay_s=Figure(
        0.66e-6,
        "measured",
        "per kernel of a CUDA graph replay, which skips the host's launch path: 0.66 us, "
        "32 launches against 2 replayed on an H100 SXM (benchmarks.gpu_check's launch "
        "section, benchmarks/results/gpu/2026-11-26-nvidia-h100)",
    ),
    chain_wait_s=Figure(
        0.66e-6,
        "assumed",
        "per stage of a chained kernel after its first (passes/chain.py): not measured, so "
        "priced as the replayed launch it replaces; benchmarks.gpu_check's launch section "
        "times chained kernels against replayed launches",
    ),
    round_trip_s=Figure(
        1.1e-6,
        "measured",
        "per K step of the GEMM template at M = 1 when every step waited for its activation "
        "loads (BLOCK_K 128: 2-byte loads, not copied asynchronously): the least-squares "
        "slope of its time against its K steps, 1.10 us on an H200 (8 shapes, 2-32 steps) "
        "and 1.28 us on an H100 (4 shapes, 4-32 steps), whatever the bytes and programs "
        "(benchmarks.gpu_check's gemms section, benchmarks/results/gpu/2026-11-26-*).  With "
        "the rule of cost.k_loop_seconds (3 stages: a round trip per 2 steps) it also gives "
        "the same runs' few-tile, long-K products: 26.4 us predicted against 26.9-28.0 "
        "measured for 197 and 512 x 768 x 3072, 17.6 against 19.6 for 512 x 512 x 2048",
    ),
    few_row_step_s=Figure(
        0.765e-6,
        "measured",
        "per K step of the GEMM template at M = 1 with 16-row tiles (BLOCK_K 256-512, 8 "
        "stages, every load copied asynchronously): the least-squares slope of its time "
        "against its K steps over the one-wave rows (32-128 programs, 1-11 steps; within "
        "0.32 us of each), on an H200 (benchmarks/results/gpu/2026-11-28-nvidia-h200, "
        "rerun/gemms); the same SMs and clocks are assumed for the H100.  The 7 steps the "
        "pipeline keeps in flight did not shorten it",
    ),
    library_few_row_share=Figure(
        0.62,
        "measured",
        "cuBLAS (F.linear and torch.mm) at M = 1 on an H200: the median share of the copy "
        "bandwidth of its 6 products of 8 MB or more (2.2-3.2 TB/s of 4.04), each timed alone "
        "less the 5.2 us of a lone launch (the template rows' intercept) "
        "(benchmarks/results/gpu/2026-11-28-nvidia-h200, rerun/gemms); the H100 run's one "
        "such row (4096 x 4096) reached 0.73 of its 3.0 TB/s",
    ),
)

H100_SXM = Target(
    name="H100 SXM",
    interpret=False,
    **_SM90,
    **_GPU_BLOCKS,
    bf16_dot=True,
    libdevice=True,
    tf32=False,
    atomics=GPU_ATOMICS,
    memory_bandwidth=Figure(
        3.0e12,
        "measured",
        "H100 SXM device-to-device copy, bytes read + written, about 3.0 TB/s (project issue "
        "12); the HBM3 peak is 3.35 TB/s",
    ),
    memory_bandwidth_peak=Figure(3.35e12, "datasheet", "H100 SXM HBM3 (NVIDIA H100 datasheet)"),
    library_flops=tuple(_H100_LIBRARY.items()),
    template_flops=_template(_H100_LIBRARY),
    attention_flops=Figure(
        3.5e14,
        "published",
        "FlashAttention-2 forward on an H100 SXM (bf16, head dim 128, long sequences), about "
        "350 TFLOP/s: the FA2 baseline of the FlashAttention-3 paper (Shah et al., 2024); "
        "torch's SDPA flash backend is FlashAttention-2",
    ),
    attention_template_flops=Figure(
        1.95e14,
        "measured",
        "median of tilec's attention template (causal, bf16, every tile computed) on an H100 "
        "SXM at 1-8 x 16 heads x 1024-8192 x 64-128, timed alone: 121-277 TFLOP/s "
        "(benchmarks/results/gpu/2026-11-26-nvidia-h100/attention)",
    ),
    **_LAUNCHES,
)

_H200_COMPUTE = "the H100 SXM's figure: the same GH100 chip and clocks; not measured on an H200"
_H200_RUN = "benchmarks/results/gpu/2026-11-26-nvidia-h200"
_H200_BF16 = Figure(
    742e12,
    "measured",
    f"bf16 cuBLAS GEMM of 8192^3 on an H200, random data, CUDA events, median ({_H200_RUN})",
)
_H200_LIBRARY = {
    kind: Figure(f.value, "assumed", f"{_H200_COMPUTE} ({f.source})")
    for kind, f in _H100_LIBRARY.items()
} | {
    "bf16": _H200_BF16,
    "fp16": Figure(_H200_BF16.value, "assumed", "bf16's measured rate: the same tensor-core peak"),
}
H200 = dataclasses.replace(
    H100_SXM,
    name="H200",
    memory_bandwidth=Figure(
        4.04e12,
        "measured",
        f"H200 device-to-device copy of 256 MiB, bytes read + written, CUDA events ({_H200_RUN})",
    ),
    memory_bandwidth_peak=Figure(4.8e12, "datasheet", "H200 SXM HBM3e (NVIDIA H200 datasheet)"),
    library_flops=tuple(_H200_LIBRARY.items()),
    template_flops=_template(_H200_LIBRARY),
    attention_flops=Figure(
        H100_SXM.attention_flops.value,
        "assumed",
        f"{_H200_COMPUTE} ({H100_SXM.attention_flops.source})",
    ),
    attention_template_flops=Figure(
        H100_SXM.attention_template_flops.value,
        "assumed",
        f"{_H200_COMPUTE} ({H100_SXM.attention_template_flops.source})",
    ),
)

KNOWN: dict[str, Target] = {"h100-sxm": H100_SXM, "h200": H200}

# The interpreter runs the kernels written for a GPU: it keeps the H100 SXM's
# limits, so that what is derived from them on a CPU (the autotune candidates
# the tests measure) is what that GPU gets; its capabilities are its own, and
# it has no performance figures (interpreter times say nothing about a GPU).
INTERPRETER = dataclasses.replace(
    H100_SXM,
    name="Triton interpreter",
    interpret=True,
    capability=None,
    limits_source="the H100 SXM's: " + H100_SXM.limits_source,
    max_pointwise_block=16384,
    max_looped_rblock=4096,
    max_reduction_tile=16384,
    bf16_dot=False,
    libdevice=False,
    atomics=INTERPRETER_ATOMICS,
    programmatic_launch=False,
    memory_bandwidth=None,
    memory_bandwidth_peak=None,
    library_flops=(),
    template_flops=(),
    attention_flops=None,
    attention_template_flops=None,
    launch_s=None,
    replay_s=None,
    chain_wait_s=None,
    round_trip_s=None,
    few_row_step_s=None,
    library_few_row_share=None,
)


# The fields of the performance model, which a known model lends a device.
FIGURES = (
    "memory_bandwidth",
    "memory_bandwidth_peak",
    "library_flops",
    "template_flops",
    "attention_flops",
    "attention_template_flops",
    "launch_s",
    "replay_s",
    "chain_wait_s",
    "round_trip_s",
    "few_row_step_s",
    "library_few_row_share",
)


def _known_model(name: str) -> Target | None:
    """The known model a CUDA device name is (``NVIDIA H100 80GB HBM3``: an
    H100 SXM; the PCIe and NVL cards differ in SMs, clocks and memory)."""
    if "H100" in name and ("HBM3" in name or "SXM" in name):
        return H100_SXM
    if "H200" in name and "NVL" not in name:
        return H200
    return None


def from_properties(props: Any, tf32: bool) -> Target:
    """A CUDA device's target from ``torch.cuda.get_device_properties``: its
    own limits where the properties have them (else the capability's table),
    a known model's performance figures where its name matches."""
    capability = (props.major, props.minor)
    per_sm, per_block, blocks = SM_LIMITS.get(capability, (None, None, 16))
    if torch.version.hip is not None:  # ROCm's capabilities are gfx numbers, not CUDA's
        per_sm, per_block, blocks = None, None, 16
    per_block = getattr(props, "shared_memory_per_block_optin", None) or (
        per_block * KiB if per_block else UNREPORTED_SHARED_MEMORY
    )
    per_sm = getattr(props, "shared_memory_per_multiprocessor", None) or (
        per_sm * KiB if per_sm else per_block
    )
    model = _known_model(props.name)
    figures = {} if model is None else {name: getattr(model, name) for name in FIGURES}
    return Target(
        name=props.name,
        interpret=False,
        capability=capability,
        sm_count=props.multi_processor_count,
        warp_size=getattr(props, "warp_size", 32),
        shared_memory_per_sm=per_sm,
        shared_memory_per_block=per_block,
        registers_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
        registers_per_thread=255,
        register_allocation_unit=256,
        max_threads_per_sm=props.max_threads_per_multi_processor,
        max_threads_per_block=getattr(props, "max_threads_per_block", 1024),
        max_blocks_per_sm=blocks,
        limits_source="torch.cuda.get_device_properties; per-thread registers, allocation "
        "unit and resident blocks from the CUDA C++ Programming Guide's tables",
        **_GPU_BLOCKS,
        bf16_dot=True,
        libdevice=True,
        tf32=tf32,
        atomics=GPU_ATOMICS,
        programmatic_launch=torch.version.hip is None and capability >= PDL_CAPABILITY,
        **figures,
    )

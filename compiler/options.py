"""Options of the tilec backend: ``torch.compile(..., options={...})``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from tilec.target import FP8_CAPABILITY, Target

LAYOUTS = ("auto", "channels_last", "eager")
SPECIALIZE = ("first", "hot")
MATMUL = ("auto", "triton", "library")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Modes that turn on ``autotune``, and those that turn on ``cudagraphs`` (as in Inductor).
AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPHS_MODES = ("reduce-overhead", "max-autotune")
QUANTIZE = ("int8_weight_only", "int4_weight_only", "fp8")
PARTITIONERS = ("min_cut", "save_all")
GROUP_SIZES = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class Options:
    """``dump``: directory for per-pass IR dumps, kernel sources and a summary
    (also ``TILEC_DUMP``).  ``fuse``: run the fusion pass (off: one kernel per
    op, useful to bisect a fusion bug).  ``interpret``: run the IR with the
    reference interpreter instead of generated kernels (debugging aid).
    ``freeze``: parameters and buffers become compile-time constants
    (inference; the weights must not change after compiling).  ``layout``:
    ``auto`` (tilec picks the strides of inner buffers), ``channels_last``
    (also on a CPU) or ``eager`` (keep eager's strides everywhere).
    ``max_specializations``: size-specialized variants compiled per graph with
    symbolic sizes; further shapes run one generic variant (0: every shape
    does; see :mod:`tilec.guards`).  ``specialize``: which new sizes get a
    variant: ``"hot"`` (the default: a size set seen ``hot_after`` times;
    before that it runs the generic variant) or ``"first"`` (each, until the
    table is full).
    ``cudagraphs``: capture each compiled inference program into a CUDA graph
    after one warm-up call and replay it (also ``mode="reduce-overhead"``
    and ``"max-autotune"``; on a CPU, the stand-in of :mod:`tilec.runtime.executors`).
    ``matmul``: ``"auto"`` (a matmul becomes a Triton GEMM template where
    fusing into it saves memory traffic, see :mod:`tilec.passes.matmul`),
    ``"triton"`` or ``"library"`` (force one side).
    ``autotune``: on a CUDA device, measure each GEMM template kernel's tile
    configurations and each matmul with nothing to fuse as template and as
    library call, and take the fastest, remembered on disk (also
    ``mode="max-autotune"`` and ``"max-autotune-no-cudagraphs"``; see
    :mod:`tilec.codegen.autotune`).

    ``quantize``: rewrite the weights of linear layers (library matmuls with
    constant weights, so it needs ``freeze=True``) to ``"int8_weight_only"``
    (per output channel), ``"int4_weight_only"`` (groups of
    ``quantize_group_size`` along the input dimension: 32, 64 or 128, default
    128) or ``"fp8"`` (CUDA GPUs of compute capability 8.9 or newer; checked
    when a graph is compiled, :func:`check_target`); see
    :mod:`tilec.passes.quantize`.  ``quantize_skip``: fnmatch patterns on
    parameter names (``"model.layers.0.mlp.down_proj.weight"``) of layers to
    leave in floating point.  ``quantize_head``: quantize the output head too
    (by default the last linear layers, after which the graph computes no
    other matmul, stay in floating point: the logits are the most sensitive).
    ``partitioner``: how a training graph's forward and backward split,
    ``"min_cut"`` (recompute cheap values in the backward instead of saving
    them; the default, as Inductor) or ``"save_all"``; see
    :mod:`tilec.partition`.
    ``direct_launch``: outside captured graphs, launch each kernel through
    Triton's JIT only for its first launch with new argument
    specializations, then through the compiled kernel's launcher (less host
    time per launch; see :mod:`tilec.runtime.launcher`).  Off by default
    until a GPU run of ``benchmarks.gpu_check`` has checked it.
    ``pdl``: launch tilec's kernels with programmatic dependent launch
    (CUDA GPUs of compute capability 9.0 or newer; elsewhere the option is
    ignored and the summary says so): a kernel may start while the one
    before it finishes, and waits for it before touching memory, so that
    a chain of small kernels (a decode step) loses less time between
    them.  Off by default until a GPU run of ``benchmarks.gpu_check`` has
    measured it; see :mod:`tilec.codegen.launch`.
    ``split_combine``: a decode-shaped attention split over chunks of its
    keys is combined inside its own kernel, by the last of a row tile's
    programs to finish (an atomic counter per row tile), instead of by a
    kernel of its own: one launch fewer per attention.  It relies on the
    GPU's memory ordering across programs; off by default until a GPU run
    of ``benchmarks.gpu_check`` has checked it; see
    :mod:`tilec.passes.attention_split`.
    ``gemv_reduction``: a product of one row (a GEMV: a batch-1 decode
    step's products) that the matmul pass takes as a template (or would,
    but for the target's missing bf16 dot: the interpreter's) is written
    as a plain sum reduction instead (a multiply and ``tl.sum`` per output
    element, over whole rows of the weight, as Inductor writes them), not
    as 16-row tensor-core tiles, whose K steps a GPU measured at 0.765 us
    each whatever their width.  Off by default until a GPU run of
    ``benchmarks.gpu_check`` has timed both; see :mod:`tilec.passes.matmul`.
    ``chain``: run consecutive kernels (not templates, static sizes) as the
    stages of one kernel, each stage's programs waiting inside the kernel
    for the programs of the stages before it (atomic counters), instead of
    one launch each: a decode layer's five kernels become two launches.  It
    relies on the GPU's memory ordering across programs and on a wait
    costing less than a launch; off by default until a GPU run of
    ``benchmarks.gpu_check`` has checked and timed it; see
    :mod:`tilec.passes.chain`.
    ``attention_chunks``: split a decode-shaped attention (static key
    length, one row tile per batch and head) into this many chunks of its
    keys, about (1: whole; whole key blocks a chunk), instead of the cost
    model's choice: what ``benchmarks.gpu_check`` sweeps to time a key
    block's step; see :mod:`tilec.passes.attention_split`."""

    dump: str | None = None
    fuse: bool = True
    interpret: bool = False
    freeze: bool = False
    layout: str = "auto"
    max_specializations: int = 64
    specialize: str = "hot"
    hot_after: int = 3
    cudagraphs: bool = False
    matmul: str = "auto"
    autotune: bool = False
    mode: str | None = None
    quantize: str | None = None
    quantize_group_size: int = 128
    quantize_skip: tuple[str, ...] = ()
    quantize_head: bool = False
    partitioner: str = "min_cut"
    direct_launch: bool = False
    pdl: bool = False
    split_combine: bool = False
    gemv_reduction: bool = False
    chain: bool = False
    attention_chunks: int | None = None

    def __post_init__(self) -> None:
        # The choices are checked here, wherever Options are built (from the
        # user's dict, or directly by benchmarks and tests): an unknown one
        # would act as the default.
        for name, allowed in (
            ("matmul", MATMUL),
            ("layout", LAYOUTS),
            ("specialize", SPECIALIZE),
            ("mode", MODES),
            ("partitioner", PARTITIONERS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"tilec: option {name!r} must be one of {allowed}, got {getattr(self, name)!r}"
                )

    @classmethod
    def from_user(cls, mode: str | None, options: Mapping[str, Any] | None) -> Options:
        if mode not in MODES:
            raise ValueError(f"tilec: unknown mode {mode!r}; expected one of {MODES[1:]}")
        if options is not None and not isinstance(options, Mapping):
            raise TypeError(
                f"tilec: options must be a dict of option names to values, e.g. "
                f"options={{'dump': 'dump'}}; got {type(options).__name__} {options!r}"
            )
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)} - {"mode"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"tilec: unknown option(s) {unknown}; known options: {sorted(known)}")
        flags = (
            "fuse",
            "interpret",
            "freeze",
            "cudagraphs",
            "autotune",
            "quantize_head",
            "direct_launch",
            "pdl",
            "split_combine",
            "gemv_reduction",
            "chain",
        )
        for flag in flags:
            if flag in options and not isinstance(options[flag], bool):
                raise TypeError(f"tilec: option {flag!r} must be a bool, got {options[flag]!r}")
        limit = options.get("max_specializations", 64)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(
                f"tilec: option 'max_specializations' must be an int >= 0, got {limit!r}"
            )
        chunks = options.get("attention_chunks")
        if chunks is not None and (
            not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1
        ):
            raise ValueError(
                f"tilec: option 'attention_chunks' must be an int >= 1 or None, got {chunks!r}"
            )
        specialize = options.get("specialize", "hot")
        hot_after = options.get("hot_after", 3)
        if not isinstance(hot_after, int) or isinstance(hot_after, bool) or hot_after < 1:
            raise ValueError(f"tilec: option 'hot_after' must be an int >= 1, got {hot_after!r}")
        layout = options.get("layout", "auto")
        matmul = options.get("matmul", "auto")
        dump = options.get("dump", os.environ.get("TILEC_DUMP") or None)
        if dump is not None and not isinstance(dump, (str, os.PathLike)):
            raise TypeError(f"tilec: option 'dump' must be a directory path, got {dump!r}")
        if dump is not None:
            dump = os.fspath(dump)
            source = "option 'dump'" if "dump" in options else "TILEC_DUMP (environment variable)"
            _check_dump(dump, source)
        _check_quantize(options)
        return cls(
            dump=dump,
            fuse=options.get("fuse", True),
            interpret=options.get("interpret", False),
            freeze=options.get("freeze", False),
            layout=layout,
            max_specializations=limit,
            specialize=specialize,
            hot_after=hot_after,
            cudagraphs=options.get("cudagraphs", mode in CUDAGRAPHS_MODES),
            matmul=matmul,
            autotune=options.get("autotune", mode in AUTOTUNE_MODES),
            mode=mode,
            quantize=options.get("quantize"),
            quantize_group_size=options.get("quantize_group_size", 128),
            quantize_skip=tuple(options.get("quantize_skip", ())),
            quantize_head=options.get("quantize_head", False),
            partitioner=options.get("partitioner", "min_cut"),
            direct_launch=options.get("direct_launch", False),
            pdl=options.get("pdl", False),
            split_combine=options.get("split_combine", False),
            gemv_reduction=options.get("gemv_reduction", False),
            chain=options.get("chain", False),
            attention_chunks=chunks,
        )


def _check_dump(path: str, source: str) -> None:
    """Refuse a dump folder tilec could not create or write to, naming the
    option, where it came from and why: otherwise the first dump file written,
    mid-compile, fails with a bare OSError."""
    full = os.path.abspath(path)
    existing = full
    while not os.path.exists(existing):  # false under a file, or under a folder we cannot read
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        kind = "a file" if os.path.isfile(existing) else "not a directory"
        why = f"is {kind}" if existing == full else f"is under {existing}, which is {kind}"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = (
            "is a directory tilec cannot write to"
            if existing == full
            else f"would be created in {existing}, a directory tilec cannot write to"
        )
    else:
        return
    raise ValueError(f"tilec: {source} is {path!r}, which {why}; dump needs a writable directory")


def _check_quantize(options: dict[str, Any]) -> None:
    scheme = options.get("quantize")
    if scheme is not None and scheme not in QUANTIZE:
        raise ValueError(
            f"tilec: option 'quantize' must be None or one of {QUANTIZE}, got {scheme!r}"
        )
    if scheme is not None and not options.get("freeze", False):
        raise ValueError(
            f"tilec: options={{'quantize': {scheme!r}}} needs options={{'freeze': True}} as "
            "well: only weights frozen into compile-time constants can be quantized"
        )
    group = options.get("quantize_group_size", 128)
    if group not in GROUP_SIZES or isinstance(group, bool):
        raise ValueError(
            f"tilec: option 'quantize_group_size' must be one of {GROUP_SIZES}, got {group!r}"
        )
    skip = options.get("quantize_skip", ())
    if not isinstance(skip, (list, tuple)) or not all(isinstance(p, str) for p in skip):
        raise TypeError(
            "tilec: option 'quantize_skip' must be a list of fnmatch patterns on parameter "
            f"names, e.g. ['lm_head.weight', '*.down_proj.weight']; got {skip!r}"
        )


def check_target(options: Options, target: Target) -> None:
    """Refuse options the target the graph runs on cannot honour (at compile
    time, when the device is known): fp8 quantization needs fp8 matmuls, on
    CUDA GPUs of compute capability 8.9 or newer; never the CPU interpreter."""
    if options.quantize != "fp8" or target.fp8_dot:
        return
    capability = target.capability
    found = "" if capability is None else f" (compute capability {capability[0]}.{capability[1]})"
    raise ValueError(
        "tilec: options={'quantize': 'fp8'} needs a CUDA GPU of compute capability "
        f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (float8 e4m3 matmuls: Ada, "
        f"Hopper); this graph runs on the {target.name}{found}"
    )

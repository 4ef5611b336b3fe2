"""Options of the tilec backend: ``torch.compile(..., options={...})``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

LAYOUTS = ("auto", "channels_last", "eager")
SPECIALIZE = ("first", "hot")
MATMUL = ("auto", "triton", "library")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Modes that turn on ``autotune``, and those that turn on ``cudagraphs`` (as in Inductor).
AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPHS_MODES = ("reduce-overhead", "max-autotune")


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
    :mod:`tilec.codegen.autotune`)."""

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
        for flag in ("fuse", "interpret", "freeze", "cudagraphs", "autotune"):
            if flag in options and not isinstance(options[flag], bool):
                raise TypeError(f"tilec: option {flag!r} must be a bool, got {options[flag]!r}")
        limit = options.get("max_specializations", 64)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(
                f"tilec: option 'max_specializations' must be an int >= 0, got {limit!r}"
            )
        specialize = options.get("specialize", "hot")
        if specialize not in SPECIALIZE:
            raise ValueError(
                f"tilec: option 'specialize' must be one of {SPECIALIZE}, got {specialize!r}"
            )
        hot_after = options.get("hot_after", 3)
        if not isinstance(hot_after, int) or isinstance(hot_after, bool) or hot_after < 1:
            raise ValueError(f"tilec: option 'hot_after' must be an int >= 1, got {hot_after!r}")
        layout = options.get("layout", "auto")
        if layout not in LAYOUTS:
            raise ValueError(f"tilec: option 'layout' must be one of {LAYOUTS}, got {layout!r}")
        matmul = options.get("matmul", "auto")
        if matmul not in MATMUL:
            raise ValueError(f"tilec: option 'matmul' must be one of {MATMUL}, got {matmul!r}")
        dump = options.get("dump", os.environ.get("TILEC_DUMP") or None)
        if dump is not None and not isinstance(dump, (str, os.PathLike)):
            raise TypeError(f"tilec: option 'dump' must be a directory path, got {dump!r}")
        return cls(
            dump=None if dump is None else os.fspath(dump),
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
        )

"""Direct kernel launch: Triton's compiled kernel launched without its JIT dispatch.

A launch through ``fn[grid](*args, **options)`` (Triton's ``JITFunction.run``)
binds the arguments, computes each one's specialization (a pointer's
alignment, an integer's type and whether it is 1 or a multiple of 16),
hashes them with the options into a cache key and looks the compiled kernel
up, every time: the first GPU run measured 13.8 us of host time per launch
of a tilec program (``benchmarks/results/gpu/2026-11-26-nvidia-h100``),
where the cost model assumes 2.5 us per launch.

:class:`DirectLaunch` makes the first launch of each specialization through
the JIT, which compiles and returns the :class:`CompiledKernel`; later
launches whose arguments have the same :func:`facts` call that kernel's
launcher (``CompiledKernel[grid](*args)``, the same on triton 3.6 to 3.8,
whose grid must have all three dimensions: it reads ``grid[2]``)
directly.  :func:`facts` is a superset of what Triton specializes on (the
tensor's dtype and 16-byte alignment; an integer's value class), so equal
facts mean the JIT would have picked the same kernel
(``tests/test_launcher.py`` checks this against Triton's own
specialization).  Anything else (new facts; a launch that returns no
compiled kernel, as the interpreter's) goes through the JIT, which stays
the fallback.

It is behind the option ``direct_launch`` (off by default) until a GPU run
of ``python -m benchmarks.gpu_check`` has checked it (its launch section
compares the results with the JIT's and times both); captured graphs do not
need it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# Triton's integer argument types, by range (its ``specialize_impl``).
_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)


def facts(args: Sequence[Any]) -> tuple:
    """What the compiled kernel for ``args`` depends on, per argument: a
    tensor's dtype, device and 16-byte alignment; an integer's type (by
    range), whether it is 1 and whether it is a multiple of 16; any other
    value itself."""
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.device, a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and not isinstance(a, bool):
            kind = 32 if _I32[0] <= a < _I32[1] else 64 if _I64[0] <= a < _I64[1] else 65
            out.append((kind, a == 1, a % 16 == 0))
        else:
            out.append((type(a), a))
    return tuple(out)


class DirectLaunch:
    """``fn``'s launch with fixed keyword ``options`` (constexprs, warps,
    stages, debug): ``launch[grid](*args)``, or ``launch(*args)`` when built
    with a fixed ``grid``.  ``device``: the current CUDA device's index
    (part of the JIT's key too), None on a CPU."""

    def __init__(
        self,
        fn: Any,
        options: dict[str, Any],
        grid: tuple[int, ...] | None = None,
        device: Callable[[], int] | None = None,
    ):
        self.fn, self.options, self.grid = fn, options, grid
        self.device = device or (lambda: -1)
        # facts -> the compiled kernel, or None where the JIT returned none.
        self.kernels: dict[tuple, Any] = {}
        # (facts, grid) -> the compiled kernel's launcher for that grid.
        self.runners: dict[tuple, Callable[..., Any]] = {}
        self.jit_calls = 0
        self.direct_calls = 0
        names = list(getattr(fn, "arg_names", ()))
        # The launcher takes every parameter, the constexprs included, in
        # order: the positional arguments, then these options.
        self._arity = len(names) - sum(1 for n in names if n in options)
        tail = names[self._arity :]
        # None: the parameters are not positional arguments followed by
        # options (or unknown): every launch goes through the JIT.
        self._constexprs: tuple | None = (
            tuple(options[n] for n in tail) if names and all(n in options for n in tail) else None
        )

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **options: Any) -> None:
            self._launch(tuple(grid), args)

        return launch

    def __call__(self, *args: Any) -> None:
        assert self.grid is not None, "a DirectLaunch without a grid is launched as launch[grid]"
        self._launch(self.grid, args)

    def _launch(self, grid: tuple[int, ...], args: tuple) -> None:
        key = (self.device(), facts(args))
        runner = self.runners.get((key, grid))
        if runner is not None:
            self.direct_calls += 1
            runner(*args, *self._constexprs)
            return
        if key in self.kernels:
            compiled = self.kernels[key]
            if compiled is not None:
                # The JIT pads a grid to three dimensions; the launcher does not.
                runner = self.runners[(key, grid)] = compiled[(*grid, 1, 1)[:3]]
                self.direct_calls += 1
                runner(*args, *self._constexprs)
                return
        self.jit_calls += 1
        compiled = self.fn[grid](*args, **self.options)
        direct = (
            self._constexprs is not None
            and len(args) == self._arity
            and callable(getattr(compiled, "__getitem__", None))
        )
        self.kernels[key] = compiled if direct else None


def launch_counts(namespace: dict[str, Any]) -> dict[str, int]:
    """Launches made directly and through the JIT by the direct launchers
    in a call function's ``namespace``."""
    launchers = [v for v in namespace.values() if isinstance(v, DirectLaunch)]
    return {
        "direct": sum(launch.direct_calls for launch in launchers),
        "jit": sum(launch.jit_calls for launch in launchers),
    }

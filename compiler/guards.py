"""Shape specialization: compiled variants of a symbolic graph, chosen by guards.

A graph with symbolic sizes (``dynamic=True``, or Dynamo's automatic dynamic
shapes) is compiled on first use for the sizes of that call: its kernels are
specialized on them (sizes and strides are literals in the index math, block
sizes and tilings are chosen for them).  Every value a variant was compiled
for is a :class:`Guard` (``s0 == 128``), listed in the variant's dump
(``guards.txt``) and summary.  A call binds the size symbols from its
arguments and runs the variant whose guards hold, looked up in a table keyed
by the guarded values; when none holds, the guards that failed are logged at
debug level (logger ``tilec.guards``) and a new variant is compiled.

The table is bounded (``max_specializations``): when it is full the least
recently used variant is dropped (logged at info level), so memory stays
bounded; a workload cycling through more distinct shapes than the bound
recompiles the shapes it evicted.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import sympy
import torch

log = logging.getLogger("tilec.guards")


@dataclasses.dataclass(frozen=True)
class Guard:
    """``symbol == value``: a size or stride the variant's code is specialized on."""

    symbol: str
    value: int

    def __str__(self) -> str:
        return f"{self.symbol} == {self.value}"


@dataclasses.dataclass
class Variant:
    guards: tuple[Guard, ...]
    program: Callable[..., Any]
    calls: int = 0


class Dispatcher:
    """Run a symbolic graph through the variant compiled for the call's sizes.

    ``compile_variant(values, guards, index)`` builds the program for one set
    of symbol values.
    """

    def __init__(
        self,
        name: str,
        placeholders: list[torch.fx.Node],
        compile_variant: Callable[[dict[sympy.Symbol, int], tuple[Guard, ...], int], Callable],
        max_variants: int,
    ):
        self.name = name
        self.placeholders = placeholders
        self.compile_variant = compile_variant
        self.max_variants = max_variants
        self.variants: collections.OrderedDict[tuple[Guard, ...], Variant] = (
            collections.OrderedDict()
        )
        self.compiled = 0

    def __call__(self, *args: Any) -> Any:
        values = bind_symbols(self.placeholders, args)
        guards = tuple(Guard(str(s), int(v)) for s, v in sorted(values.items(), key=str))
        variant = self.variants.get(guards)
        if variant is None:
            variant = self._specialize(values, guards)
        else:
            self.variants.move_to_end(guards)
        variant.calls += 1
        return variant.program(*args)

    def _specialize(self, values: dict[sympy.Symbol, int], guards: tuple[Guard, ...]) -> Variant:
        if log.isEnabledFor(logging.DEBUG):
            bound = {g.symbol: g.value for g in guards}
            for k, variant in enumerate(reversed(self.variants.values())):
                failed = [g for g in variant.guards if bound.get(g.symbol) != g.value]
                log.debug(
                    "%s: variant %d rejected: guard %s failed (%s = %s)",
                    self.name,
                    k,
                    failed[0],
                    failed[0].symbol,
                    bound.get(failed[0].symbol),
                )
        if len(self.variants) >= self.max_variants:
            evicted, old = self.variants.popitem(last=False)
            log.info(
                "%s: %d specializations kept; dropping the least recently used (%s, %d calls)",
                self.name,
                self.max_variants,
                ", ".join(map(str, evicted)),
                old.calls,
            )
        program = self.compile_variant(values, guards, self.compiled)
        self.compiled += 1
        variant = Variant(guards, program)
        self.variants[guards] = variant
        return variant


def bind_symbols(
    placeholders: list[torch.fx.Node], args: tuple[Any, ...]
) -> dict[sympy.Symbol, int]:
    """Values of the size symbols in this call, read off the actual arguments."""
    values: dict[sympy.Symbol, int] = {}
    for node, arg in zip(placeholders, args):
        val = node.meta.get("val")
        pairs: list[tuple[Any, Any]] = []
        if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
            pairs.append((val, arg))
        elif isinstance(val, torch.Tensor):
            pairs += zip(val.shape, arg.shape)
            pairs += zip(val.stride(), arg.stride())
        for sym, actual in pairs:
            if isinstance(sym, torch.SymInt | torch.SymFloat | torch.SymBool):
                expr = sym.node.expr
                if isinstance(expr, sympy.Symbol):
                    values[expr] = actual
    return values

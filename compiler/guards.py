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

The table is bounded (``max_specializations``), and a *policy* decides when
a call with new sizes gets a variant of its own (``specialize`` option):

- ``"hot"`` (:class:`HotSizes`, the default): a new size set runs the
  generic variant until it is hot (seen ``hot_after`` times among the last
  :data:`HOT_WINDOW` calls, and at least an eighth of them), and only then
  is specialized.  Serving (a few batch sizes that repeat) gets tuned
  programs; decode (a length that changes on every call) never compiles more
  than the generic one, however many sequences are generated.
- ``"first"`` (:class:`SpecializeFirst`): every new size set is specialized
  until the table is full.

A call the policy does not specialize runs the *generic* variant: the graph
compiled once with symbolic sizes (kernels take the sizes as arguments; see
:mod:`tilec.runtime.program`), whose guards are that every size symbol is at
least 2 (Dynamo specializes 0 and 1) and that element counts fit 32-bit
indexing.  So a shape that changes on every call costs at most
``max_specializations + 1`` compilations, never an eager fallback.  Only
when the generic variant cannot take the call (its guards fail, or it could
not be compiled: logged once at warning level) is the call specialized
anyway, dropping the least recently used specialization (logged at info
level) when the table is full.
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

# ``HotSizes`` looks at the size sets of this many most recent calls; a set
# is hot when it makes up at least 1/HOT_SHARE of them.
HOT_WINDOW = 64
HOT_SHARE = 8


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


class SpecializeFirst:
    """Specialize every new size set while the table has room."""

    def __init__(self, max_variants: int):
        self.max_variants = max_variants

    def specialize(self, seen: int, recent: int, table_size: int) -> bool:
        """Whether a call with sizes that have no variant gets one: the sizes
        were seen ``seen`` times in the ``recent`` most recent calls (this
        one included), and ``table_size`` variants are compiled."""
        return table_size < self.max_variants


class HotSizes(SpecializeFirst):
    """Specialize a size set once it is hot: seen at least ``hot_after``
    times among the last :data:`HOT_WINDOW` calls, and at least an eighth of
    them (:data:`HOT_SHARE`).  Until then (and once the table is full) it runs
    the generic variant.  A few sizes that keep coming back (serving) are hot;
    decode lengths, each one call in every generated sequence, never are,
    however often generation is repeated."""

    def __init__(self, max_variants: int, hot_after: int):
        super().__init__(max_variants)
        self.hot_after = hot_after

    def specialize(self, seen: int, recent: int, table_size: int) -> bool:
        hot = seen >= self.hot_after and seen * HOT_SHARE >= recent
        return hot and super().specialize(seen, recent, table_size)


def policy_for(name: str, max_variants: int, hot_after: int) -> SpecializeFirst:
    """The policy an ``Options.specialize`` name stands for."""
    return HotSizes(max_variants, hot_after) if name == "hot" else SpecializeFirst(max_variants)


class Dispatcher:
    """Run a symbolic graph through the variant compiled for the call's sizes.

    ``compile_variant(values, guards, index)`` builds the program for one set
    of symbol values; ``compile_generic(values)`` the generic program (called
    as ``program(*args, sizes=...)``, and asked ``program.accepts(sizes)``),
    tuned for the sizes ``values``.  ``policy`` decides which new sizes are
    specialized (:class:`SpecializeFirst`, :class:`HotSizes`).
    """

    def __init__(
        self,
        name: str,
        placeholders: list[torch.fx.Node],
        compile_variant: Callable[[dict[sympy.Symbol, int], tuple[Guard, ...], int], Callable],
        policy: SpecializeFirst,
        compile_generic: Callable[[dict[sympy.Symbol, int]], Any] | None = None,
    ):
        self.name = name
        self.placeholders = placeholders
        self.compile_variant = compile_variant
        self.compile_generic = compile_generic
        self.policy = policy
        self.variants: collections.OrderedDict[tuple[Guard, ...], Variant] = (
            collections.OrderedDict()
        )
        # The size sets of the most recent calls, and how often each occurs there.
        self.recent: collections.deque[tuple[Guard, ...]] = collections.deque()
        self.seen: collections.Counter[tuple[Guard, ...]] = collections.Counter()
        self.compiled = 0
        self.generic: Any = None

    def __call__(self, *args: Any) -> Any:
        values = bind_symbols(self.placeholders, args)
        guards = tuple(Guard(str(s), int(v)) for s, v in sorted(values.items(), key=str))
        seen = self._count(guards)
        variant = self.variants.get(guards)
        if variant is not None:
            self.variants.move_to_end(guards)
        else:
            self._log_misses(guards)
            if not self.policy.specialize(seen, len(self.recent), len(self.variants)):
                sizes = {g.symbol: g.value for g in guards}
                generic = self._generic(values)
                if generic is not None:
                    refused = generic.accepts(sizes)
                    if refused is None:
                        return generic(*args, sizes=sizes)
                    log.debug("%s: generic variant rejected: guard %s failed", self.name, refused)
            variant = self._specialize(values, guards)
        variant.calls += 1
        return variant.program(*args)

    def _count(self, guards: tuple[Guard, ...]) -> int:
        """Calls with these sizes among the most recent :data:`HOT_WINDOW`,
        this one included."""
        self.recent.append(guards)
        self.seen[guards] += 1
        if len(self.recent) > HOT_WINDOW:
            old = self.recent.popleft()
            self.seen[old] -= 1
            if not self.seen[old]:
                del self.seen[old]
        return self.seen[guards]

    def _generic(self, values: dict[sympy.Symbol, int]) -> Any:
        """The generic variant, compiled on first need; None if it cannot be."""
        if self.generic is None and self.compile_generic is not None:
            try:
                self.generic = self.compile_generic(values)
            except Exception as exc:  # noqa: BLE001 - any failure: keep specializing
                log.warning(
                    "%s: no generic variant for symbolic sizes (%s: %s); beyond %d "
                    "specializations, shapes evict and recompile",
                    self.name,
                    type(exc).__name__,
                    exc,
                    self.policy.max_variants,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                self.compile_generic = None
        return self.generic

    def _log_misses(self, guards: tuple[Guard, ...]) -> None:
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

    def _specialize(self, values: dict[sympy.Symbol, int], guards: tuple[Guard, ...]) -> Variant:
        # With max_variants 0 (generic only) one specialization is kept when
        # there is no generic variant.
        if self.variants and len(self.variants) >= self.policy.max_variants:
            evicted, old = self.variants.popitem(last=False)
            log.info(
                "%s: %d specializations kept; dropping the least recently used (%s, %d calls)",
                self.name,
                max(self.policy.max_variants, 1),
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
    """Values of the size symbols in this call, read off the actual
    arguments: scalars and sizes first, then strides for symbols nothing
    else gave, the stride of a dimension of at most one element last (a
    backward's input of shape (1, 1, s1) may carry stride s1 where the
    caller's tensor has 1: that stride says nothing of s1, and bound s1 to
    1 where the sizes said 3, so ``einsum``'s gradient ran a variant
    specialized for the wrong sizes)."""
    given: list[tuple[Any, Any]] = []
    strides: list[tuple[Any, Any, int]] = []
    for node, arg in zip(placeholders, args):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
            given.append((val, arg))
        elif isinstance(val, torch.Tensor):
            given += zip(val.shape, arg.shape)
            strides += zip(val.stride(), arg.stride(), arg.shape)
    values: dict[sympy.Symbol, int] = {}
    for sym, actual in given:
        symbol = _symbol_of(sym)
        if symbol is not None:
            values[symbol] = actual
    # Strides of dimensions of more elements first: only they say anything.
    # A symbol only a one-element dimension's stride carries indexes
    # nothing (any value will do there), so that stride is the last resort.
    for sym, actual, _ in sorted(strides, key=lambda t: t[2] <= 1):
        symbol = _symbol_of(sym)
        if symbol is not None and symbol not in values:
            values[symbol] = actual
    return values


def _symbol_of(value: Any) -> sympy.Symbol | None:
    """The symbol a symbolic scalar is, or None (a constant, an expression)."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        expr = value.node.expr
        if isinstance(expr, sympy.Symbol):
            return expr
    return None

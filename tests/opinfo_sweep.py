"""OpInfo sweep: torch's own op database through tilec, against eager.

    python tests/opinfo_sweep.py [--max-samples N] [--ops name,name,...] [--generic]
                                 [--dtype D] [--grad] [--inputs I] [-v]

For every op in ``op_db`` that supports float32 on CPU (less the random and
uninitialised-memory ops, whose results eager cannot reproduce) this decides
whether tilec lowers it *natively*: the op's first sample is traced to ATen
with tilec's decomposition table and every ATen op of that graph must have a
lowering rule in ``tilec.lower_ops.RULES`` that runs on this target (a static
check, cheap enough to run over all ~650 ops).  Native ops are then swept:
their float32 samples are compiled with ``backend="tilec"`` and each output is
compared with eager.  A sample whose compiled graph still recorded an ATen
fallback (a rule that refused its arguments, e.g. integer ``pow``) is still
compared, and makes the op not *fully* native.

The samples of one op are compiled together, ``BATCH`` to a graph (compiling
is the expensive part); when such a graph fails to compile or run, each of its
samples is retried alone so failures name their sample.

``--dtype`` sweeps another dtype's samples (the ops that support it on CPU).
Integer and bool outputs must equal eager's.  Half, bfloat16 and float64
ones are compared with torch's tolerances for their dtype; one outside them
still passes when tilec is as close to the op computed in float64 (on the
inputs upcast) as eager is (:func:`closer_than_eager`): fused kernels
round less often than eager, so tilec can differ from eager by more than
eager's own error while being no less exact.

``--grad`` compares gradients instead: the compiled forward's outputs,
weighted by fixed random tensors and summed, are differentiated with
respect to the sample's inputs that require grad (tilec's backward graph
runs), against eager's.

``--inputs reference`` sweeps OpInfo's reference inputs beyond the samples
(extremal values, broadcasting, empty tensors; the ops that define them)
and ``--inputs noncontiguous`` the samples with every tensor made
non-contiguous.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import logging
import operator
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

import tilec
from tilec.codegen.triton_ops import GPU_ONLY
from tilec.decompositions import decomposition_table
from tilec.lower_ops import BINARY_RULES, RULES, UNARY_RULES

ATOL = RTOL = 1e-4
# Samples compiled together in one graph: one compile serves many samples,
# but huge graphs compile slowly.
BATCH = 16

# Random or uninitialised-memory ops: eager cannot reproduce their values.
RANDOM_OR_UNINITIALISED = {
    "bernoulli",
    "cauchy",
    "empty",
    "empty_like",
    "empty_permuted",
    "empty_strided",
    "exponential",
    "geometric",
    "log_normal",
    "multinomial",
    "new_empty",
    "new_empty_strided",
    "nn.functional.alpha_dropout",
    "nn.functional.dropout",
    "nn.functional.dropout2d",
    "nn.functional.dropout3d",
    "nn.functional.feature_alpha_dropout",
    "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d",
    "nn.functional.rrelu",
    "normal",
    "pca_lowrank",
    "rand_like",
    "randint",
    "randint_like",
    "randn",
    "randn_like",
    "svd_lowrank",
    "uniform",
}


@dataclasses.dataclass
class OpResult:
    """What the sweep found for one OpInfo entry."""

    name: str
    native: bool
    unlowered: tuple[str, ...] = ()
    samples: int = 0
    passed: int = 0
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    # --generic: why graphs of this op got no generic variant.
    no_generic: list[str] = dataclasses.field(default_factory=list)

    @property
    def fully_native(self) -> bool:
        return self.native and not self.fallbacks


def op_name(op: Any) -> str:
    """``name`` or ``name.variant``, the id OpInfo tests use."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def float32_ops() -> list[Any]:
    """op_db entries that support float32 on CPU, random ones left out."""
    return ops_of(torch.float32)


def ops_of(dtype: torch.dtype) -> list[Any]:
    """op_db entries that support ``dtype`` on CPU, random ones left out."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [
        op
        for op in op_db
        if dtype in op.supported_dtypes("cpu") and op.name not in RANDOM_OR_UNINITIALISED
    ]


# What ``--inputs`` takes: OpInfo's samples; its reference inputs beyond
# the samples (extremal values, broadcasting, empty and large tensors,
# where the op defines them); or the samples with every tensor made
# non-contiguous (same values, strided storage).
INPUTS = ("samples", "reference", "noncontiguous")
_INPUT_NAMES = {
    "samples": "samples",
    "reference": "reference inputs",
    "noncontiguous": "non-contiguous samples",
}


def samples_of(
    op: Any,
    limit: int | None,
    dtype: torch.dtype = torch.float32,
    grad: bool = False,
    inputs: str = "samples",
) -> list[Any]:
    if inputs not in INPUTS:
        raise ValueError(f"inputs must be one of {INPUTS}, got {inputs!r}")
    with warnings.catch_warnings(), _no_test_case_search():
        warnings.simplefilter("ignore")
        made = op.sample_inputs("cpu", dtype, requires_grad=grad)
        if inputs == "reference":
            made = _beyond_samples(op, dtype, grad)
        samples = []
        for sample in made:
            if inputs == "noncontiguous":
                try:
                    sample = sample.noncontiguous()
                except RuntimeError:
                    continue  # a sparse tensor has no strided form
            samples.append(sample)
            if limit is not None and len(samples) >= limit:
                break
    return samples


def _beyond_samples(op: Any, dtype: torch.dtype, grad: bool) -> Iterator[Any]:
    """The reference inputs of ``op`` that are not its samples: OpInfo's
    reference input functions yield the op's samples first, then their own
    (none where the op defines no reference inputs)."""
    if op.reference_inputs_func is None:
        return iter(())
    skip = sum(1 for _ in op.sample_inputs("cpu", dtype, requires_grad=grad))
    return itertools.islice(op.reference_inputs("cpu", dtype, requires_grad=grad), skip, None)


@contextlib.contextmanager
def _no_test_case_search() -> Iterator[None]:
    """OpInfo's sample iterator looks for the ``unittest.TestCase`` running it
    (``extract_test_fn`` in torch's ``common_utils``: ``inspect.stack()``,
    which reads the source of every frame on the stack) to name its seed
    after the test.  The sweep runs in none, so the search always finds
    nothing, after about 18 ms under pytest (measured: 194 searches, 3.5 s
    of 97 OpInfo tests' 34 s).  Here it finds nothing at once; the samples
    are the same (seeded with torch's default test seed either way)."""
    from torch.testing._internal import common_utils

    if not hasattr(common_utils, "extract_test_fn"):
        yield
        return
    with mock.patch.object(common_utils, "extract_test_fn", lambda *args, **kwargs: None):
        yield


def as_function(op: Any, sample: Any) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """``op`` on ``sample`` as a function of the sample's tensors only.

    The call is written out as one Python expression (the tensors the
    function's arguments, every other leaf one of its constants), so that
    Dynamo traces the call alone: with the sample's containers rebuilt by
    pytree inside the function, Dynamo inlined pytree for every sample
    (``tests/test_opinfo.py`` took 170 s, 124 s without, 2026-12-03)."""
    tensors: list[torch.Tensor] = []
    constants: list[Any] = []
    parts = (sample.input, tuple(sample.args), dict(sample.kwargs))
    inp, args, kwargs = (_expression(part, tensors, constants) for part in parts)
    fn = eval(f"lambda *t: op({inp}, *{args}, **{kwargs})", {"op": op, "c": constants})
    return fn, tensors


def _expression(value: Any, tensors: list[torch.Tensor], constants: list[Any]) -> str:
    """Python source that makes ``value`` again from ``t`` (``tensors``, to
    which its tensors are appended) and ``c`` (``constants``, likewise)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return f"t[{len(tensors) - 1}]"
    if type(value) in (tuple, list):
        items = "".join(f"{_expression(v, tensors, constants)}, " for v in value)
        return f"({items})" if type(value) is tuple else f"[{items}]"
    if type(value) is dict and all(type(k) is str for k in value):
        items = "".join(f"{k!r}: {_expression(v, tensors, constants)}, " for k, v in value.items())
        return "{" + items + "}"
    if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)):
        raise TypeError(f"a sample's {type(value).__name__} holds tensors: not a constant")
    constants.append(value)
    return f"c[{len(constants) - 1}]"


def _cpu_rules() -> dict:
    """RULES less the ops whose kernels only a GPU can run (tilec falls back on CPU)."""
    table = {**UNARY_RULES, **BINARY_RULES}
    return {k: v for k, v in RULES.items() if table.get(k) not in GPU_ONLY}


def unlowered_ops(op: Any, sample: Any) -> tuple[str, ...] | None:
    """ATen ops of the sample's decomposed graph that have no lowering rule;
    None when the op cannot be traced to one ATen graph."""
    fn, tensors = as_function(op, sample)
    rules = _cpu_rules()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            # Functionalized, as AOTAutograd's graphs are: no in-place ops.
            gm = make_fx(
                torch.func.functionalize(fn, remove="mutations"),
                decomposition_table=decomposition_table(),
                tracing_mode="fake",
            )(*tensors)
    except Exception:
        return None
    missing = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if not isinstance(node.meta.get("val"), torch.Tensor | tuple | list):
            continue  # size arithmetic
        target = node.target
        if target not in rules and getattr(target, "overloadpacket", None) not in rules:
            missing.add(str(target))
    return tuple(sorted(missing))


# tilec's options beside the sweep's own: ``--chain`` sets {"chain": True};
# ``--cudagraphs`` sets {"cudagraphs": True} (the CPU stand-in for CUDA
# graphs), and every graph
# is then called GRAPH_CALLS times, so that a replay's results are compared.
OPTIONS: dict[str, Any] = {}
GRAPH_CALLS = 3


def _compile_and_run(
    fns: Sequence[Callable],
    inputs: Sequence[list[torch.Tensor]],
    generic: bool = False,
    grad: bool = False,
    backend: str = "tilec",
) -> list[Any]:
    """All ``fns`` in one compiled graph; returns each one's outputs, or
    with ``grad`` each one's :func:`gradients`.  Under ``--cudagraphs`` the
    graph is called :data:`GRAPH_CALLS` times on fresh copies of the inputs
    (the warm-up, the capture, a replay) and the last call's results kept.
    ``backend``: Dynamo's (``eager``: does a failure come before tilec?)."""

    def together(*flat: torch.Tensor) -> list[Any]:
        return [fn(*ins) for fn, ins in zip(fns, _per_fn(flat, inputs))]

    torch._dynamo.reset()
    options = dict(OPTIONS)
    if generic:
        options["max_specializations"] = 0
    if backend != "tilec":
        options = {}
    compiled = torch.compile(
        together, backend=backend, dynamic=True if generic else None, options=options or None
    )
    for _ in range(GRAPH_CALLS if OPTIONS.get("cudagraphs") else 1):
        flat = [_leaf(t) for ins in inputs for t in ins]
        with warnings.catch_warnings(), torch.set_grad_enabled(grad):
            warnings.simplefilter("ignore")
            outs = compiled(*flat)
            if grad:
                outs = [gradients(out, ins) for out, ins in zip(outs, _per_fn(flat, inputs))]
    return outs


def _per_fn(flat: Sequence[Any], inputs: Sequence[list[torch.Tensor]]) -> Iterator[Sequence[Any]]:
    """``flat`` cut into each function's inputs (``inputs``' lengths)."""
    k = 0
    for ins in inputs:
        yield flat[k : k + len(ins)]
        k += len(ins)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A copy of a sample's input, a leaf that requires grad as it does."""
    return t.detach().clone().requires_grad_(t.requires_grad)


def gradients(outputs: Any, inputs: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """The gradients, with respect to ``inputs`` that require grad, of the
    floating outputs that do, each weighted by a fixed random tensor and
    summed (None for an input no output depends on)."""
    outs = [
        o
        for o in pytree.tree_leaves(outputs)
        if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()
    ]
    wanted = [t for t in inputs if t.requires_grad]
    if not outs or not wanted:
        return ()
    weights = torch.Generator().manual_seed(0)
    loss = sum((o * torch.randn(o.shape, generator=weights).to(o.dtype)).sum() for o in outs)
    return torch.autograd.grad(loss, wanted, allow_unused=True)


def _error_line(err: Exception) -> str:
    """The line of a (possibly Dynamo-wrapped) exception that says what went wrong."""
    lines = [ln for ln in str(err).splitlines() if ln.strip() and "raised:" not in ln]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def compare(
    actual: Any,
    expected: Any,
    reference: Any = None,
    tolerance: tuple[float | None, float | None] = (ATOL, RTOL),
) -> str | None:
    """None when ``actual`` matches eager's ``expected`` within ``tolerance``
    (atol, rtol; None: torch's for the output's dtype); else why not.
    ``reference``: the op computed in float64 (half and bfloat16 samples),
    by which an output outside them may still pass
    (:func:`closer_than_eager`)."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if a_spec != e_spec:
        return f"output structure {a_spec} != {e_spec}"
    r_leaves = pytree.tree_leaves(reference) if reference is not None else [None] * len(e_leaves)
    for a, e, r in zip(a_leaves, e_leaves, r_leaves):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"expected a tensor, got {type(a).__name__}"
            if a.shape != e.shape or a.dtype != e.dtype:
                return f"{a.dtype}{list(a.shape)} != eager {e.dtype}{list(e.shape)}"
            try:
                torch.testing.assert_close(
                    a, e, atol=tolerance[0], rtol=tolerance[1], equal_nan=True
                )
            except AssertionError as err:
                if not closer_than_eager(a, e, r):
                    return " ".join(str(err).split("\n")[:3])
        elif a != e and not (a != a and e != e):
            return f"{a!r} != eager {e!r}"
    return None


# torch.testing's default (rtol, atol) for the half dtypes' outputs.
HALF_TOLERANCES = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def closer_than_eager(actual: torch.Tensor, expected: torch.Tensor, reference: Any) -> bool:
    """Whether tilec's ``actual`` is as exact as eager's ``expected``, judged
    by ``reference`` (the op in float64, same shape): where eager's output
    and the reference are finite, tilec's largest error is at most twice
    eager's (1e-6 absolute allowed); where eager overflowed (not finite)
    and the reference did not, tilec's output is eager's or the reference
    within the dtype's tolerances (eager in float16 overflows ``soft_margin_loss``'s
    ``exp`` where tilec, computing in float32, does not); where the
    reference is not finite, tilec's output is eager's (both NaN counts as
    equal)."""
    if not isinstance(reference, torch.Tensor) or not expected.is_floating_point():
        return False
    if reference.shape != expected.shape or not reference.is_floating_point():
        return False
    a, e, r = actual.double(), expected.double(), reference.double()
    finite = torch.isfinite(e) & torch.isfinite(r)
    overflowed = ~torch.isfinite(e) & torch.isfinite(r)
    outside = ~torch.isfinite(r)
    same = (a == e) | (a.isnan() & e.isnan())
    if not bool(same[outside].all()):
        return False
    rtol, atol = HALF_TOLERANCES.get(expected.dtype, (0.0, 0.0))
    near = torch.isclose(a, r, rtol=rtol, atol=atol)
    if not bool((same | near)[overflowed].all()):
        return False
    if not bool(finite.any()):
        return True
    tilec_error = (a - r).abs()[finite].max()
    eager_error = (e - r).abs()[finite].max()
    return bool(tilec_error <= 2 * eager_error + 1e-6)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def sweep_op(
    op: Any,
    max_samples: int | None,
    generic: bool = False,
    dtype: torch.dtype = torch.float32,
    grad: bool = False,
    inputs: str = "samples",
) -> OpResult:
    """Decide whether ``op`` is native and, if it is, check its ``dtype``
    samples (with ``grad``, their :func:`gradients`; ``inputs``: which
    samples, :data:`INPUTS`)."""
    name = op_name(op)
    try:
        samples = samples_of(op, max_samples, dtype, grad, inputs)
    except Exception as err:  # OpInfo's own generator (``where``'s with --grad)
        why = f"<OpInfo cannot make its {_INPUT_NAMES[inputs]}: {type(err).__name__}>"
        return OpResult(name, native=False, unlowered=(why,))
    if not samples:
        return OpResult(
            name, native=False, unlowered=(f"<no {_name(dtype)} {_INPUT_NAMES[inputs]}>",)
        )
    missing = unlowered_ops(op, samples[0])
    if missing is None or missing:
        return OpResult(name, native=False, unlowered=missing or ("<not traceable>",))
    result = OpResult(name, native=True)
    cases = []
    for k, sample in enumerate(samples):
        fn, ins = as_function(op, sample)
        try:
            expected = _eager(fn, ins, grad)
        except Exception:
            continue  # eager rejects it too: not a sample to compare
        cases.append((k, fn, ins, expected, _in_float64(fn, ins, dtype, grad)))
    result.samples = len(cases)
    tilec.reset_stats()
    runs = []
    missing = _Collect()
    logging.getLogger("tilec.guards").addHandler(missing)
    try:
        for start in range(0, len(cases), BATCH):
            runs += _run_batch(cases[start : start + BATCH], generic, grad)
    finally:
        logging.getLogger("tilec.guards").removeHandler(missing)
    result.no_generic = [m for m in missing.messages if "no generic variant" in m]
    result.fallbacks = tilec.stats()["fallbacks"]
    tolerance = (ATOL, RTOL) if dtype == torch.float32 else (None, None)
    for case, out, error in runs:
        k, _, _, expected, reference = case
        problem = error or compare(out, expected, reference, tolerance)
        if problem is not None and error is None:
            before = differs_before_tilec(case, generic, grad, tolerance)
            problem = f"{before}: {problem}" if before else problem
        if problem is None:
            result.passed += 1
        else:
            result.failures.append(f"sample {k}: {problem}")
    return result


# What ``--dtype`` takes.
SWEPT_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
)
# Dtypes whose samples are judged against the op computed in float64 too.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _eager(fn: Callable, ins: list[torch.Tensor], grad: bool) -> Any:
    """``fn``'s outputs on ``ins`` in eager, or with ``grad`` their :func:`gradients`."""
    leaves = [_leaf(t) for t in ins]
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")
        outputs = fn(*leaves)
        return gradients(outputs, leaves) if grad else outputs


def _in_float64(fn: Callable, ins: list[torch.Tensor], dtype: torch.dtype, grad: bool) -> Any:
    """:func:`_eager` with ``ins``' ``dtype`` tensors upcast to float64, for
    a half or bfloat16 sample (:func:`closer_than_eager`); else None, and
    None where the op does not take float64."""
    if dtype not in HALF_DTYPES:
        return None
    upcast = [
        t.detach().double().requires_grad_(t.requires_grad) if t.dtype == dtype else t for t in ins
    ]
    try:
        return _eager(fn, upcast, grad)
    except Exception:
        return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _run_batch(cases: list[tuple], generic: bool, grad: bool = False) -> list[tuple]:
    """(case, output, error) for each case, compiled together when that works."""
    try:
        outs = _compile_and_run([c[1] for c in cases], [c[2] for c in cases], generic, grad)
        return [(case, out, None) for case, out in zip(cases, outs)]
    except Exception:
        pass
    runs = []
    for case in cases:  # find which samples break it
        try:
            runs.append((case, _compile_and_run([case[1]], [case[2]], generic, grad)[0], None))
        except Exception as err:
            runs.append((case, None, _before_tilec(case, generic, grad) or _error_line(err)))
    return runs


def _before_tilec(case: tuple, generic: bool, grad: bool) -> str | None:
    """How the case fails with Dynamo's ``eager`` backend (tilec never
    sees the graph: Dynamo's own tracing fails); None if it runs there."""
    try:
        _compile_and_run([case[1]], [case[2]], generic, grad, backend="eager")
    except Exception as err:
        return f"fails before tilec (Dynamo, backend 'eager' too): {_error_line(err)}"
    return None


def differs_before_tilec(
    case: tuple, generic: bool, grad: bool, tolerance: tuple[float | None, float | None]
) -> str | None:
    """Where a case whose tilec output differs from eager's already differs
    before tilec: Dynamo's graph run as it is (backend ``eager``: Dynamo
    rewrites ``torch.addcdiv(a, b, c, value=v)`` as a division, a product
    and a sum, each in its operands' dtype, where eager computes in their
    common one), or after AOTAutograd's tracing (backend ``aot_eager``: its
    decompositions); None where both give eager's output (the difference
    is tilec's)."""
    _, fn, ins, expected, reference = case
    for backend, stage in (
        ("eager", "Dynamo, backend 'eager' too"),
        ("aot_eager", "AOTAutograd's tracing, backend 'aot_eager' too"),
    ):
        try:
            (out,) = _compile_and_run([fn], [ins], generic, grad, backend=backend)
        except Exception:
            return None
        if compare(out, expected, reference, tolerance) is not None:
            return f"differs before tilec ({stage})"
    return None


def report(
    results: list[OpResult],
    seconds: float,
    verbose: bool = False,
    dtype: torch.dtype = torch.float32,
    grad: bool = False,
    inputs: str = "samples",
) -> str:
    """The sweep's summary as text."""
    swept = [r for r in results if r.native]
    samples = sum(r.samples for r in swept)
    passed = sum(r.passed for r in swept)
    fully = [r for r in swept if r.fully_native]
    lines = [
        f"OpInfo sweep ({_name(dtype)}{', gradients' if grad else ''}"
        f"{', graph capture' if OPTIONS.get('cudagraphs') else ''}"
        f"{'' if inputs == 'samples' else ', ' + _INPUT_NAMES[inputs]}, CPU, "
        f"{_tolerance(dtype)}) in {seconds:.0f}s",
        f"ops in op_db supporting {_name(dtype)} (random/uninitialised left out): {len(results)}",
        f"ops swept (natively lowered by the static check): {len(swept)}",
        f"samples: {samples}  passed: {passed}  pass rate: {passed / max(samples, 1):.1%}",
        f"ops with every sample passing: {sum(1 for r in swept if r.passed == r.samples)}",
        f"native-lowering coverage: {len(fully)}/{len(results)} ops fully native "
        f"({len(fully) / max(len(results), 1):.1%})",
    ]
    no_generic = [r for r in swept if r.no_generic]
    if no_generic:
        lines.append(f"swept ops with graphs that got no generic variant: {len(no_generic)}")
        lines += [f"  {r.name}: {r.no_generic[0]}" for r in no_generic[: None if verbose else 10]]
    partial = [r for r in swept if r.fallbacks]
    if partial:
        lines.append("swept ops with fallbacks on some samples:")
        lines += [f"  {r.name}: {r.fallbacks}" for r in partial]
    failing = [r for r in swept if r.failures]
    if failing:
        lines.append("failing ops:")
        for r in failing:
            lines.append(f"  {r.name}: {len(r.failures)}/{r.samples} samples fail")
            lines += [f"    {f}" for f in r.failures[: None if verbose else 2]]
    if verbose:
        missing: dict[str, int] = {}
        for r in results:
            for m in r.unlowered:
                missing[m] = missing.get(m, 0) + 1
        lines.append("ATen ops that keep ops from being native (ops blocked):")
        lines += [f"  {m}: {n}" for m, n in sorted(missing.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def _tolerance(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return f"atol=rtol={ATOL}"
    if dtype in HALF_DTYPES:
        return "torch's tolerances, or as close to float64 as eager"
    return "torch's tolerances" if dtype.is_floating_point else "exact"


def _outcome(r: OpResult) -> str:
    """One op's result, for its progress line."""
    if not r.native:
        return f"not native: {', '.join(r.unlowered)}"[:200]
    text = f"native, {r.passed}/{r.samples} samples pass"
    return text + (f", fallbacks {r.fallbacks}" if r.fallbacks else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="check at most N samples per op (default: all of them)",
    )
    parser.add_argument(
        "--ops",
        default=None,
        help="comma-separated ops to sweep, by name ('add', every variant) or OpInfo id "
        "('name.variant'); unknown names are an error (default: every op that "
        "supports the dtype on CPU, less random and uninitialised-memory ops)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=[_name(d) for d in SWEPT_DTYPES],
        help="the samples' dtype (default float32); half and bfloat16 outputs outside "
        "torch's tolerances pass when as close to the op in float64 as eager's",
    )
    parser.add_argument(
        "--generic",
        action="store_true",
        help="compile with dynamic=True and max_specializations=0, so every sample runs "
        "the generic (symbolic-size) variant",
    )
    parser.add_argument(
        "--grad",
        action="store_true",
        help="compare gradients (of the outputs weighted by fixed random tensors) instead of "
        "outputs; ops that support autograd, floating dtypes",
    )
    parser.add_argument(
        "--inputs",
        default="samples",
        choices=INPUTS,
        help="OpInfo's samples (default), its reference inputs beyond the samples (extremal "
        "values, broadcasting, empty tensors), or the samples made non-contiguous",
    )
    parser.add_argument(
        "--cudagraphs",
        action="store_true",
        help=f"compile with graph capture (the CPU stand-in) and call each graph {GRAPH_CALLS} "
        "times on fresh copies of the inputs, comparing the last call (a replay)",
    )
    parser.add_argument(
        "--chain",
        action="store_true",
        help="compile with the option chain: a graph's consecutive kernels one launch "
        "(passes/chain.py)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="report every failing sample, every op without a generic variant, and the ATen "
        "ops that keep ops from being native",
    )
    args = parser.parse_args(argv)
    OPTIONS.clear()
    if args.cudagraphs:
        OPTIONS["cudagraphs"] = True
    if args.chain:
        OPTIONS["chain"] = True
    dtype = getattr(torch, args.dtype)
    if args.grad and not dtype.is_floating_point:
        parser.error(f"--grad: {args.dtype} has no gradients")
    ops = [op for op in ops_of(dtype) if op.supports_autograd or not args.grad]
    if args.ops:
        wanted = set(args.ops.split(","))
        unknown = wanted - {op_name(op) for op in ops} - {op.name for op in ops}
        if unknown:
            parser.error(
                f"--ops: unknown op name(s): {', '.join(sorted(unknown))} (the sweep knows the "
                f"OpInfo names and ids of ops that support {args.dtype} on CPU, less "
                "random and uninitialised-memory ops)"
            )
        ops = [op for op in ops if op_name(op) in wanted or op.name in wanted]
    # Progress on stderr, one line per op as it finishes; the report goes to stdout.
    start = time.perf_counter()
    results = []
    for k, op in enumerate(ops, 1):
        began = time.perf_counter()
        results.append(sweep_op(op, args.max_samples, args.generic, dtype, args.grad, args.inputs))
        now = time.perf_counter()
        print(
            f"[{k}/{len(ops)}] {results[-1].name}: {_outcome(results[-1])} "
            f"({now - began:.1f}s, {now - start:.0f}s in all)",
            file=sys.stderr,
            flush=True,
        )
    seconds = time.perf_counter() - start
    print(report(results, seconds, args.verbose, dtype, args.grad, args.inputs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

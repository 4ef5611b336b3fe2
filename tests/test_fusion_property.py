"""Property tier: random programs, fused and unfused, against eager torch.

Hypothesis builds small float32 programs from pointwise ops (unary, binary,
``where``, casts), broadcasting, reductions (sum/amax/mean over random dims,
with and without ``keepdim``) and views (reshape, permute, slice, expand,
unsqueeze).  Each program is compiled by tilec with fusion on and with
``options={"fuse": False}``, and each again with its kernels chained into
one launch (``options={"chain": True}``); all must match eager.

A program is generated as Python source text, so a failure prints as a
program to paste and run from the repository root.  Values are kept finite by
construction (``exp`` of a clamped value, ``log``/``sqrt``/division of
``abs() + 1``), and comparisons allow for NaN anyway.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from tests.compare import assert_close_tree, run_tilec

MAX_NUMEL = 256
MAX_RANK = 4
ATOL = RTOL = 1e-4
# Each example compiles twice and runs in the Triton interpreter (~1 s).
PROPERTY_EXAMPLES = 200

UNARY = [
    "torch.sin({0})",
    "torch.cos({0})",
    "torch.tanh({0})",
    "torch.sigmoid({0})",
    "torch.relu({0})",
    "-{0}",
    "{0}.abs()",
    "torch.exp({0}.clamp(-4, 4))",
    "torch.log({0}.abs() + 1)",
    "torch.sqrt({0}.abs() + 0.5)",
    "torch.rsqrt({0}.abs() + 1)",
    "torch.erf({0})",
    "F.gelu({0})",
    "F.silu({0})",
    "({0} * 0.5 + 1.25)",
]

BINARY = [
    "({0} + {1})",
    "({0} - {1})",
    "({0} * {1})",
    "({0} / ({1}.abs() + 1))",
    "torch.maximum({0}, {1})",
    "torch.minimum({0}, {1})",
    "torch.where({0} > 0, {0}, {1})",
    "torch.where({1} < {0}, {1} * 2, {0})",
]

# Round trips through other dtypes; every variable of a program is float32.
CASTS = [
    "{0}.half().float()",
    "{0}.bfloat16().float()",
    "{0}.double().float()",
    "{0}.to(torch.int32).float()",
    "({0} > 0.25).float()",
    "({0}.half() * 2).float()",
]

REDUCTIONS = ["sum", "amax", "mean"]


@dataclasses.dataclass
class Var:
    name: str
    shape: tuple[int, ...]


class ProgramBuilder:
    """Draws statements one at a time, tracking every variable's shape."""

    def __init__(self, draw: st.DrawFn, input_shapes: list[tuple[int, ...]]):
        self.draw = draw
        self.inputs = [Var(f"x{k}", s) for k, s in enumerate(input_shapes)]
        self.vars: list[Var] = list(self.inputs)
        self.lines: list[str] = []

    def pick(self, vars: list[Var] | None = None) -> Var:
        return self.draw(st.sampled_from(vars or self.vars))

    def emit(self, text: str, shape: tuple[int, ...]) -> Var:
        var = Var(f"v{len(self.lines)}", shape)
        self.lines.append(f"    {var.name} = {text}")
        self.vars.append(var)
        return var

    def step(self) -> None:
        kind = self.draw(
            st.sampled_from(
                ["unary", "binary", "binary", "cast", "reduce", "reduce", "view", "view"]
            )
        )
        getattr(self, kind)()

    def unary(self) -> None:
        v = self.pick()
        self.emit(self.draw(st.sampled_from(UNARY)).format(v.name), v.shape)

    def binary(self) -> None:
        a = self.pick()
        partners = [b for b in self.vars if _broadcast(a.shape, b.shape) is not None]
        b = self.pick(partners)
        shape = _broadcast(a.shape, b.shape)
        if math.prod(shape) > MAX_NUMEL or len(shape) > MAX_RANK:
            return self.unary()
        a, b = self.draw(st.permutations([a, b]))
        self.emit(self.draw(st.sampled_from(BINARY)).format(a.name, b.name), shape)

    def cast(self) -> None:
        v = self.pick()
        self.emit(self.draw(st.sampled_from(CASTS)).format(v.name), v.shape)

    def reduce(self) -> None:
        candidates = [v for v in self.vars if v.shape]
        if not candidates:
            return self.unary()
        v = self.pick(candidates)
        rank = len(v.shape)
        dims = self.draw(
            st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True).map(sorted)
        )
        keepdim = self.draw(st.booleans())
        op = self.draw(st.sampled_from(REDUCTIONS))
        shape = tuple(
            1 if d in dims else s for d, s in enumerate(v.shape) if keepdim or d not in dims
        )
        self.emit(f"{v.name}.{op}(dim={tuple(dims)}, keepdim={keepdim})", shape)

    def view(self) -> None:
        v = self.pick()
        options = ["unsqueeze", "reshape"]
        if len(v.shape) >= 2:
            options.append("permute")
        if any(s >= 2 for s in v.shape):
            options.append("slice")
        if 1 in v.shape:
            options.append("expand")
        getattr(self, "view_" + self.draw(st.sampled_from(options)))(v)

    def view_unsqueeze(self, v: Var) -> None:
        if len(v.shape) >= MAX_RANK:
            return self.view_reshape(v)
        d = self.draw(st.integers(0, len(v.shape)))
        self.emit(f"{v.name}.unsqueeze({d})", v.shape[:d] + (1,) + v.shape[d:])

    def view_reshape(self, v: Var) -> None:
        shapes = _reshapes(v.shape)
        shape = self.draw(st.sampled_from(shapes))
        self.emit(f"{v.name}.reshape({shape})", shape)

    def view_permute(self, v: Var) -> None:
        perm = tuple(self.draw(st.permutations(range(len(v.shape)))))
        self.emit(f"{v.name}.permute{perm}", tuple(v.shape[d] for d in perm))

    def view_slice(self, v: Var) -> None:
        d = self.draw(st.sampled_from([k for k, s in enumerate(v.shape) if s >= 2]))
        size = v.shape[d]
        start = self.draw(st.integers(0, size - 1))
        stop = self.draw(st.integers(start + 1, size))
        step = self.draw(st.integers(1, 2))
        index = ", ".join([":"] * d + [f"{start}:{stop}:{step}"])
        self.emit(
            f"{v.name}[{index}]", v.shape[:d] + (len(range(start, stop, step)),) + v.shape[d + 1 :]
        )

    def view_expand(self, v: Var) -> None:
        shape = tuple(self.draw(st.integers(1, 4)) if s == 1 else s for s in v.shape)
        if math.prod(shape) > MAX_NUMEL:
            return self.view_reshape(v)
        self.emit(f"{v.name}.expand{shape}", shape)


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def _reshapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes with the same elements: flattened, two neighbours merged, one dim split."""
    out = [(math.prod(shape),)]
    for d in range(len(shape) - 1):
        out.append(shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2 :])
    if len(shape) < MAX_RANK:
        for d, size in enumerate(shape):
            for f in range(2, size):
                if size % f == 0:
                    out.append(shape[:d] + (f, size // f) + shape[d + 1 :])
    return out


@dataclasses.dataclass
class Program:
    source: str
    input_shapes: list[tuple[int, ...]]
    seed: int

    def text(self) -> str:
        """A standalone program: the function, its inputs, and the comparison."""
        inputs = ", ".join(f"torch.randn({s!r})" for s in self.input_shapes)
        return (
            "import torch\nimport torch.nn.functional as F\n\n"
            "from tests.compare import assert_matches_eager\n\n\n"
            f"{self.source}\n\n"
            f"torch.manual_seed({self.seed})\n"
            f"inputs = [{inputs}]\n"
            "assert_matches_eager(program, *inputs, atol=1e-4, rtol=1e-4)\n"
            'assert_matches_eager(program, *inputs, options={"fuse": False}, atol=1e-4, rtol=1e-4)\n'
        )

    def build(self):
        namespace: dict = {"torch": torch, "F": F}
        exec(compile(self.source, "<tilec property program>", "exec"), namespace)
        fn = namespace["program"]
        torch.manual_seed(self.seed)
        return fn, [torch.randn(s) for s in self.input_shapes]


@st.composite
def programs(draw: st.DrawFn) -> Program:
    rank = draw(st.integers(1, 3))
    base = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 7]), min_size=rank, max_size=rank)))
    shapes = [base]
    for _ in range(draw(st.integers(0, 2))):
        # Another input that broadcasts against the first: some dims 1, maybe fewer dims.
        drop = draw(st.integers(0, rank - 1))
        shapes.append(tuple(1 if draw(st.booleans()) else s for s in base[drop:]))
    builder = ProgramBuilder(draw, shapes)
    for _ in range(draw(st.integers(2, 7))):
        builder.step()
    computed = builder.vars[len(builder.inputs) :] or builder.inputs
    outputs = [computed[-1]]
    if len(computed) > 1 and draw(st.booleans()):
        outputs.insert(0, draw(st.sampled_from(computed[:-1])))
    params = ", ".join(v.name for v in builder.inputs)
    body = "\n".join(builder.lines)
    returns = ", ".join(v.name for v in outputs)
    source = f"def program({params}):\n{body}\n    return {returns},"
    return Program(source, shapes, draw(st.integers(0, 2**16)))


# Reproducible examples; other property tiers reuse it (settings(PROPERTY_SETTINGS, ...)).
PROPERTY_SETTINGS = settings(
    max_examples=PROPERTY_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@PROPERTY_SETTINGS
@given(programs())
def test_fused_and_unfused_match_eager(program: Program) -> None:
    note("Failing program (run from the repository root):\n\n" + program.text())
    fn, inputs = program.build()
    with torch.no_grad():
        expected = fn(*inputs)
    # Also chained (``passes/chain.py``): fused kernels, and every op a
    # stage of one kernel.
    for options in ({}, {"fuse": False}, {"chain": True}, {"fuse": False, "chain": True}):
        torch._dynamo.reset()
        actual = run_tilec(fn, *inputs, options=options)
        assert_close_tree(actual, expected, atol=ATOL, rtol=RTOL)


# Every op family must show up in the examples the property test draws.
FAMILIES = {
    "reduction": r"\.(sum|amax|mean)\(",
    "keepdim": r"keepdim=True",
    "where": r"torch\.where",
    "cast": r"half\(\)|bfloat16\(\)|to\(torch\.int32\)",
    "reshape": r"\.reshape\(",
    "permute": r"\.permute\(",
    "slice": r"[xv]\d+\[",
    "expand": r"\.expand\(",
    "unsqueeze": r"\.unsqueeze\(",
    "broadcast input": r"def program\(x0, x1",
}


def test_generator_reaches_every_op_family() -> None:
    seen: set[str] = set()

    @settings(max_examples=PROPERTY_EXAMPLES, derandomize=True, database=None, deadline=None)
    @given(programs())
    def collect(program: Program) -> None:
        seen.update(k for k, pattern in FAMILIES.items() if re.search(pattern, program.source))

    collect()
    assert seen == set(FAMILIES), f"never generated: {sorted(set(FAMILIES) - seen)}"

"""Unit tier for the IR: the printer, index simplification, options, dumps."""

from __future__ import annotations

import itertools
import json

import pytest
import sympy
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.compare import assert_matches_eager
from tests.lowering import lower, optimize
from tilec import index as ix
from tilec.ir import OUTPUT, format_graph, readers
from tilec.options import Options

# ---------------------------------------------------------------- readers


def test_readers_look_through_views_and_name_outputs() -> None:
    def fn(x, w):
        h = torch.relu(x)
        t = h.t()  # a view
        return (t @ w).sum(), h + 1, t

    graph = lower(fn, torch.randn(4, 6), torch.randn(4, 3))
    relu = next(
        n for n in graph.nodes.values() if n.kind == "pointwise" and not n.name.startswith("add")
    )
    found = readers(graph)[relu.name]
    mm = next(n for n in graph.nodes.values() if n.kind == "extern")
    add = next(n for n in graph.nodes.values() if n.name.startswith("add"))
    # mm reads the transposed view, the add reads h itself, and the view is returned.
    assert found == {mm.name: True, add.name: False, OUTPUT: True}
    views = [n for n, node in graph.nodes.items() if node.kind == "view"]
    assert views and all(
        graph.nodes[r].kind != "view" for n in views for r in readers(graph)[n] if r != OUTPUT
    )


def test_replace_nodes_keeps_fusion_and_plan_and_refuses_lost_members() -> None:
    graph = optimize(lower(lambda x: (x.exp() + 1).sum(-1), torch.randn(4, 8)))
    assert graph.groups and graph.schedule and graph.memory is not None
    same = graph.replace_nodes(list(graph.nodes.values()))
    assert (same.groups, same.schedule, same.memory) == (graph.groups, graph.schedule, graph.memory)
    assert same.decisions == graph.decisions
    member = graph.groups[0].nodes[0]
    with pytest.raises(ValueError, match=f"contains %{member}"):
        graph.replace_nodes([n for n in graph.nodes.values() if n.name != member])


# ------------------------------------------------------------------ printer


def test_printer_shows_kinds_shapes_dtypes_and_kernels() -> None:
    def fn(x, w, ids, mask):
        h = F.layer_norm(x, (16,)) @ w
        return torch.where(mask, h, 0.0)[ids].t(), ids.sum()

    inputs = (torch.randn(6, 16), torch.randn(16, 8), torch.tensor([0, 2]), torch.rand(6, 8) > 0.5)
    text = format_graph(optimize(lower(fn, *inputs)))
    assert text.startswith("graph test(%arg0_1: f32[6, 16], %arg1_1: f32[16, 8], ")
    assert "%arg2_1: i64[2]" in text and "%arg3_1: b8[6, 8]" in text
    for kind in ("reduction", "pointwise", "view", "extern"):
        assert f" = {kind}" in text, kind
    assert "library aten.mm.default(" in text
    assert "over r0 < 16" in text  # a reduction names its range
    assert "\n  return %" in text
    kernels = [line for line in text.splitlines() if line.startswith("kernel ")]
    assert kernels and all(" over [" in k and " stores %" in k for k in kernels)
    # The layer norm (rows x reduction), combined with the independent sum
    # of the ids into one launch: each part's space.
    assert "kernel k0 over [6] x [16] + [] x [2]" in text
    assert "\ndecisions:\n  matmul: library %mm: " in text and "\n  fuse: fused {%" in text


def test_printer_shows_rejected_fusions() -> None:
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    text = format_graph(optimize(lower(lambda x, w: torch.relu(x) @ w + torch.relu(x), x, w)))
    assert "fuse: rejected {%relu} + {%add}: would create a cycle through %mm [cycle]" in text


# -------------------------------------------------------------------- index

SYMBOLS = ix.out_symbols(2) + ix.reduce_symbols(1)


@st.composite
def index_exprs(draw: st.DrawFn, depth: int = 2) -> sympy.Expr:
    """Non-negative index arithmetic: sums of scaled terms, floor divisions, remainders."""
    terms = []
    for _ in range(draw(st.integers(1, 3))):
        if depth > 0 and draw(st.booleans()):
            inner = draw(index_exprs(depth - 1))
            k = draw(st.integers(1, 8))
            atom = sympy.floor(inner / k) if draw(st.booleans()) else sympy.Mod(inner, k)
        else:
            atom = draw(st.sampled_from(SYMBOLS))
        terms.append(draw(st.integers(1, 6)) * atom)
    expr = sympy.Add(draw(st.integers(0, 5)), *terms)
    # sympy may fold Mod(a, k) * Mod(a, k) into a power: not an index the IR makes.
    assume(not expr.has(sympy.Pow))
    return expr


def _values(expr: sympy.Expr, ranges: dict[sympy.Symbol, int]) -> torch.Tensor:
    env = {}
    for k, (sym, size) in enumerate(ranges.items()):
        shape = [1] * len(ranges)
        shape[k] = size
        env[sym] = torch.arange(size).view(shape)
    full = tuple(ranges.values())
    return torch.broadcast_to(torch.as_tensor(ix.evaluate_index(expr, env)), full)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(index_exprs(), st.lists(st.integers(1, 7), min_size=3, max_size=3))
def test_simplify_index_keeps_values(expr: sympy.Expr, sizes: list[int]) -> None:
    ranges = dict(zip(SYMBOLS, sizes))
    simple = ix.simplify_index(expr, ranges)
    expected = _values(expr, ranges)
    assert torch.equal(_values(simple, ranges), expected), f"{expr} -> {simple}"
    # The kernel text of the index computes the same values too.
    grid = dict(zip(map(str, SYMBOLS), torch.meshgrid(*map(torch.arange, sizes), indexing="ij")))
    printed = eval(ix.print_index(simple), {}, grid)
    assert torch.equal(torch.broadcast_to(torch.as_tensor(printed), expected.shape), expected)


SIZES = tuple(sympy.Symbol(n, integer=True, positive=True) for n in ("s0", "s1"))
SYMBOLIC_MODULI = (2, 3, 4, *SIZES, 2 * SIZES[0], SIZES[0] * SIZES[1])


EXTENTS = (2, 5, *SIZES, SIZES[0] * SIZES[1])


@st.composite
def symbolic_index_exprs(draw: st.DrawFn, extents: tuple, depth: int = 2) -> sympy.Expr:
    """Index arithmetic whose divisors, remainders and scales may be size
    symbols, and the components of reshape round trips over ``extents`` (the
    index symbols' ranges), which simplify back to plain symbols."""
    terms = []
    for _ in range(draw(st.integers(1, 3))):
        choice = draw(st.integers(0, 2)) if depth > 0 else 0
        if choice == 1:
            inner = draw(symbolic_index_exprs(extents, depth - 1))
            k = draw(st.sampled_from((*SYMBOLIC_MODULI, *extents)))
            atom = sympy.floor(inner / k) if draw(st.booleans()) else sympy.Mod(inner, k)
        elif choice == 2:
            flat = ix.flatten_index(SYMBOLS, extents)
            atom = draw(st.sampled_from(ix.unflatten_index(flat, extents)))
        else:
            atom = draw(st.sampled_from(SYMBOLS))
        terms.append(draw(st.sampled_from((1, 2, 3, *SIZES))) * atom)
    expr = sympy.Add(draw(st.integers(0, 3)), *terms)
    assume(not expr.has(sympy.Pow))
    return expr


@st.composite
def symbolic_cases(draw: st.DrawFn) -> tuple[sympy.Expr, tuple]:
    extents = tuple(draw(st.lists(st.sampled_from(EXTENTS), min_size=3, max_size=3)))
    return draw(symbolic_index_exprs(extents)), extents


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(symbolic_cases())
def test_symbolic_simplify_index_keeps_values_for_every_size(case) -> None:
    """Simplified once with symbolic ranges, the index must keep its values
    for every size assignment (sizes >= 2, the generic variant's guard)."""
    expr, extents = case
    simple = ix.simplify_index(expr, dict(zip(SYMBOLS, extents)))
    for values in ((2, 2), (2, 3), (3, 2), (4, 7)):
        bind = dict(zip(SIZES, values))
        ranges = {sym: int(sympy.sympify(e).subs(bind)) for sym, e in zip(SYMBOLS, extents)}
        expected = _values(expr.subs(bind), ranges)
        assert torch.equal(_values(simple.subs(bind), ranges), expected), f"{expr} -> {simple}"


def test_symbolic_division_is_removed_when_bounded() -> None:
    i0, i1 = ix.out_symbols(2)
    s0, s1 = SIZES
    ranges = {i0: s0, i1: s1}
    assert ix.simplify_index(sympy.floor((i0 * s1 + i1) / s1), ranges) == i0
    assert ix.simplify_index(sympy.Mod(i0 * s1 + i1, s1), ranges) == i1
    assert ix.simplify_index(sympy.Mod(i1, 2 * s1), ranges) == i1
    # i1 + 1 reaches s1: the remainder must stay.
    assert ix.simplify_index(sympy.Mod(i1 + 1, s1), ranges) == sympy.Mod(i1 + 1, s1)


def test_simplify_index_removes_redundant_division() -> None:
    i0, i1 = ix.out_symbols(2)
    ranges = {i0: 5, i1: 6}
    assert ix.simplify_index(sympy.floor((6 * i0 + i1) / 6), ranges) == i0
    assert ix.simplify_index(sympy.Mod(6 * i0 + i1, 6), ranges) == i1
    assert ix.simplify_index(sympy.Mod(i1, 8), ranges) == i1
    # A reshape of a reshape is plain strides again.
    flat = ix.flatten_index((i0, i1), (5, 6))
    back = ix.flatten_index(ix.unflatten_index(flat, (5, 6)), (5, 6))
    assert ix.simplify_index(back, ranges) == 6 * i0 + i1
    # Not redundant: i1 reaches 5, so the remainder must stay.
    assert ix.simplify_index(sympy.Mod(i1, 4), ranges) == sympy.Mod(i1, 4)


def test_index_symbols_enumerate_every_position() -> None:
    shape = (2, 3, 4)
    syms = ix.out_symbols(3)
    flat = ix.flatten_index(syms, shape)
    seen = [
        int(flat.subs(dict(zip(syms, point))))
        for point in itertools.product(*(range(s) for s in shape))
    ]
    assert seen == list(range(24))


# ------------------------------------------------------------------ options


def test_options_defaults() -> None:
    assert Options.from_user(None, None) == Options()
    assert Options.from_user("max-autotune", {"fuse": False}).fuse is False


@pytest.mark.parametrize(
    "mode, options, error, message",
    [
        (None, {"fusion": False}, ValueError, r"unknown option\(s\) \['fusion'\]; known options"),
        ("fast", None, ValueError, r"unknown mode 'fast'; expected one of"),
        (None, {"fuse": "no"}, TypeError, r"option 'fuse' must be a bool"),
        (None, {"interpret": 1}, TypeError, r"option 'interpret' must be a bool"),
        (None, {"dump": 3}, TypeError, r"option 'dump' must be a directory path"),
        (None, {"specialize": "often"}, ValueError, r"option 'specialize' must be one of"),
        (None, {"hot_after": 0}, ValueError, r"option 'hot_after' must be an int >= 1"),
        (None, {"matmul": "cublas"}, ValueError, r"option 'matmul' must be one of"),
    ],
)
def test_options_errors_name_the_problem(mode, options, error, message) -> None:
    with pytest.raises(error, match=message):
        Options.from_user(mode, options)


def test_dump_directory_from_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TILEC_DUMP", str(tmp_path))
    assert Options.from_user(None, None).dump == str(tmp_path)
    assert Options.from_user(None, {"dump": tmp_path / "x"}).dump == str(tmp_path / "x")


# -------------------------------------------------------------------- dumps


def test_dump_directory_layout(tmp_path) -> None:
    w = torch.randn(8, 8)
    assert_matches_eager(
        lambda x: torch.softmax(x @ w, -1).cumprod(0), torch.randn(4, 8), options={"dump": tmp_path}
    )
    (graph_dir,) = tmp_path.iterdir()
    files = sorted(p.name for p in graph_dir.glob("*.txt"))
    assert files == [
        "00-lowered.txt",
        "01-constant_fold.txt",
        "02-simplify.txt",
        "03-fold_affine.txt",
        "04-merge_matmuls.txt",
        "05-dce.txt",
        "06-cse.txt",
        "07-dce.txt",
        "08-attention.txt",
        "09-attention_sdpa.txt",
        "10-attention_cache.txt",
        "11-attention_copies.txt",
        "12-attention_split.txt",
        "13-matmul.txt",
        "14-split_k.txt",
        "15-split_reduction.txt",
        "16-fuse.txt",
        "17-split_combine.txt",
        "18-layout.txt",
        "19-in_place.txt",
        "20-combine.txt",
        "21-chain.txt",
        "22-memory_plan.txt",
        "program.txt",
        "summary.txt",
    ]
    for name in files[:23]:
        assert (graph_dir / name).read_text().startswith("graph ")
    fuse_dump = (graph_dir / "16-fuse.txt").read_text()
    assert "kernel k0 over" in fuse_dump
    assert "matmul: library %mm: auto: no prologue to fuse" in fuse_dump
    kernels = sorted(p.name for p in (graph_dir / "kernels").iterdir())
    assert kernels == ["tilec_k0.py"]
    assert "@triton.jit" in (graph_dir / "kernels" / "tilec_k0.py").read_text()
    summary = (graph_dir / "summary.txt").read_text()
    assert "kernels: 1  library calls: 1  fallbacks: 1" in summary
    assert "aten.cumprod.default" in summary and "compile time:" in summary
    assert "constants: " in summary and "bytes after folding" in summary
    for step in (
        "lower",
        "constant_fold",
        "simplify",
        "fold_affine",
        "dce",
        "cse",
        "fuse",
        "layout",
        "codegen",
    ):
        assert f"  {step} " in summary, step
    assert "removed=" in summary and "merged=" in summary and "nodes_fused=" in summary
    data = json.loads((graph_dir / "summary.json").read_text())
    assert data["kernels"] == 1 and [p["name"] for p in data["passes"]][0] == "lower"


def test_floor_divides_through_a_common_factor() -> None:
    """``floor((96*i + r) / 5376)`` is ``floor(i / 56)`` while ``0 <= r < 96``
    (a GEMM reading rows of 96 through a reshape); not once ``r`` may reach 96."""
    i, r = ix.index_symbol("i", 0), ix.index_symbol("r", 0)
    expr = sympy.floor((96 * i + r) / 5376)
    assert ix.simplify_index(expr, {i: 3136, r: 96}) == sympy.floor(i / 56)
    assert ix.simplify_index(expr, {i: 3136, r: 97}) != sympy.floor(i / 56)


def test_a_remainder_of_a_bounded_floor_goes() -> None:
    """``Mod(floor(i / 56), 56)`` is ``floor(i / 56)`` while ``i < 3136`` (a
    (56 * 56, C) product read as (1, 56, 56, C)), not once ``i`` may reach
    3136; a floor's bounds carry through sums and scales."""
    i, r = ix.index_symbol("i", 0), ix.index_symbol("r", 0)
    expr = sympy.Mod(sympy.floor(i / 56), 56)
    assert ix.simplify_index(expr, {i: 3136}) == sympy.floor(i / 56)
    assert ix.simplify_index(expr, {i: 3137}) == expr
    scaled = sympy.Mod(2 * sympy.floor(i / 56) + r, 112)
    assert ix.simplify_index(scaled, {i: 3136, r: 2}) == 2 * sympy.floor(i / 56) + r
    assert ix.simplify_index(scaled, {i: 3136, r: 3}) == scaled
    assert ix.in_bounds((sympy.Mod(i, 7) - 1,), (6,), {i: 100}) is False
    assert ix.in_bounds((sympy.Mod(i, 7),), (7,), {i: 100})


def test_symbol_kinds_live_on_the_symbols_not_their_names() -> None:
    """A size symbol may have any name, even an index symbol's: the kind is
    the symbol's class (ix.IndexSymbol / ix.ValueSymbol)."""
    size = sympy.Symbol("r0", integer=True, positive=True)
    row, value = ix.index_symbol("r", 0), ix.value_symbol(0)
    assert size != row and str(size) == str(row)
    expr = size * row + value
    assert ix.size_symbols(expr) == {size}
    assert ix.gathered(expr) == [value]
    assert ix.always_positive(size - 1) and not ix.always_positive(row - 1)

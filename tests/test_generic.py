"""The generic variant: a graph with symbolic sizes compiled once with the
sizes left symbolic, run for every shape once the specialization table is full.

Oracle: eager torch on every shape.  Each case compiles with
``max_specializations=1``: the first shape gets a specialized program, every
later one runs the generic program (checked through the dump folders).
"""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import sympy
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from torch import nn

import tilec
from tests.compare import assert_close_tree, run_tilec
from tests.test_fusion_property import PROPERTY_SETTINGS, Program
from tests.test_fusion_property import programs as random_programs
from tilec import index as ix
from tilec.codegen.launch import INT32_LIMIT
from tilec.pipeline import programs

# (rows, cols) per call; the first is specialized, the rest run generic code.
# The last is larger than the block sizes the generic kernels were tuned for
# (for the second call), so programs and reduction loops repeat.  No size
# makes an output dimension 1 (Dynamo would specialize that in a new graph).
SHAPES = ((4, 6), (5, 9), (7, 4), (6, 70))

CASES = {
    "softmax over a symbolic dim": lambda x: torch.softmax(x, -1),
    "sum over a symbolic dim": lambda x: x.sum(0) * 2,
    "slices": lambda x: x[:, 1:] * x[:, :-1],
    "clamped slices and negative select": lambda x: (
        x[:, -2:].sum(1) + x[-1, 1:3].sum() + x[2:, 3].sum()
    ),
    "reshape and transpose": lambda x: (x.reshape(-1) + 1).reshape(x.shape[0], -1).t().contiguous(),
    "cat": lambda x: torch.cat([x, x * 2], 0) + 1,
    "pad": lambda x: F.pad(x, (1, 2)) + 1,
    "mean": lambda x: x.mean(0) + x.mean(1, keepdim=True).sum(),
    "var and std": lambda x: x.var(1) + x.std(0).sum(),
    "arange": lambda x: x + torch.arange(x.shape[1]),
    "flip": lambda x: x.flip(0) - x,
    "expand": lambda x: x[:, :1].expand(-1, x.shape[1]) * x,
    "max pool (floor division of a size)": lambda x: F.max_pool2d(x.view(1, 1, *x.shape), 2),
    "gather rows": lambda x: x[torch.tensor([0, 1])] + x[1],
    "tril": torch.tril,
    "repeat (BLOOM's alibi)": lambda x: x.repeat(2, 1) + x[:1].repeat(x.shape[0] * 2, 1),
    # A prefix product stays torch's.
    "fallback with symbolic arguments": lambda x: x.cumprod(1) + 1,
    # A prefix sum is a masked sum: of a symbolic length, under a guard
    # that it is at most decompositions.CUMSUM_MAX long.
    "prefix sum": lambda x: x.cumsum(1) + 1,
    "matmul": lambda x: x @ x.t() + 1,
    # LongT5's local attention: a length padded to whole blocks, then split into them.
    "blocks of a padded length": lambda x: (
        F.pad(x, (0, -x.shape[1] % 3)).reshape(x.shape[0], -1, 3).sum(-1) * 2
    ),
}


def _compile(fn, dump):
    return torch.compile(
        fn,
        backend="tilec",
        dynamic=True,
        options={"max_specializations": 1, "specialize": "first", "dump": str(dump)},
    )


@pytest.mark.parametrize("name", list(CASES))
def test_generic_variant_matches_eager(name, tmp_path):
    fn = CASES[name]
    compiled = _compile(fn, tmp_path)
    with torch.no_grad():
        for shape in SHAPES:
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-4, rtol=1e-4)
    # One specialization, then one generic program for every other shape.
    assert sorted(d.name.split("_", 2)[-1] for d in tmp_path.iterdir()) == ["0", "generic"]
    assert tilec.stats()["graphs"] == 2
    fallbacks = tilec.stats()["fallbacks"]
    assert (set(fallbacks) == {"aten.cumprod.default"}) if "fallback" in name else not fallbacks


def test_a_prefix_sum_of_a_symbolic_length_is_guarded_not_to_grow_past_its_limit():
    """A generic cumsum is a masked sum guarded to at most ``CUMSUM_MAX``
    elements: a longer call compiles again and falls back (an n x n sum
    would grow quadratically).  A length the user bounded above the limit
    is never narrowed by a guard (Dynamo would raise on the violated
    bound): it falls back."""
    from tilec.decompositions import CUMSUM_MAX

    fn = lambda x: x.cumsum(1) + 1  # noqa: E731
    compiled = torch.compile(fn, backend="tilec", dynamic=True, options={"max_specializations": 0})
    with torch.no_grad():
        for n in (5, 9):
            x = torch.randn(3, n)
            torch.testing.assert_close(compiled(x), fn(x))
        assert tilec.stats()["fallbacks"] == {}
        x = torch.randn(3, CUMSUM_MAX + 1)
        torch.testing.assert_close(compiled(x), fn(x))
    assert tilec.stats()["fallbacks"] == {"aten.cumsum.default": 1}
    assert tilec.stats()["graphs"] == 2
    torch._dynamo.reset()
    tilec.reset_stats()
    x = torch.randn(3, 9)
    torch._dynamo.mark_dynamic(x, 1, min=2, max=2 * CUMSUM_MAX)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(fn, backend="tilec")(x), fn(x))
    assert tilec.stats()["fallbacks"] == {"aten.cumsum.default": 1}


def test_a_length_padded_to_whole_blocks_divides_exactly():
    """``n + (-n % b)`` is a multiple of ``b``: the block a reshape into
    blocks infers, ``floor(P / floor(P / b))``, is ``b`` (LongT5's generic
    compile took minutes over index expressions built on the quotient).  The
    rewrite is exact for every size; a sum that is no multiple stays."""
    n, b = sympy.symbols("n b", integer=True, positive=True)
    padded = n + sympy.Mod(-n, b)
    assert ix.size(sympy.floor(padded / sympy.floor(padded / b))) == b
    assert ix.size(sympy.floor(padded / b)) == sympy.floor((n + b - 1) / b)
    as_sympy_writes_it = n + sympy.Mod(127 * n, 128)  # -n % 128
    assert ix.size(sympy.floor(as_sympy_writes_it / sympy.floor(as_sympy_writes_it / 128))) == 128
    not_a_multiple = n + sympy.Mod(n, 4)
    assert ix.size(not_a_multiple) == not_a_multiple
    exprs = [
        padded,
        sympy.floor(padded / b),
        padded / 3 + n,
        2 * n + sympy.Mod(-n, b),
        not_a_multiple,
    ]
    for value, block in itertools.product(range(1, 40), (1, 2, 3, 4, 7)):
        at = {n: value, b: block}
        for e in exprs:
            assert sympy.sympify(ix.size(e)).subs(at) == e.subs(at), (e, at)


def test_a_count_of_blocks_is_positive_and_bounds_its_positions():
    """``floor((n + 127) / 128)`` is at least 1 for every size: a position
    below it needs no remainder by it, and a block's position over many
    blocks' extent is 0 (sympy leaves a floor's sign open; LongT5's views
    over its blocks kept every such remainder, compiling for minutes)."""
    n = sympy.Symbol("n", integer=True, positive=True)
    blocks = ix.size(sympy.floor((n + 127) / 128))
    assert ix.always_positive(blocks)
    assert not ix.always_positive(blocks - 1)  # 1 block for n <= 128
    assert not ix.always_positive(sympy.floor(n / 128))  # 0 for n < 128
    (r,), (i,) = ix.reduce_symbols(1), ix.out_symbols(1)
    ranges = {r: 384, i: blocks}
    assert ix.simplify_index(sympy.Mod(i, blocks), ranges) == i
    assert ix.simplify_index(sympy.floor(r / (384 * blocks)), ranges) == 0
    assert ix.simplify_index(sympy.Mod(r + 384 * i, 384 * blocks), ranges) == r + 384 * i
    # Not below it: kept.
    assert ix.simplify_index(sympy.Mod(i + 1, blocks), ranges) == sympy.Mod(i + 1, blocks)


def test_blocks_of_a_padded_length_reduce_over_the_block():
    """The generic program's sum over blocks of a padded length reduces over
    the block's 3 elements, not over ``P // (P // 3)`` computed per call
    (a loop of symbolic extent with signed integer divisions in every index)."""
    fn = CASES["blocks of a padded length"]
    compiled = torch.compile(fn, backend="tilec", dynamic=True, options={"max_specializations": 0})
    with torch.no_grad():
        for shape in ((5, 9), (6, 70)):
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-4, rtol=1e-4)
    (program,) = programs().values()
    reductions = [n for n in program.graph.nodes.values() if n.kind == "reduction"]
    assert [n.reduce_shape for n in reductions] == [(3,)]


def _labels(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[0]) % x.shape[1]


def _scaled_attention(x: torch.Tensor) -> torch.Tensor:
    """Attention over the rows of ``x`` with head dim ``x.shape[-1]``, scaled
    in the matmul as GPT-NeoX and Bloom write it (a library call's argument)
    and in a kernel."""
    q = x.unsqueeze(0)
    scores = torch.baddbmm(
        torch.zeros(1, x.shape[0], x.shape[0]),
        q,
        q.transpose(1, 2),
        beta=0.0,
        alpha=1 / math.sqrt(x.shape[-1]),
    )
    return scores.softmax(-1) @ q * torch.full_like(q, math.sqrt(x.shape[-1]))


# Floats and bools computed from symbolic sizes (SymFloat, SymBool): kernels
# compute them from the size arguments, library calls get them evaluated.
SIZE_SCALAR_CASES = {
    "label-smoothed cross entropy": lambda x: F.cross_entropy(x, _labels(x), label_smoothing=0.1),
    "label smoothing per sample": lambda x: F.cross_entropy(
        x * 3, _labels(x), label_smoothing=0.25, reduction="none"
    ),
    "sum and mean over symbolic counts": lambda x: (
        torch.add(x.sum(0), x.mean(0), alpha=1.0 / x.shape[0]) + x.var(1, correction=2).sum()
    ),
    "x * (1.0 / x.shape[-1])": lambda x: x * torch.full_like(x, 1.0 / x.shape[-1]),
    "lerp and clamp by size ratios": lambda x: torch.lerp(x, x.exp(), 1.0 / x.shape[-1]).clamp(
        max=x.shape[0] / 4
    ),
    "attention scaled by 1/sqrt(head dim)": _scaled_attention,
    "comparison of sizes": lambda x: x * (x.shape[0] > x.shape[1]) + (x.shape[0] == 4),
    # Sizes computed with floats: ceil((end - start) / step), trunc(1.5 * s).
    "arange with float bounds": lambda x: (
        x.sum(1).max() + torch.arange(0.5, x.shape[0] * 1.5, 0.75)
    ),
    "upsampling by 1.5": lambda x: F.interpolate(x[None, None], scale_factor=1.5, mode="bilinear"),
    # Not a float: advanced indexing broadcasts index tensors of symbolic shapes.
    "nearest upsampling": lambda x: F.interpolate(x[None, None], scale_factor=2, mode="nearest"),
    # Nor these: an integer arange starting at a size, and a part of symbolic
    # size that sympy cannot prove positive.
    "integer arange from a size": lambda x: x + torch.arange(x.shape[1], 3 * x.shape[1], 2),
    "cat with a part not provably non-empty": lambda x: (
        torch.cat([x[:, :1], x[:, : x.shape[1] // 2] * 2], 1) + 1
    ),
    # A ceiling division of one size by another (LongT5's blocks), divided
    # by as a float: its floor of a ratio is an integer, not a float.
    "float of a ceiling division of sizes": lambda x: (
        x / ((x.shape[0] + (-x.shape[0]) % x.shape[1]) // x.shape[1])
    ),
}


@pytest.mark.parametrize("name", list(SIZE_SCALAR_CASES))
def test_floats_and_bools_of_sizes_run_generic(name, tmp_path, caplog):
    fn = SIZE_SCALAR_CASES[name]
    compiled = _compile(fn, tmp_path)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="tilec.guards"):
        for shape in SHAPES:
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-5)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert sorted(d.name.split("_", 2)[-1] for d in tmp_path.iterdir()) == ["0", "generic"]
    assert not tilec.stats()["fallbacks"]


def test_generic_kernels_take_sizes_as_arguments(tmp_path):
    compiled = _compile(lambda x: torch.softmax(x * 2, -1), tmp_path)
    with torch.no_grad():
        for n in (5, 6, 300):
            x = torch.randn(3, n)
            torch.testing.assert_close(compiled(x), torch.softmax(x * 2, -1))
    (generic,) = tmp_path.glob("*_generic")
    (source,) = (generic / "kernels").iterdir()
    header = next(line for line in source.read_text().splitlines() if "def tilec_" in line)
    guards = (generic / "guards.txt").read_text().splitlines()
    sizes = [g.split()[0] for g in guards if g.endswith(">= 2")]
    # Sizes are positional parameters; program.txt says which size each one passes.
    assert len(sizes) == 2 and ", size0, size1," in header, (header, guards)
    launch = (generic / "program.txt").read_text()
    assert all(f"={s}" in launch for s in sizes), launch
    # The reduction extent is symbolic: the kernel loops over it (no persistent row).
    assert "for roff in range(0, " in source.read_text()
    assert any(f"<= {INT32_LIMIT}" in g for g in guards)
    assert "guards: " + guards[0] in (generic / "summary.txt").read_text()


def test_generic_variant_guards_its_assumptions(tmp_path):
    compiled = _compile(lambda x: torch.cat([x, x]).exp(), tmp_path)
    with torch.no_grad():
        compiled(torch.randn(3))
        compiled(torch.randn(5))
    (program,) = [
        p for name, p in programs().items() if name.endswith("_generic") and str(tmp_path) in name
    ]
    (symbol,) = {s for g in program.guards() for s in g.split() if s.startswith("s")}
    assert program.accepts({symbol: 7}) is None
    assert program.accepts({symbol: 1}) == f"{symbol} >= 2"
    # 32-bit indexing: no tensor of the graph may reach 2**31 elements.
    assert program.accepts({symbol: 2**30}) == f"2*{symbol} <= {INT32_LIMIT}"


def test_reductions_of_symbolic_extent_loop(tmp_path):
    """Rows longer than the block the generic kernel was tuned for are reduced
    in several chunks; the mean divides by the symbolic count."""

    def fn(x):
        return x - x.mean(-1, keepdim=True), x.amax(-1), x.argmax(-1)

    compiled = _compile(fn, tmp_path)
    with torch.no_grad():
        for n in (4, 5, 1000, 77):
            x = torch.randn(2, n)
            for got, want in zip(compiled(x), fn(x)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mlp_and_layer_norm_with_any_batch(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4)).eval()
    compiled = _compile(model, tmp_path)
    with torch.no_grad():
        for batch in (2, 3, 9, 130, 3):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert tilec.stats()["graphs"] == 2 and tilec.stats()["fallbacks"] == {}


def test_conv_net_with_any_batch_and_image_size(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2)
    ).eval()
    compiled = _compile(model, tmp_path)
    with torch.no_grad():
        for batch, size in ((2, 8), (3, 10), (2, 13)):
            x = torch.randn(batch, 3, size, size)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert tilec.stats()["fallbacks"] == {}
    assert any(tmp_path.glob("*_generic"))


def test_patch_embedding_sizes_with_max(tmp_path):
    """A stride-8 convolution's output size is ``floor(s/8)``, and the strides
    of what follows hold ``Max(1, floor(s/8))`` (0 for s < 8): evaluated at
    run time and printed as ``tl.maximum`` in kernels."""
    torch.manual_seed(0)
    patch = nn.Conv2d(3, 16, 8, stride=8)
    norm = nn.LayerNorm(16)

    def fn(x):
        return norm(patch(x).flatten(2).transpose(1, 2)).softmax(1)

    compiled = _compile(fn, tmp_path)
    with torch.no_grad():
        for size in (16, 24, 40):
            x = torch.randn(2, 3, size, size)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-4, rtol=1e-4)
    assert any(tmp_path.glob("*_generic")) and tilec.stats()["fallbacks"] == {}


def test_without_a_generic_variant_specializations_are_evicted(caplog):
    """The IR interpreter (a debugging option) runs static graphs only: no
    generic variant; beyond the bound, the least recently used is dropped."""
    compiled = torch.compile(
        lambda x: x.exp() - x,
        backend="tilec",
        dynamic=True,
        options={"max_specializations": 3, "specialize": "first", "interpret": True},
    )
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="tilec.guards"):
        for n in (2, 3, 4, 5, 6, 2):
            x = torch.randn(n)
            torch.testing.assert_close(compiled(x), x.exp() - x)
    messages = [r.getMessage() for r in caplog.records]
    (warning,) = [m for m in messages if "no generic variant" in m]
    assert "static sizes only" in warning
    dropped = [m for m in messages if "dropping" in m]
    assert len(dropped) == 3 and "== 2" in dropped[0]  # least recently used first
    assert tilec.stats()["fallbacks"] == {}


def test_training_with_any_batch(tmp_path):
    """Forward and backward graphs both get generic variants; the forward
    returns the batch size (saved for the backward) as a value."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    compiled = _compile(model, tmp_path)
    for batch in (3, 5, 9, 33):
        x = torch.randn(batch, 8)
        grads = []
        for fn in (compiled, model):
            model.zero_grad()
            out = fn(x)
            (out.square().mean() * 3).backward()
            grads.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    folders = sorted(d.name.split("_", 1)[1] for d in tmp_path.iterdir())
    assert folders == ["backward_0", "backward_generic", "forward_0", "forward_generic"]
    assert tilec.stats()["fallbacks"] == {}


def test_max_specializations_zero_runs_every_shape_generic(tmp_path):
    compiled = torch.compile(
        lambda x: torch.softmax(x, 0),
        backend="tilec",
        dynamic=True,
        options={"max_specializations": 0, "dump": str(tmp_path)},
    )
    with torch.no_grad():
        for n in (3, 8, 5):
            x = torch.randn(n)
            torch.testing.assert_close(compiled(x), torch.softmax(x, 0))
    assert [d.name.split("_", 2)[-1] for d in tmp_path.iterdir()] == ["generic"]


# Random programs of the fusion property tier (pointwise ops, broadcasting,
# reductions, views), each compiled generic-only and compared with eager
# (about half of them have symbolic sizes; the others compile statically).
GENERIC_EXAMPLES = 80


@settings(PROPERTY_SETTINGS, max_examples=GENERIC_EXAMPLES)
@given(program=random_programs())
def test_random_programs_run_generic_like_eager(program: Program, caplog) -> None:
    note(
        "Failing program (compile it with dynamic=True, max_specializations=0):\n\n"
        + program.source
    )
    fn, inputs = program.build()
    with torch.no_grad():
        expected = fn(*inputs)
    torch._dynamo.reset()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tilec.guards"):
        actual = run_tilec(fn, *inputs, dynamic=True, options={"max_specializations": 0})
    # The generic variant ran, not a specialization made because it could not be built.
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert_close_tree(actual, expected, atol=1e-4, rtol=1e-4)


def test_hot_sizes_run_generic_until_a_size_repeats(tmp_path):
    """``specialize="hot"``: a length that changes on every call (decode) only
    ever runs the generic program; a size that comes back (serving) is
    specialized on its ``hot_after``-th call and runs that program after."""

    def fn(x):
        return torch.softmax(x, -1) * 2

    compiled = torch.compile(
        fn,
        backend="tilec",
        dynamic=True,
        options={"specialize": "hot", "hot_after": 3, "dump": str(tmp_path)},
    )

    def folders():
        return sorted(d.name.split("_", 2)[-1] for d in tmp_path.iterdir())

    with torch.no_grad():
        for length in range(5, 11):
            x = torch.randn(4, length)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-5)
        assert folders() == ["generic"]
        x = torch.randn(4, 7)  # seen once above: its 2nd call still runs generic code
        torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-5)
        assert folders() == ["generic"]
        for _ in range(2):  # the 3rd call specializes, the 4th reuses it
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-5)
        assert folders() == ["0", "generic"]
    assert tilec.stats()["graphs"] == 2


def test_decode_lengths_repeated_by_many_generations_never_specialize(tmp_path):
    """Sixteen lengths, one call each per "generated sequence", four
    sequences: every length is seen four times, but each makes up a
    sixteenth of the recent calls, so none is hot; a size in every other call
    is, once it makes up an eighth of the last 64 calls."""

    def fn(x):
        return torch.softmax(x, -1) * 2

    compiled = torch.compile(fn, backend="tilec", dynamic=True, options={"dump": str(tmp_path)})
    with torch.no_grad():
        for _ in range(4):
            for length in range(5, 21):
                x = torch.randn(2, length)
                torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-5)
        assert sorted(d.name.split("_", 2)[-1] for d in tmp_path.iterdir()) == ["generic"]
        # 30 in every other call: hot on its 8th (an eighth of the last 64).
        for length in [n for k in range(8) for n in (30, 40 + k)]:
            x = torch.randn(2, length)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-5)
    assert sorted(d.name.split("_", 2)[-1] for d in tmp_path.iterdir()) == ["0", "generic"]
    assert (tmp_path / next(d.name for d in tmp_path.iterdir() if d.name.endswith("_0"))).joinpath(
        "guards.txt"
    ).read_text().count("== 30") == 1


def test_constant_pad_by_symbolic_amounts_stays_native(tmp_path):
    """Pad amounts that are sizes (Dynamo makes int arguments symbolic): the
    masks are kept wherever sympy cannot prove them redundant."""

    def fn(x, p):
        return torch.nn.functional.pad(x, (p, 2, 1, p), value=-1.0) + 1

    compiled = torch.compile(fn, backend="tilec", dynamic=True, options={"max_specializations": 0})
    with torch.no_grad():
        for p, cols in ((2, 5), (3, 4), (5, 7)):
            x = torch.randn(3, cols)
            torch.testing.assert_close(compiled(x, p), fn(x, p))
    assert tilec.stats()["fallbacks"] == {}


def test_slice_starting_at_a_symbolic_int_argument(tmp_path):
    """A size symbol that only a view reads (``narrow(x, 1, start, 2)`` with
    ``start`` a symbolic int argument; no shape contains it) still reaches
    the call function, and a kernel that reads the view takes it too."""

    def view_only(x, start):
        return torch.narrow(x, 1, start, 2)

    def fused(x, start):
        return torch.narrow(x, 1, start, 2) * 2

    for fn in (view_only, fused):
        torch._dynamo.reset()
        compiled = torch.compile(
            fn, backend="tilec", dynamic=True, options={"max_specializations": 0}
        )
        with torch.no_grad():
            for start, cols in ((2, 5), (1, 6), (4, 7)):
                x = torch.randn(3, cols)
                torch.testing.assert_close(compiled(x, start), fn(x, start))
    assert tilec.stats()["fallbacks"] == {}


def test_a_size_argument_returned_alone_reaches_the_call_function():
    """A size symbol that only an output reads (``broadcast_shapes((n,), ())``
    of a symbolic int argument: no shape, view or kernel has it): the call
    function took no sizes and raised NameError on ``size_s..``."""

    def shape_only(n):
        return torch.broadcast_shapes((n,), ())

    def beside_a_tensor(n, x):
        return torch.broadcast_shapes((n, 1), (2,)), x * 2

    for fn, extra in ((shape_only, ()), (beside_a_tensor, (torch.randn(3),))):
        torch._dynamo.reset()
        compiled = torch.compile(
            fn, backend="tilec", dynamic=True, options={"max_specializations": 0}
        )
        for n in (5, 6, 9):
            assert_close_tree(compiled(n, *extra), fn(n, *extra))


# Cases whose generic program is not captured: a library call on tensors of
# symbolic layout (a graph would bake in the sizes it was captured at).  The
# matmuls take the template under graphs (``passes/matmul.py``).
LIBRARY_CASES = {"fallback with symbolic arguments"}


@pytest.mark.parametrize("name", [*CASES, *SIZE_SCALAR_CASES])
def test_generic_variant_replays_one_graph_per_size_bucket(name, monkeypatch):
    """Under graph capture, the generic program is captured once per size
    bucket and replayed for every size in it (``BucketExecutor``): the
    shapes below fall in three buckets, the second, third and last in one."""
    fn = {**CASES, **SIZE_SCALAR_CASES}[name]
    compiled = torch.compile(
        fn, backend="tilec", dynamic=True, options={"max_specializations": 0, "cudagraphs": True}
    )
    with torch.no_grad():
        for shape in ((4, 6), (5, 9), (7, 4), (6, 70), (20, 5), (4, 6)):
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-4, rtol=1e-4)
    (program,) = programs().values()
    if name in LIBRARY_CASES:
        assert program.executor is program.eager, program.cudagraphs
        assert "library call" in program.cudagraphs
    else:
        assert len(program.executor.graphs) == 3, program.cudagraphs
        assert program.executor.eager_calls == 0


def test_scatters_over_updates_of_different_symbolic_shapes(caplog):
    """Two unfolds' gradients are scatters whose updates have different
    symbolic shapes (``s0 - 1`` and ``s0/2`` positions): fusion's reason for
    not sharing their kernel sorted the shapes, which symbolic sizes cannot
    be, and the backward got no generic variant."""

    def fn(x):
        return F.unfold(x, 2, 1, 0, 1).sum() + (F.unfold(x, 2, 1, 0, 2) * 2).sum()

    compiled = torch.compile(fn, backend="tilec", dynamic=True, options={"max_specializations": 0})
    with caplog.at_level(logging.WARNING, logger="tilec.guards"):
        for n in (5, 7, 8):
            x = torch.randn(2, 1, n, n, requires_grad=True)
            (actual,) = torch.autograd.grad(compiled(x), x)
            (expected,) = torch.autograd.grad(fn(x), x)
            torch.testing.assert_close(actual, expected)
    assert not [r.getMessage() for r in caplog.records if "no generic variant" in r.getMessage()]


def test_a_size_is_not_read_off_the_stride_of_a_one_element_dimension():
    """``einsum("ij,kj->ik")`` of (2, 3) and (1, 3) under ``dynamic=True``:
    its backward takes the second operand as (1, 1, s) with stride s on a
    dimension of one element, where the caller's tensor has stride 1.  The
    symbol is the size's (3), not that stride's (1): reading it off the
    stride ran a variant specialized for s = 1, which raised."""

    def f(a, b):
        return torch.einsum("ij,kj->ik", a, b)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="tilec", dynamic=True, options={"max_specializations": 0})
    inputs = [torch.randn(2, 3, requires_grad=True), torch.randn(1, 3, requires_grad=True)]
    weight = torch.randn(2, 1)
    got = torch.autograd.grad((compiled(*inputs) * weight).sum(), inputs)
    expected = torch.autograd.grad((f(*inputs) * weight).sum(), inputs)
    assert_close_tree(got, expected)

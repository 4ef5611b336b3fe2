"""Ops tilec does not lower run in ATen as whole nodes: higher-order ops
(``flex_attention``, ``torch.cond``, ``while_loop``, ``scan``, ``map``,
``invoke_subgraph``) called with their subgraphs, and user custom ops
(functional, tuple-returning, mutating).
Each is counted in ``tilec.stats()`` and named in the dump.

Oracle: eager torch.
"""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tilec
from tests.compare import assert_close_tree, assert_matches_eager


@torch.library.custom_op("tilec_test::scaled", mutates_args=())
def scaled(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


@scaled.register_fake
def _(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tilec_test::shifted_and_sum", mutates_args=())
def shifted_and_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x.sum(0)


@shifted_and_sum.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[1:])


@torch.library.custom_op("tilec_test::add_into", mutates_args=("out",))
def add_into(out: torch.Tensor, x: torch.Tensor) -> None:
    out.add_(x)


@add_into.register_fake
def _(out: torch.Tensor, x: torch.Tensor) -> None:
    return None


def _causal(b, h, q, kv):
    return q >= kv


def _relative_bias(score, b, h, q, kv):
    return score + (q - kv).to(score.dtype) * 0.1


def _attention(block_mask):
    # The HOP reads a kernel's result and a kernel reads the HOP's: both
    # cross the arena of the memory plan.
    def fn(q, k, v):
        out = flex_attention(q.sin(), k, v, score_mod=_relative_bias, block_mask=block_mask)
        return out * 2

    return fn


def test_flex_attention_runs_in_aten_counted_and_dumped(tmp_path):
    """In bf16 on a CPU (the interpreter has no bf16 dot) the attention
    template refuses flex_attention (tests/test_attention.py): the op runs
    in ATen, with its subgraphs."""
    block_mask = create_block_mask(_causal, 1, 2, 16, 16, device="cpu", BLOCK_SIZE=8)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    assert_matches_eager(_attention(block_mask), q, k, v, options={"dump": str(tmp_path)})
    assert tilec.stats()["fallbacks"] == {"higher_order.flex_attention": 1}
    (graph_dir,) = tmp_path.iterdir()
    lowered = (graph_dir / "00-lowered.txt").read_text()
    assert "fallback flex_attention(" in lowered and "subgraph(" in lowered
    assert "higher_order.flex_attention" in (graph_dir / "summary.txt").read_text()


def test_flex_attention_training_fails_like_eager():
    """torch has no FlexAttention backward on CPU: tilec raises what eager raises."""
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    fn = _attention(None)
    errors = []
    for run in (fn, torch.compile(fn, backend="tilec")):
        try:
            run(q, k, v).sum().backward()
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            errors.append(type(exc))
    assert errors[1] is errors[0]


def _cond(x):
    branch = torch.cond(x.sum() > 0, lambda x: x.sin() * 2, lambda x: x.cos() + 1, (x,))
    return branch + x


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_runs_in_aten(sign, tmp_path):
    x = sign * torch.rand(4, 5)
    assert_matches_eager(_cond, x, options={"dump": str(tmp_path)})
    assert tilec.stats()["fallbacks"] == {"higher_order.cond": 1}
    (graph_dir,) = tmp_path.iterdir()
    assert "fallback cond(" in (graph_dir / "00-lowered.txt").read_text()


def test_cond_training_gradients_match_eager():
    x = torch.randn(4, 5, requires_grad=True)
    _cond(x).sum().backward()
    expected = x.grad
    x.grad = None
    torch.compile(_cond, backend="tilec")(x).sum().backward()
    torch.testing.assert_close(x.grad, expected)
    assert tilec.stats()["fallbacks"]["higher_order.cond"] == 2  # forward and backward


def test_cond_in_the_generic_variant_of_a_dynamic_graph(tmp_path):
    options = {"max_specializations": 0, "dump": str(tmp_path)}
    compiled = torch.compile(_cond, backend="tilec", dynamic=True, options=options)
    with torch.no_grad():
        for n in (3, 5, 7):
            x = torch.randn(n, 4)
            assert_close_tree(compiled(x), _cond(x))
    assert any(d.name.endswith("generic") for d in tmp_path.iterdir())
    assert tilec.stats()["fallbacks"]["higher_order.cond"] >= 1


def test_cond_under_graph_capture_runs_eagerly(tmp_path):
    compiled = torch.compile(
        _cond, backend="tilec", options={"cudagraphs": True, "dump": str(tmp_path)}
    )
    with torch.no_grad():
        for k in range(3):
            x = torch.randn(4, 5) + (-1) ** k
            assert_close_tree(compiled(x), _cond(x))
    text = "".join(p.read_text() for p in tmp_path.rglob("cudagraphs.txt"))
    assert "ATen fallback cond is not an ATen op (it may run host code" in text


def test_while_loop_runs_in_aten():
    def fn(x):
        start = torch.zeros((), dtype=torch.int64)
        return while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2 + 1), (start, x.exp()))

    assert_matches_eager(fn, torch.randn(4))
    assert tilec.stats()["fallbacks"] == {"higher_order.while_loop": 1}


def _running_sum(carry, x):
    carry = carry + x
    return carry, carry * 2


@pytest.mark.parametrize(
    ("fn", "name"),
    [
        (lambda x: scan(_running_sum, torch.zeros(5), x.exp(), dim=0), "higher_order.scan"),
        (lambda x: hop_map(lambda row: row.sin() * 2, x.exp()), "higher_order.map_impl"),
    ],
    ids=["scan", "map"],
)
def test_loops_over_a_dimension_run_in_aten(fn, name):
    assert_matches_eager(fn, torch.randn(4, 5))
    assert tilec.stats()["fallbacks"] == {name: 1}


def test_custom_ops_run_in_aten():
    def fn(x):
        shifted, total = shifted_and_sum(scaled(x.exp(), 3.0))
        return shifted * 2, total + 1

    assert_matches_eager(fn, torch.randn(4, 5))
    assert tilec.stats()["fallbacks"] == {
        "tilec_test.scaled.default": 1,
        "tilec_test.shifted_and_sum.default": 1,
    }


def test_a_mutating_custom_op_is_named_and_mutates_like_eager():
    def fn(out, x):
        add_into(out, x.exp())
        return out * 2

    out, x = torch.randn(4, 5), torch.randn(4, 5)
    expected_out = out.clone()
    with torch.no_grad():
        expected = fn(expected_out, x)
        actual = torch.compile(fn, backend="tilec")(out, x)
    assert_close_tree(actual, expected)
    assert_close_tree(out, expected_out)
    # Named by the op, not by its functional wrapper (auto_functionalized).
    assert tilec.stats()["fallbacks"] == {"tilec_test.add_into.default": 1}


@torch.compiler.nested_compile_region
def _region(x):
    return torch.sin(x) * 2


def _twice_through_a_region(x):
    return _region(_region(x).exp()) + 1


def test_a_nested_compile_region_runs_in_aten_also_in_training():
    x = torch.randn(4, 5)
    assert_matches_eager(_twice_through_a_region, x)
    assert tilec.stats()["fallbacks"] == {"higher_order.invoke_subgraph": 2}
    x.requires_grad_()
    _twice_through_a_region(x).sum().backward()
    expected = x.grad
    x.grad = None
    torch.compile(_twice_through_a_region, backend="tilec")(x).sum().backward()
    torch.testing.assert_close(x.grad, expected)


def test_the_call_function_names_every_value_before_its_source_is_written():
    """A library call's argument that has no literal (the fallback's
    subgraph) is named when the plan is built: the namespace an executor
    makes before writing the call function holds it (the call function
    once failed with a NameError when no dump had written the source
    first)."""
    from tilec.pipeline import programs

    x = torch.randn(4, 5)
    assert_matches_eager(_twice_through_a_region, x)
    (program,) = programs().values()
    names = dict(program.plan.names)
    assert any(name.startswith("x") for name in names), names
    program.plan.source()
    assert program.plan.names == names

"""Storage semantics: ``as_strided`` addresses its input's storage, and
compiled outputs have eager's strides.

Every case compares ``torch.compile(fn, backend="tilec")`` with eager on
values and on strides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tilec
from tests.compare import assert_close_tree
from tests.lowering import new_programs


def _strides(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.stride()
    return [_strides(o) for o in out]


def check(fn: Callable, *inputs: Any, native: bool = True, **compile_kwargs: Any) -> None:
    """``fn`` compiled with tilec matches eager in values and strides; with
    ``native`` nothing fell back to ATen."""
    with torch.no_grad():
        expected = fn(*inputs)
    torch._dynamo.reset()
    tilec.reset_stats()
    compiled = torch.compile(fn, backend="tilec", **compile_kwargs)
    with torch.no_grad():
        actual = compiled(*inputs)
    assert_close_tree(actual, expected)
    assert _strides(actual) == _strides(expected)
    if native:
        assert tilec.stats()["fallbacks"] == {}


# ------------------------------------------------------------- as_strided


def _nested(x):
    p = F.pad(x * 2, (2, 2))
    v1 = torch.as_strided(p, (3, 10), (2, 1))
    return torch.as_strided(v1, (4, 5), (1, 3)).clone()


def _of_transposed_input(x):
    return torch.as_strided(x.t(), (3, 4), (1, 3)) * 1


def _of_input_slice(x):
    return torch.as_strided(x[1:], (3, 3), (2, 1)) + 1


def _of_computed_slice(x):
    return torch.as_strided((x * 2)[1:, 1:], (3, 3), (2, 1)) + 1


def _with_storage_offset(x):
    return torch.as_strided(x * 2, (3, 3), (1, 2), 5) + 1


def _of_permuted(x):
    # A computed base laid out as eager lays out a permuted result.
    y = (x * 2).t().contiguous().t()
    return torch.as_strided(y[:, 1:], (2, 5), (1, 2)) + 1


def _sized_by_input(x):
    # With dynamic=True, sizes and strides are symbolic.
    return torch.as_strided(x * 2, (x.shape[0] - 1, 2), (x.shape[1], 1), x.shape[1]) + 1


AS_STRIDED = {
    "sized_by_input": _sized_by_input,
    "nested": _nested,
    "of_transposed_input": _of_transposed_input,
    "of_input_slice": _of_input_slice,
    "of_computed_slice": _of_computed_slice,
    "with_storage_offset": _with_storage_offset,
    "of_permuted": _of_permuted,
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", sorted(AS_STRIDED))
def test_as_strided_reads_the_storage_of_its_base(name: str, dynamic: bool) -> None:
    # The generic variant of a dynamic graph lowers it natively where it can
    # prove the positions lie inside the base for every size; the others run
    # in ATen there.
    native = not dynamic or name == "sized_by_input"
    check(AS_STRIDED[name], torch.randn(4, 6), native=native, dynamic=dynamic)


def test_as_strided_of_an_input_with_a_storage_offset() -> None:
    """Without an offset, positions count from the input's own storage
    offset (native); an absolute offset depends on the input's storage
    offset, which Dynamo does not guard, so it runs in ATen."""
    storage = torch.randn(64)

    def relative(x):
        return torch.as_strided(x, (3, 3), (1, 2)) * 2

    def absolute(x):
        return torch.as_strided(x, (3, 3), (1, 2), 7) * 2

    for fn, native in ((relative, True), (absolute, False)):
        torch._dynamo.reset()
        tilec.reset_stats()
        compiled = torch.compile(fn, backend="tilec")
        for start in (1, 3, 6):
            x = storage[start : start + 24].view(4, 6)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), fn(x))
        assert (tilec.stats()["fallbacks"] == {}) == native


def test_as_strided_of_a_buffer_the_layout_pass_lays_out() -> None:
    """The layout pass makes ``y`` channels-last (a convolution reads it);
    ``as_strided`` still reads eager's (contiguous) storage order of ``y``."""
    weight = torch.randn(3, 2, 3, 3)

    def fn(x):
        y = torch.relu(x)
        return F.conv2d(y, weight), torch.as_strided(y, (4, 6), (7, 3), 2) * 2

    x = torch.randn(1, 2, 6, 6)
    for options in ({"layout": "channels_last"}, {"layout": "channels_last", "fuse": False}):
        with torch.no_grad():
            expected = fn(x)
        torch._dynamo.reset()
        before = set(tilec.programs())
        with torch.no_grad():
            actual = torch.compile(fn, backend="tilec", options=options)(x)
        assert_close_tree(actual, expected)
        (program,) = new_programs(before)
        relu = [
            n for n in program.graph.nodes.values() if n.kind == "pointwise" and len(n.shape) == 4
        ]
        assert any(n.stride is not None and n.stride[1] == 1 for n in relu)


def test_as_strided_at_an_absolute_offset_through_a_copy_of_an_input() -> None:
    # tilec computes the diagonal as a copy; ATen must address the input's storage.
    def fn(x):
        return torch.as_strided(torch.diagonal(x), (2,), (1,), 3) * 2

    check(fn, torch.randn(4, 4), native=False)


def test_as_strided_of_a_non_dense_input_runs_in_aten() -> None:
    # Reads storage between the input's elements: only the real tensor has it.
    def fn(x):
        return torch.as_strided(x, (4, 4), (8, 1)) * 2

    check(fn, torch.randn(8, 8)[:, ::2], native=False)


def _scatter_dense(x, y):
    return torch.as_strided_scatter(x * 2, y, (2, 2), (1, 3), 1) + 1


def _scatter_relative_to_an_input(x, y):
    return torch.as_strided_scatter(x[1:], y, (2, 2), (1, 3)) + 1


def _scatter_with_gaps(x, y):
    # The copy keeps the slice's gaps; positions in gaps (3 and 5)
    # write nothing anyone sees.
    return torch.as_strided_scatter((x * 2)[:, ::2], y, (2, 2), (2, 3), 0) + 1


def _scatter_transposed(x, y):
    return torch.as_strided_scatter((x * 2).t(), y, (2, 2), (1, 5), 2) + 1


def _scatter_expanded(x, y):
    # Eager copies an expanded tensor contiguously.
    return torch.as_strided_scatter((x * 2)[:1].expand(4, 6), y, (2, 2), (1, 3), 1) + 1


def _scatter_of_as_strided(x, y):
    a = torch.as_strided(x * 2, (3, 3), (1, 4))
    return torch.as_strided_scatter(a, y, (2, 2), (1, 3), 0) + 1


def _scatter_absolute_into_an_input(x, y):
    # Depends on the input's storage offset, which Dynamo does not guard.
    return torch.as_strided_scatter(x[1:], y, (2, 2), (1, 3), 8) + 1


SCATTERS = {
    "dense": _scatter_dense,
    "relative_to_an_input": _scatter_relative_to_an_input,
    "with_gaps": _scatter_with_gaps,
    "transposed": _scatter_transposed,
    "expanded": _scatter_expanded,
    "of_as_strided": _scatter_of_as_strided,
    "absolute_into_an_input": _scatter_absolute_into_an_input,
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", sorted(SCATTERS))
def test_as_strided_scatter_writes_the_storage_of_its_copy(name: str, dynamic: bool) -> None:
    # ATen runs what tilec cannot know: an absolute offset into an input, gaps
    # in symbolic strides, and (generic variant) the as_strided it reads.
    native = name != "absolute_into_an_input" and not (
        dynamic and name in ("with_gaps", "of_as_strided")
    )
    x = torch.randn(32)[3:27].view(4, 6)
    check(SCATTERS[name], x, torch.randn(2, 2), native=native, dynamic=dynamic)


# ---------------------------------------------------------- output strides


def _into_empty_strided(x):
    r = torch.empty_strided(x.size(), x.stride())
    r[:] = x + x
    return r


def _views_of_an_output(x):
    y = x * 2
    return y, y[:, 1:], y.t()


def _views_of_an_input(x):
    return x[1:], x.t()


def _read_by_a_reduction(x):
    # The layout pass picks layouts for buffers reductions read; not outputs'.
    y = torch.sin(x)
    return y, y.sum(0)


def _permuted(x):
    # Eager keeps the permutation's memory order; with dynamic=True the
    # strides hold Max(1, size) terms.
    return x.reshape(2, 4, -1).permute(2, 0, 1) + 1


def _channels_last(x):
    return torch.relu(x.reshape(1, 2, 4, -1).contiguous(memory_format=torch.channels_last))


def _strided_slice_of_an_output(x):
    return (x * 2)[:, ::2]


def _like_a_transpose(x):
    return torch.empty_like(x.t()).copy_(x.t()) + 0


OUTPUTS = {
    "into_empty_strided": _into_empty_strided,
    "views_of_an_output": _views_of_an_output,
    "views_of_an_input": _views_of_an_input,
    "read_by_a_reduction": _read_by_a_reduction,
    "permuted": _permuted,
    "channels_last": _channels_last,
    "strided_slice_of_an_output": _strided_slice_of_an_output,
    "like_a_transpose": _like_a_transpose,
}

VARIANTS = {
    "static": {},
    "dynamic": {"dynamic": True},
    "unfused": {"options": {"fuse": False}},
    "interpreted": {"options": {"interpret": True}},
    "channels_last_layout": {"options": {"layout": "channels_last"}},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_outputs_have_eager_strides(name: str, variant: str) -> None:
    # A (16, 8) view with strides (16, 1) and a storage offset.
    x = torch.randn(16, 17)[:, 1:9]
    check(OUTPUTS[name], x, native=False, **VARIANTS[variant])


@pytest.mark.parametrize("name", ["into_empty_strided", "permuted", "strided_slice_of_an_output"])
def test_training_outputs_and_gradients_have_eager_strides(name: str) -> None:
    fn = OUTPUTS[name]
    x = torch.randn(16, 8, requires_grad=True)
    expected = fn(x)
    torch._dynamo.reset()
    actual = torch.compile(fn, backend="tilec")(x)
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual, expected)
    grad = torch.randn_like(expected)
    actual.backward(grad)
    compiled_grad = x.grad
    x.grad = None
    expected.backward(grad)
    torch.testing.assert_close(compiled_grad, x.grad)
    assert compiled_grad.stride() == x.grad.stride()

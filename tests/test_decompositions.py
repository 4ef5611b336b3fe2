"""Decompositions against eager on negative, boundary and out-of-range
positions: a decomposition table is not a semantics oracle.

Every op in tilec's table (``tilec.decompositions``) that takes positions
(indices, offsets, shifts, diagonals, paddings, targets, output sizes) has a
case here, compiled with tilec and compared with eager in values and
strides; ``test_every_positional_decomposition_has_a_case`` derives the list
from the table, so an op that a new torch adds to it needs a case too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tilec
from tests.compare import assert_close_tree
from tilec.decompositions import decomposition_table

aten = torch.ops.aten


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


M = torch.randn(4, 5, generator=_gen())  # a matrix
IMG = torch.randn(1, 2, 4, 5, generator=_gen())  # an image batch
# Sampling positions inside and outside [-1, 1] (grid_sample pads them).
GRID = torch.rand(1, 3, 3, 2, generator=_gen()) * 3 - 1.5
# Multilabel targets: the labels before the first -1 count.
LABELS = torch.tensor([[1, -1, 0, 2, 3], [4, 3, 2, 1, 0], [0, -1, -1, -1, -1], [-1, 0, 0, 0, 0]])


def _index(*values: int) -> torch.Tensor:
    return torch.tensor(values)


def _masked_index(x):
    return aten._unsafe_masked_index(x[0], _index(1, 1, 1).bool(), [_index(-1, 2, -5)], 0.0)


def _masked_index_put(x):
    mask = torch.tensor([True, True, False])
    return aten._unsafe_masked_index_put_accumulate(x[0], mask, [_index(-1, 2, -5)], x[1, :3])


# Op packet (as the table names it) -> cases: (function of one tensor, input).
CASES: dict[str, list[tuple[Callable, torch.Tensor]]] = {
    "aten._unsafe_masked_index": [(_masked_index, M)],
    "aten._unsafe_masked_index_put_accumulate": [(_masked_index_put, M)],
    "aten._unsafe_index": [(lambda x: aten._unsafe_index(x, [_index(-1, 2, -4)]), M)],
    "aten._unsafe_index_put": [
        (lambda x: aten._unsafe_index_put(x, [_index(-1, 2, -4)], x[:3] * 2, True), M)
    ],
    "aten.index_add": [(lambda x: x.index_add(-1, _index(4, 0, 4), x[:, :3]), M)],
    "aten.index_copy": [(lambda x: x.index_copy(-1, _index(4, 0), x[:, 1:3] * 2), M)],
    "aten.index_fill": [(lambda x: x.index_fill(-1, _index(-1, 0), 3.0), M)],
    "aten.index_select_backward": [
        (lambda x: aten.index_select_backward(x[:, :2], [4, 5], -1, _index(4, 4)), M)
    ],
    "aten.take": [(lambda x: torch.take(x, _index(-1, 0, -20, 19)), M)],
    "aten.take_along_dim": [
        (lambda x: torch.take_along_dim(x, _index(4, 0, 1, 2)[:, None], -1), M),
        (lambda x: torch.take_along_dim(x, _index(19, 0, 7)), M),
    ],
    "aten.gather_backward": [
        (
            lambda x: aten.gather_backward(
                x[:, :2], x, -1, _index(4, 0, 0, 0, 1, 1, 2, 4).view(4, 2), False
            ),
            M,
        )
    ],
    "aten._adaptive_avg_pool2d": [
        (lambda x: F.adaptive_avg_pool2d(x, (2, 5)), IMG),  # even windows: an avg_pool2d
        (lambda x: F.adaptive_avg_pool2d(x, (3, 2)), IMG),  # overlapping windows
        (lambda x: F.adaptive_avg_pool2d(x, (6, 7)), IMG),  # more positions than the input
    ],
    "aten.roll": [
        (lambda x: torch.roll(x, (-7, 3), (-1, 0)), M),
        (lambda x: torch.roll(x, -13), M),
    ],
    "aten.rot90": [(lambda x: torch.rot90(x, -3, (1, 0)), M), (lambda x: torch.rot90(x, 6), M)],
    "aten.diag": [(lambda x: torch.diag(x, -2), M), (lambda x: torch.diag(x[0], -2), M)],
    "aten.diag_embed": [(lambda x: torch.diag_embed(x, -1, -1, 0), M)],
    "aten.diagflat": [(lambda x: torch.diagflat(x, -3), M)],
    "aten.diagonal_copy": [(lambda x: aten.diagonal_copy(x, -2, -1, 0), M)],
    "aten.diagonal_backward": [
        (lambda x: aten.diagonal_backward(x[0, :4], [4, 5], -1, -1, 0), M),
    ],
    "aten.select_backward": [(lambda x: aten.select_backward(x[0], [4, 5], 0, -1), M)],
    "aten.select_scatter": [(lambda x: torch.select_scatter(x, x[:, 0] * 2, -1, -2), M)],
    "aten.slice_backward": [
        (lambda x: aten.slice_backward(x[:, :2], [4, 5], -1, -3, -1, 1), M),
        (lambda x: aten.slice_backward(x[:, :2], [4, 5], 1, 1, 100, 2), M),
    ],
    "aten.tril": [(lambda x: torch.tril(x, -2), M), (lambda x: torch.tril(x, 9), M)],
    "aten.triu": [(lambda x: torch.triu(x, -1), M), (lambda x: torch.triu(x, -9), M)],
    "aten.nll_loss": [
        (lambda x: F.nll_loss(x.log_softmax(-1), _index(-100, 4, 0, 2)), M),
        (lambda x: F.nll_loss(x.log_softmax(-1), _index(3, 4, 0, 3), ignore_index=3), M),
        (lambda x: F.nll_loss(x.log_softmax(-1), _index(-100, 4, 0, 2), reduction="none"), M),
    ],
    "aten.nll_loss2d": [
        (lambda x: F.nll_loss(x.log_softmax(1), _index(-100, 1, 0, 1, 1).expand(1, 4, 5)), IMG)
    ],
    "aten.cross_entropy_loss": [
        (lambda x: F.cross_entropy(x, _index(-100, 4, 0, 2), label_smoothing=0.1), M)
    ],
    "aten.multi_margin_loss": [
        (lambda x: F.multi_margin_loss(x, _index(1, 4, 0, 2)), M),
        # One sample: a loss of its target's shape, () or (1,) (torch's
        # decomposition: (1,) for both).
        (lambda x: F.multi_margin_loss(x[0], _index(3)[0], reduction="none"), M),
        (lambda x: F.multi_margin_loss(x[0], _index(3), reduction="none"), M),
        (lambda x: F.multi_margin_loss(x[0, 0], _index(0)[0], reduction="none"), M),
        (lambda x: F.multi_margin_loss(x[1], _index(2)[0], p=2, margin=0.5), M),
    ],
    "aten.multilabel_margin_loss": [
        (lambda x: F.multilabel_margin_loss(x, LABELS), M),
        (lambda x: F.multilabel_margin_loss(x, LABELS, reduction="none"), M),
        (lambda x: F.multilabel_margin_loss(x[0], LABELS[0], reduction="sum"), M),
    ],
    "aten.embedding_bag": [
        (lambda x: F.embedding_bag(_index(1, 2, 3, 0, 3), x, _index(0, 2, 2), mode="sum"), M),
        (lambda x: F.embedding_bag(_index(1, 2, 3, 0), x, _index(0, 2, 2), mode="max"), M),
        (lambda x: F.embedding_bag(_index(1, 2, 3, 0), x, _index(0, 3), padding_idx=-1), M),
    ],
    "aten.embedding_dense_backward": [
        (lambda x: aten.embedding_dense_backward(x, _index(0, 3, 3, 1), 6, -1, False), M),
        (lambda x: aten.embedding_dense_backward(x, _index(0, 3, 3, 1), 6, 3, True), M),
    ],
    "aten.max_unpool2d": [
        (
            lambda x: F.max_unpool2d(
                *F.max_pool2d(x, 2, return_indices=True), 2, output_size=(4, 5)
            ),
            IMG,
        )
    ],
    "aten.max_pool1d_with_indices": [
        (lambda x: F.max_pool1d(x[0], 3, 2, 1, ceil_mode=True, return_indices=True), IMG)
    ],
    "aten.max_pool2d": [(lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True), IMG)],
    "aten.avg_pool1d": [
        (lambda x: F.avg_pool1d(x[0], 3, 2, 1, ceil_mode=True, count_include_pad=False), IMG)
    ],
    "aten.adaptive_avg_pool2d": [(lambda x: F.adaptive_avg_pool2d(x, (3, 2)), IMG)],
    "aten.adaptive_max_pool1d": [(lambda x: F.adaptive_max_pool1d(x[0], 3), IMG)],
    "aten.upsample_nearest2d": [
        (lambda x: F.interpolate(x, scale_factor=1.7, mode="nearest"), IMG)
    ],
    "aten._upsample_nearest_exact2d": [
        (lambda x: F.interpolate(x, size=(7, 3), mode="nearest-exact"), IMG)
    ],
    "aten.upsample_bilinear2d": [
        (lambda x: F.interpolate(x, size=(7, 3), mode="bilinear"), IMG),
        (lambda x: F.interpolate(x, size=(7, 3), mode="bilinear", align_corners=True), IMG),
    ],
    "aten._upsample_bilinear2d_aa": [
        (lambda x: F.interpolate(x, size=(3, 2), mode="bilinear", antialias=True), IMG)
    ],
    "aten.upsample_bicubic2d": [(lambda x: F.interpolate(x, size=(7, 3), mode="bicubic"), IMG)],
    "aten.upsample_linear1d": [(lambda x: F.interpolate(x[0], size=9, mode="linear"), IMG)],
    "aten.upsample_trilinear3d": [
        (lambda x: F.interpolate(x[None], size=(2, 7, 3), mode="trilinear"), IMG)
    ],
    "aten.grid_sampler": [
        (lambda x: F.grid_sample(x, GRID, padding_mode="zeros", align_corners=False), IMG),
        (lambda x: F.grid_sample(x, GRID, padding_mode="border", align_corners=True), IMG),
        (lambda x: F.grid_sample(x, GRID, padding_mode="reflection", align_corners=False), IMG),
        (lambda x: F.grid_sample(x, GRID, padding_mode="reflection", align_corners=True), IMG),
        (lambda x: F.grid_sample(x, GRID, "nearest", "reflection", align_corners=False), IMG),
        (lambda x: F.grid_sample(x, GRID, "bicubic", "border", align_corners=False), IMG),
    ],
    "aten.pad": [
        (lambda x: F.pad(x, (3, 4, 2, 3), mode="reflect"), IMG),
        (lambda x: F.pad(x, (-1, 4, 2, -1), mode="reflect"), IMG),
        (lambda x: F.pad(x, (3, 4, -1, 3), mode="replicate"), IMG),
        (lambda x: F.pad(x, (3, 4, 2, -1), mode="circular"), IMG),
        (lambda x: F.pad(x, (-1, 2, 3, -2)), IMG),
    ],
    "aten.im2col": [
        (lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=(1, 1), stride=(2, 1)), IMG)
    ],
    "aten.col2im": [
        (lambda x: F.fold(F.unfold(x, (2, 2), padding=1), (4, 5), (2, 2), padding=1), IMG)
    ],
    "aten.conv2d": [
        (lambda x: F.conv2d(x, x[0, :, :3, :3][None].expand(3, 2, 3, 3), padding=(2, 1)), IMG)
    ],
    "aten.conv_transpose2d": [
        (lambda x: F.conv_transpose2d(x, x[0, :, :2, :2][None].expand(2, 2, 2, 2), padding=1), IMG)
    ],
    "aten.repeat_interleave": [(lambda x: torch.repeat_interleave(x, 2, -1), M)],
    "aten.arange": [(lambda x: torch.arange(5, -3, -2) * x[0, 0], M)],
    "aten.linspace": [(lambda x: torch.linspace(1, -1, 7) * x[0, 0], M)],
    "aten.logspace": [(lambda x: torch.logspace(1, -1, 7, base=3.0) * x[0, 0], M)],
    "aten.value_selecting_reduction_backward": [
        (
            lambda x: aten.value_selecting_reduction_backward(
                x[:, 0], -1, _index(4, 0, 1, 4), [4, 5], False
            ),
            M,
        )
    ],
    "aten.cummaxmin_backward": [
        (lambda x: aten.cummaxmin_backward(x, x, _index(0, 0, 2, 2, 4).expand(4, 5), -1), M)
    ],
}

# Ops of the table that take positions and have no case, and why.
NOT_COVERED = {
    # Sparse and nested tensors, which tilec does not compile.
    **dict.fromkeys(
        [
            "aten._sparse_coo_tensor_unsafe",
            "aten._validate_sparse_coo_tensor_args",
            "aten.sparse_coo_tensor",
            "aten.embedding_sparse_backward",
            "aten._embedding_bag_sparse_backward",
            "aten._gather_sparse_backward",
            "aten.nested_to_padded_tensor",
        ],
        "sparse or nested tensors",
    ),
    # These decompose into the ops of a case above with the same positions.
    **dict.fromkeys(
        [
            "aten._convolution",
            "aten._convolution_mode",
            "aten._convolution_double_backward",
            "aten.conv1d",
            "aten.conv3d",
            "aten.conv_transpose1d",
            "aten.conv_transpose3d",
            "aten.thnn_conv2d",
            "aten.slow_conv3d",
            "aten.conv_tbc_backward",
        ],
        "aten.convolution with the same padding (conv2d, conv_transpose2d)",
    ),
    "aten._pad_enum": "aten.pad",
    "aten._pad_circular": "aten.pad",
    **dict.fromkeys(
        ["aten.reflection_pad1d", "aten.reflection_pad2d", "aten.reflection_pad3d"], "aten.pad"
    ),
    **dict.fromkeys(
        ["aten.replication_pad1d", "aten.replication_pad2d", "aten.replication_pad3d"],
        "aten.pad",
    ),
    **dict.fromkeys(
        [
            "aten.reflection_pad1d_backward",
            "aten.reflection_pad2d_backward",
            "aten.reflection_pad3d_backward",
        ],
        "training graphs of aten.pad's reflect mode",
    ),
    **dict.fromkeys(
        [
            "aten.nll_loss_forward",
            "aten.nll_loss2d_forward",
            "aten.nll_loss_nd",
            "aten.nll_loss_backward",
            "aten.nll_loss2d_backward",
        ],
        "aten.nll_loss / nll_loss2d and their training graphs",
    ),
    "aten.embedding_backward": "aten.embedding_dense_backward",
    "aten.max_pool1d": "aten.max_pool1d_with_indices",
    "aten.max_pool3d": "aten.max_pool2d (the same window positions in one more dimension)",
    "aten.max_unpool3d": "aten.max_unpool2d (the same index math in one more dimension)",
    "aten.adaptive_avg_pool1d": "aten.adaptive_avg_pool2d",
    "aten.adaptive_avg_pool3d": "aten.adaptive_avg_pool2d",
    "aten.upsample_nearest1d": "aten.upsample_nearest2d",
    "aten.upsample_nearest3d": "aten.upsample_nearest2d",
    "aten._upsample_nearest_exact1d": "aten._upsample_nearest_exact2d",
    "aten._upsample_nearest_exact3d": "aten._upsample_nearest_exact2d",
    "aten._upsample_bicubic2d_aa": "aten._upsample_bilinear2d_aa (the same window math)",
    "aten._upsample_lanczos2d_aa": "no Python API reaches it",
    "aten.multilabel_margin_loss_forward": "aten.multilabel_margin_loss",
    # Arguments named like positions that hold values.
    **dict.fromkeys(
        [
            "aten.binary_cross_entropy",
            "aten.binary_cross_entropy_backward",
            "aten.binary_cross_entropy_with_logits",
            "aten.cosine_embedding_loss",
            "aten.hinge_embedding_loss",
            "aten.huber_loss",
            "aten.huber_loss_backward",
            "aten.kl_div",
            "aten.l1_loss",
            "aten.margin_ranking_loss",
            "aten.mse_loss",
            "aten.mse_loss_backward",
            "aten.poisson_nll_loss",
            "aten.smooth_l1_loss",
            "aten.smooth_l1_loss_backward",
            "aten.soft_margin_loss",
            "aten.soft_margin_loss_backward",
            "aten.lerp",
            "aten.lerp_",
        ],
        "the target (end) is a value, not a position",
    ),
    # In-place forms: functionalization hands tilec the out-of-place op.
    "aten.index_add_": "aten.index_add",
    "aten.index_copy_": "aten.index_copy",
    "aten.index_fill_": "aten.index_fill",
    "aten.tril_": "aten.tril",
    "aten.triu_": "aten.triu",
}

# Schema arguments that hold positions.
POSITION_ARGUMENTS = {
    "index",
    "indices",
    "target",
    "offsets",
    "shifts",
    "diagonal",
    "offset",
    "padding_idx",
    "ignore_index",
    "grid",
    "start",
    "end",
    "k",
    "pad",
    "padding",
    "output_size",
    "scale_factors",
}


def _positional_ops() -> set[str]:
    ops = set()
    for op in decomposition_table():
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten":
            if {a.name for a in op._schema.arguments} & POSITION_ARGUMENTS:
                ops.add(str(op.overloadpacket))
    return ops


def test_every_positional_decomposition_has_a_case() -> None:
    missing = _positional_ops() - set(CASES) - set(NOT_COVERED)
    assert not missing, f"decomposed ops that take positions without a case: {sorted(missing)}"


def _strides(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.stride()
    return [_strides(o) for o in out]


CASE_IDS = [(op, k) for op, cases in CASES.items() for k in range(len(cases))]


@pytest.mark.parametrize("op,k", CASE_IDS, ids=[f"{op}-{k}" for op, k in CASE_IDS])
def test_decomposition_matches_eager(op: str, k: int) -> None:
    fn, x = CASES[op][k]
    with torch.no_grad():
        expected = fn(x)
    torch._dynamo.reset()
    with torch.no_grad():
        actual = torch.compile(fn, backend="tilec")(x)
    assert_close_tree(actual, expected)
    assert _strides(actual) == _strides(expected)


def test_multilabel_margin_loss_gradient() -> None:
    """Training graphs take tilec's version too (the loss and its gradient)."""
    x = M.clone().requires_grad_()
    torch._dynamo.reset()
    tilec.reset_stats()
    torch.compile(F.multilabel_margin_loss, backend="tilec")(x, LABELS).backward()
    compiled = x.grad
    x.grad = None
    F.multilabel_margin_loss(x, LABELS).backward()
    torch.testing.assert_close(compiled, x.grad)
    assert tilec.stats()["fallbacks"] == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm_gradient(dim: int, dtype: torch.dtype) -> None:
    """Weight normalization's backward (``_weight_norm_interface_backward``,
    which torch does not decompose; wav2vec2's positional convolution
    normalizes over its last dimension) is tilec's own: the gradients of
    ``v`` and ``g`` are eager's, with no fallback."""

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        conv = torch.nn.Conv1d(4, 6, 3, padding=1)
        return torch.nn.utils.parametrizations.weight_norm(conv, dim=dim).to(dtype)

    mine, theirs = make(), make()
    x = torch.randn(2, 4, 9, generator=_gen(), dtype=dtype)
    torch._dynamo.reset()
    tilec.reset_stats()
    torch.compile(mine, backend="tilec")(x).float().square().sum().backward()
    theirs(x).float().square().sum().backward()
    assert tilec.stats()["fallbacks"] == {}
    for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
        # float32: rounding; bfloat16: one unit in the last place of the largest.
        scale = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(a.grad, b.grad, atol=scale * b.grad.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "size,out,fallbacks",
    [
        # Even windows (AlexNet's 6 x 6 at 224 pixels, VGG's 7 x 7): an
        # avg_pool2d and its gathered gradient.
        ((12, 12), (6, 6), {}),
        # Uneven ones of at most 25 elements: gathers; the gradient two
        # matmuls (more positions than the input too).
        ((1, 1), (6, 6), {}),
        ((10, 9), (4, 4), {}),
        ((5, 7), (8, 3), {}),
        # Windows of 5 x 6 elements: torch's forward; the gradient tilec's.
        ((10, 9), (3, 2), {"aten._adaptive_avg_pool2d.default": 1}),
    ],
)
def test_adaptive_avg_pool2d_and_its_gradient(size, out, fallbacks, dtype) -> None:
    x = torch.randn(2, 3, *size, generator=_gen()).to(dtype).requires_grad_()
    weights = torch.randn(2, 3, *out, generator=_gen()).to(dtype)
    fn = lambda x: (F.adaptive_avg_pool2d(x, out) * weights).sum()  # noqa: E731
    torch._dynamo.reset()
    tilec.reset_stats()
    (compiled,) = torch.autograd.grad(torch.compile(fn, backend="tilec")(x), x)
    (expected,) = torch.autograd.grad(fn(x), x)
    assert compiled.stride() == expected.stride()
    assert tilec.stats()["fallbacks"] == fallbacks
    if dtype == torch.float32:
        torch.testing.assert_close(compiled, expected)
        return
    # bfloat16: eager rounds each window's share, tilec the sum once (1 x 1
    # to 6 x 6: a gradient of 36 terms, eager 0.07 off float64, tilec 0.007),
    # so tilec is judged by float64, to eager's error or a unit in the last
    # place of the largest.
    exact = x.detach().double().requires_grad_()
    (reference,) = torch.autograd.grad(
        (F.adaptive_avg_pool2d(exact, out) * weights.double()).sum(), exact
    )
    error = lambda g: (g.double() - reference).abs().max().item()  # noqa: E731
    assert error(compiled) <= max(error(expected), 8e-3 * reference.abs().max().item())

"""Layout selection: channels-last conv networks, reduction-friendly strides,
matmul transposes without copies; outputs keep eager's strides."""

from __future__ import annotations

import pytest
import torch

import tilec
from tests.compare import assert_matches_eager
from tests.lowering import lower, lower_with_constants, new_programs, optimize
from tests.test_constant_fold import _conv_net
from tilec.interpret import interpret
from tilec.options import Options
from tilec.passes.layout import layout


def _is_channels_last(stride: tuple[int, ...]) -> bool:
    return stride[1] == 1 and stride[3] > 1 and stride[0] > stride[2] > stride[3]


@pytest.mark.parametrize("freeze", [False, True], ids=["weights-as-inputs", "frozen"])
def test_conv_net_runs_channels_last_inside(freeze: bool) -> None:
    model = _conv_net()
    x = torch.randn(2, 3, 8, 8)
    before = set(tilec.programs())
    out = assert_matches_eager(model, x, options={"layout": "channels_last", "freeze": freeze})
    (program,) = new_programs(before)
    graph = program.graph
    convs = [n for n in graph.nodes.values() if n.kind == "extern" and n.shape[1:] == (8, 8, 8)]
    nhwc = [
        n
        for n in graph.nodes.values()
        if n.stride and len(n.shape) == 4 and _is_channels_last(n.stride)
    ]
    stored_nhwc = [n for g in graph.groups for n in g.stored if n in {m.name for m in nhwc}]
    # Every convolution after the first (which reads the NCHW model input with
    # NCHW weights unless they are frozen) writes NHWC, and the kernels between
    # them store NHWC.
    assert sum(_is_channels_last(c.stride) for c in convs) >= (3 if freeze else 2)
    assert stored_nhwc
    with torch.no_grad():
        assert out.stride() == model(x).stride()


def test_channels_last_is_chosen_for_gpu_targets_only_by_default() -> None:
    model = _conv_net()
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(state)

    def fn(*args):
        return torch.func.functional_call(model, dict(zip(names, args[:-1])), args[-1])

    x = torch.randn(2, 3, 8, 8)
    graph = lower_with_constants(fn, tuple(t.detach() for t in state.values()), x)
    fused = optimize(graph, Options(layout="eager"))
    cpu, cpu_counts = layout(fused, "auto", gpu=False)
    gpu, gpu_counts = layout(fused, "auto", gpu=True)
    assert cpu_counts["channels_last"] == 0 and gpu_counts["channels_last"] >= 5
    for chosen in (cpu, gpu):
        torch.testing.assert_close(interpret(chosen, [x]), interpret(graph, [x]))


def test_eager_layout_changes_nothing() -> None:
    fused = optimize(
        lower(lambda x: torch.sin(x).softmax(0), torch.randn(6, 5)),
        Options(fuse=False, layout="eager"),
    )
    after, counts = layout(fused, "eager")
    assert counts == {"reduction_layouts": 0, "channels_last": 0}
    assert [n.stride for n in after.nodes.values()] == [n.stride for n in fused.nodes.values()]


def test_reduction_over_dim0_reads_a_buffer_laid_out_for_it() -> None:
    def fn(x):
        return torch.sin(x).sum(0), torch.sin(x).amax(0)

    x = torch.randn(6, 5)
    graph = lower(fn, x)
    fused = optimize(graph, Options(fuse=False, layout="eager"))
    after, counts = layout(fused, "auto")
    (stored_sin,) = [
        n for g in after.groups for n in g.stored if "sin" in repr(after.nodes[n].body)
    ]
    assert counts["reduction_layouts"] == 1
    assert after.nodes[stored_sin].stride == (1, 6)  # the reduced dimension innermost
    torch.testing.assert_close(interpret(after, [x]), interpret(graph, [x]))
    assert_matches_eager(fn, x, options={"fuse": False})


def test_readers_that_disagree_keep_eager_strides() -> None:
    x = torch.randn(6, 5)
    fused = optimize(
        lower(lambda x: (torch.sin(x).sum(0), torch.sin(x).sum(1)), x),
        Options(fuse=False, layout="eager"),
    )
    _, counts = layout(fused, "auto")
    assert counts["reduction_layouts"] == 0


def test_matmul_transposes_are_not_materialized() -> None:
    linear = torch.nn.Linear(16, 8).eval()
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    for fn, inputs, options in [
        (lambda x, w: x @ w.t(), (x, w), None),
        (lambda x, w: torch.bmm(x.unsqueeze(0), w.t().unsqueeze(0)), (x, w), None),
        (linear, (x,), {"freeze": True}),
    ]:
        tilec.reset_stats()
        assert_matches_eager(fn, *inputs, options=options)
        assert tilec.stats()["kernels"] == 0  # no copy kernel: the library call takes the view
        assert tilec.stats()["extern_calls"] == 1


class _ConvNeXtBlock(torch.nn.Module):
    """ConvNeXt's block: a depthwise convolution, its result permuted to
    NHWC, LayerNorm over the channels, and the MLP along them."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.dwconv = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.norm = torch.nn.LayerNorm(channels)
        self.up = torch.nn.Linear(channels, 4 * channels)
        self.down = torch.nn.Linear(4 * channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.down(torch.nn.functional.gelu(self.up(y)))
        return x + y.permute(0, 3, 1, 2)


def test_a_value_read_through_a_permute_of_an_nhwc_result_keeps_its_order() -> None:
    """Under channels-last the convolution's result is NHWC; the LayerNorm
    reads it through ``permute(0, 2, 3, 1)``, so its (N, H, W, C) output in
    that memory order is contiguous, and so stays: it was taken for NCHW and
    stored with H innermost ((N, W, C, H) in memory), which the up
    projection's GEMM then read one element at a time along K.  The block
    matches eager."""
    torch.manual_seed(0)
    model = _ConvNeXtBlock().eval()
    x = torch.randn(2, 8, 6, 6)
    before = set(tilec.programs())
    options = {"layout": "channels_last", "matmul": "triton", "freeze": True}
    assert_matches_eager(model, x, options=options)
    (program,) = new_programs(before)
    graph = program.graph
    normed = [
        graph.nodes[n]
        for g in graph.groups
        for n in g.stored
        if graph.nodes[n].shape == (2, 6, 6, 8) and g.reduce_shape
    ]
    assert normed, [g.stored for g in graph.groups]
    for node in normed:
        assert node.buffer_stride == (288, 48, 8, 1), (node.name, node.stride)


class _ConvGroupNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 32, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


def test_a_group_norm_over_an_nhwc_map_walks_its_channels_innermost() -> None:
    """GroupNorm reduces (a group's 8 channels, the pixels) of an NHWC
    convolution result: the reduction's flat ``r`` walks the channels
    innermost, in the map's memory order (``templates._reduced_order``),
    so consecutive lanes read consecutive elements (walked in the
    reduction's logical order, each lane read one 32 channels from the
    next: scalar loads on sm_90 where they are now 128-bit).  It matches
    eager."""
    torch.manual_seed(0)
    model = _ConvGroupNorm().eval()
    x = torch.randn(2, 8, 16, 16)
    before = set(tilec.programs())
    assert_matches_eager(model, x, options={"layout": "channels_last", "freeze": True})
    (program,) = new_programs(before)
    (reduction,) = [
        s.kernel for s in program.launches() if s.kernel.template in ("persistent", "looped")
    ]
    lines = [line.strip() for line in reduction.source.splitlines()]
    assert "r0 = r % 8" in lines and "r1 = (r // 8)" in lines, reduction.source

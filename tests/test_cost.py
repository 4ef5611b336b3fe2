"""The cost model (compiler/cost.py) against figures worked out by hand."""

import dataclasses

import pytest
import torch

from tilec import cost
from tilec.gemm import gemm_config
from tilec.target import INTERPRETER, Figure, Target

H100 = Target.named("h100-sxm")


def test_wave_efficiency_counts_idle_sms_in_the_last_wave():
    assert cost.wave_efficiency(132, 132) == 1.0
    assert cost.wave_efficiency(264, 132) == 1.0
    assert cost.wave_efficiency(133, 132) == pytest.approx(133 / 264)
    assert cost.wave_efficiency(66, 132) == 0.5
    assert cost.output_tiles(4096, 4096, (128, 128)) == 32 * 32
    assert cost.output_tiles(1, 4096, (16, 64), batch=2) == 2 * 64
    assert cost.output_tiles(129, 128, (128, 128)) == 2


def test_a_large_gemm_is_compute_bound_and_the_template_slower_than_the_library():
    flops, nbytes = 2 * 4096**3, 3 * 4096 * 4096 * 2  # bf16 operands and result
    tiles = cost.output_tiles(4096, 4096, (128, 128))  # 1024 tiles: 7.76 waves
    library = cost.gemm(H100, flops, nbytes, torch.bfloat16, template=False)
    template = cost.gemm(H100, flops, nbytes, torch.bfloat16, template=True, tiles=tiles)
    efficiency = 1024 / (8 * 132)
    assert library.bound == template.bound == "compute"
    assert library.compute_s == pytest.approx(flops / 800e12)  # no wave loss assumed
    assert template.compute_s == pytest.approx(flops / (0.85 * 800e12) / efficiency)
    assert library.seconds == pytest.approx(library.compute_s + 2.5e-6)
    assert template.seconds > library.seconds


def test_a_decode_gemv_is_memory_bound():
    """One row against a 4096 x 4096 bf16 weight over 256 column tiles: the
    weight's 32 MiB over 3.0 TB/s, whatever the FLOP/s."""
    flops, nbytes = 2 * 4096 * 4096, 4096 * 4096 * 2
    tiles = cost.output_tiles(1, 4096, (16, 16))
    predicted = cost.gemm(H100, flops, nbytes, torch.bfloat16, template=True, tiles=tiles)
    assert predicted.bound == "memory"
    assert predicted.seconds == pytest.approx(nbytes / 3.0e12 + 2.5e-6)


def test_a_grid_smaller_than_the_sms_streams_at_its_share_of_the_bandwidth():
    """32 column tiles on 132 SMs: 32/132 of the copy bandwidth, for the
    template and for any kernel of 32 programs; the library fills the GPU."""
    flops, nbytes = 2 * 2048 * 2048, 2048 * 2048
    share = 32 / H100.sm_count
    template = cost.gemm(H100, flops, nbytes, torch.bfloat16, template=True, tiles=32)
    assert template.memory_s == pytest.approx(nbytes / 3.0e12 / share)
    assert cost.kernel(H100, nbytes, programs=32).memory_s == pytest.approx(template.memory_s)
    library = cost.gemm(H100, flops, nbytes, torch.bfloat16, template=False)
    assert library.memory_s == pytest.approx(nbytes / 3.0e12)
    assert cost.kernel(H100, nbytes, programs=1000).memory_s == library.memory_s
    assert cost.fill(None, H100.sm_count) == 1.0


def test_decode_tiles_fill_the_sms():
    """Few rows: the widest of 64 and 32 columns per tile whose tiles fill
    the 132 SMs, else 16."""
    width = lambda n: gemm_config(H100, 1, n, 2048, torch.bfloat16).block_n  # noqa: E731
    assert (width(32000), width(5632), width(2048), width(256)) == (64, 32, 16, 16)
    assert gemm_config(H100, 512, 2048, 2048, torch.bfloat16).block_n == 128


def test_operand_dtypes_pick_the_rate_and_tf32_is_the_targets_setting():
    flops = 2 * 2048**3
    fp32 = cost.gemm(H100, flops, 0, torch.float32, template=False)
    assert fp32.compute_s == pytest.approx(flops / 67e12)
    tf32 = cost.gemm(Target.named("h100-sxm", tf32=True), flops, 0, torch.float32, template=False)
    assert tf32.compute_s == pytest.approx(flops / 494.7e12)


def test_kernels_and_launches():
    small = cost.kernel(H100, 4096)
    assert small.bound == "launch" and small.seconds == pytest.approx(4096 / 3.0e12 + 2.5e-6)
    replayed = cost.kernel(H100, 4096, replayed=True)
    assert replayed.launch_s == 0.66e-6
    big = cost.kernel(H100, 3e12, flops=1e9)
    assert big.bound == "memory" and big.memory_s == pytest.approx(1.0)


def test_measured_figures_replace_assumed_ones_in_the_target():
    measured = dataclasses.replace(
        H100, memory_bandwidth=Figure(2.5e12, "measured", "a copy on this machine")
    )
    assert cost.kernel(measured, 2.5e12).memory_s == pytest.approx(1.0)


def test_the_interpreter_has_no_cost_model():
    assert cost.has_figures(H100) and not cost.has_figures(INTERPRETER)
    with pytest.raises(ValueError, match="no memory-bandwidth figure"):
        cost.kernel(INTERPRETER, 1024)


def test_a_k_loop_waits_one_round_trip_per_stages_in_flight() -> None:
    """The K-loop latency rule (``cost.k_loop_seconds``): one measured round
    trip per ``num_stages - 1`` steps, none without the figure; a thin GEMV
    with a long K loop is bound by it rather than by its bytes."""
    from tilec.target import H100_SXM

    trip = H100_SXM.round_trip_s.value
    assert cost.k_loop_seconds(H100_SXM, 8, 3) == pytest.approx(4 * trip)
    assert cost.k_loop_seconds(H100_SXM, 4, 4) == pytest.approx(2 * trip)
    assert cost.k_loop_seconds(INTERPRETER, 8, 3) == 0.0
    # 1 x 3072 @ 3072 x 768 in 12 tiles with steps of 64, 3 stages: the
    # measured template took 23.9 us on an H200; its 4.7 MB take 1.6 us.
    m, n, k = 1, 768, 3072
    nbytes = 2 * (m * k + k * n + m * n)
    thin = cost.gemm(
        H100_SXM, 2 * m * n * k, nbytes, torch.bfloat16, template=True, tiles=12, k_loop=(48, 3)
    )
    assert thin.bound == "latency" and thin.latency_s == pytest.approx(24 * trip)
    plain = cost.gemm(H100_SXM, 2 * m * n * k, nbytes, torch.bfloat16, template=True, tiles=12)
    assert plain.latency_s == 0.0 and plain.seconds < thin.seconds

"""The cost model (compiler/cost.py) against figures worked out by hand."""

import dataclasses

import pytest
import torch

from tilec import cost
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
    """One row against a 4096 x 4096 bf16 weight: the weight's 32 MiB over
    3.0 TB/s, whatever the FLOP/s."""
    flops, nbytes = 2 * 4096 * 4096, 4096 * 4096 * 2
    tiles = cost.output_tiles(1, 4096, (16, 64))
    predicted = cost.gemm(H100, flops, nbytes, torch.bfloat16, template=True, tiles=tiles)
    assert predicted.bound == "memory"
    assert predicted.seconds == pytest.approx(nbytes / 3.0e12 + 2.5e-6)


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
    assert replayed.launch_s == 1e-6
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

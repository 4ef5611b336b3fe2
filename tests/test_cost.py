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
    template and for any kernel of 32 programs; the library fills the GPU
    (a GEMV at the share of the bandwidth it was measured to reach)."""
    flops, nbytes = 2 * 2048 * 2048, 2048 * 2048
    share = 32 / H100.sm_count
    template = cost.gemm(H100, flops, nbytes, torch.bfloat16, template=True, tiles=32)
    assert template.memory_s == pytest.approx(nbytes / 3.0e12 / share)
    assert cost.kernel(H100, nbytes, programs=32).memory_s == pytest.approx(template.memory_s)
    library = cost.gemm(H100, flops, nbytes, torch.bfloat16, template=False)
    gemv = H100.library_few_row_share.value
    assert library.memory_s == pytest.approx(nbytes / 3.0e12 / gemv)
    assert cost.kernel(H100, nbytes, programs=1000).memory_s == pytest.approx(nbytes / 3.0e12)
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
    """The K-loop latency rule (``cost.k_loop_seconds``) for tiles of more
    than 16 rows: one measured round trip per ``num_stages - 1`` steps, none
    without the figure; a few-tile product with a long K loop is bound by
    it rather than by its bytes."""
    from tilec.target import H100_SXM

    trip = H100_SXM.round_trip_s.value
    assert cost.k_loop_seconds(H100_SXM, cost.KLoop(8, 3, 128)) == pytest.approx(4 * trip)
    assert cost.k_loop_seconds(H100_SXM, cost.KLoop(4, 4, 64)) == pytest.approx(2 * trip)
    assert cost.k_loop_seconds(INTERPRETER, cost.KLoop(8, 3, 128)) == 0.0
    # 512 x 3072 @ 3072 x 768 in 24 tiles of 128 x 128, steps of 64, 3
    # stages: measured 27.5 and 28.1 us on an H200 (two runs), 28.0 on an H100
    # (benchmarks/results/gpu/); its bytes take 4 us.
    m, n, k = 512, 768, 3072
    nbytes = 2 * (m * k + k * n + m * n)
    loop = cost.KLoop(48, 3, 128, resident=2)
    long = cost.gemm(
        H100_SXM, 2 * m * n * k, nbytes, torch.bfloat16, template=True, tiles=24, k_loop=loop
    )
    assert long.bound == "latency" and long.latency_s == pytest.approx(24 * trip)
    assert long.seconds == pytest.approx(28e-6, rel=0.1)
    plain = cost.gemm(H100_SXM, 2 * m * n * k, nbytes, torch.bfloat16, template=True, tiles=24)
    assert plain.latency_s == 0.0 and plain.seconds < long.seconds


def test_a_few_row_tile_takes_its_measured_step_time_per_wave() -> None:
    """Tiles of 16 rows (decode GEMVs) take ``few_row_step_s`` per K step
    whatever their stages, one wave after another, and stream their bytes
    at the share of the bandwidth each wave's programs reach.  Against the
    H200's measurements of TinyLlama's decode products as F.linear
    (benchmarks/results/gpu/2026-11-28-nvidia-h200/rerun/gemms.json):

    * 2048 x 5632 and 2048 x 2048 (128 tiles of 16 x 16, steps of 512, 8
      stages): 13.6 and 8.6 us; the 7 steps between them took 5.0 us;
    * 11264 x 2048 (176 tiles of 16 x 64, 4 stages): 22.2 us, 17 of them
      past a lone launch's 5.2 (the intercept of the one-wave rows): a
      second wave of 44 programs streams at a third of the bandwidth."""
    from tilec.target import H200

    step = H200.few_row_step_s.value
    assert cost.k_loop_seconds(H200, cost.KLoop(11, 8, 16)) == pytest.approx(11 * step)
    assert cost.k_loop_seconds(H200, cost.KLoop(11, 2, 16)) == pytest.approx(11 * step)

    def gemv(n: int, k: int, block_n: int, stages: int) -> cost.Prediction:
        tiles = n // block_n
        loop = cost.KLoop(k // 512, stages, 16)
        nbytes = 2 * (k + n * k + n)
        return cost.gemm(
            H200, 2 * n * k, nbytes, torch.bfloat16, template=True, tiles=tiles, k_loop=loop
        )

    long, short = gemv(2048, 5632, 16, 8), gemv(2048, 2048, 16, 8)
    assert long.bound == short.bound == "latency"
    assert long.seconds - short.seconds == pytest.approx(5.0e-6, rel=0.1)
    wide = gemv(11264, 2048, 64, 4)
    assert wide.bound == "memory" and wide.memory_s == pytest.approx(17e-6, rel=0.05)
    # Two waves of 16-column tiles: twice the loop.
    two = gemv(2560, 2048, 16, 8)
    assert two.latency_s == pytest.approx(2 * 4 * step)


def test_the_library_gemv_streams_at_its_measured_share() -> None:
    """cuBLAS at one row reached 0.62 of the H200's copy bandwidth (median of
    its 8 MB-or-more products, ``library_few_row_share``): the library's
    GEMV is priced so, a square product (compute-bound) is not; against the
    template, the measured order of TinyLlama's down projection (template
    13.6 us, cuBLAS 15.0) is kept."""
    from tilec.target import H200

    n, k = 2048, 5632
    flops, nbytes = 2 * n * k, 2 * (k + n * k + n)
    library = cost.gemm(H200, flops, nbytes, torch.bfloat16, template=False)
    share = H200.library_few_row_share.value
    assert library.memory_s == pytest.approx(cost.memory_seconds(H200, nbytes) / share)
    loop = cost.KLoop(k // 512, 8, 16)
    template = cost.gemm(
        H200, flops, nbytes, torch.bfloat16, template=True, tiles=n // 16, k_loop=loop
    )
    assert template.seconds < library.seconds
    square = 2 * 4096**3, 3 * 2 * 4096**2
    big = cost.gemm(H200, *square, torch.bfloat16, template=False)
    assert big.memory_s == pytest.approx(cost.memory_seconds(H200, square[1]))
    # A convolution of as few FLOPs a byte was not measured: the whole bandwidth.
    conv = cost.gemm(H200, flops, nbytes, torch.bfloat16, template=False, convolution=True)
    assert conv.memory_s == pytest.approx(cost.memory_seconds(H200, nbytes))


def test_a_decode_attentions_key_loop_takes_the_few_row_step_per_wave() -> None:
    """The attention template's loop over key blocks is priced as a GEMM
    template's K loop of the same rows (``cost.KEY_STEPS``): a decode
    row's 16-row tile walking 8 blocks of 64 keys takes 8 ``few_row_step_s``
    in one wave, twice that when its programs need two waves of the SMs'
    resident programs; without a loop, its rate and bytes alone."""
    from tilec.attention import AttentionConfig

    config = AttentionConfig(16, 64, 4, 3)
    # The q tile and 3 stages of 64 keys and 64 values, 2 bytes each: 52 KB.
    loop = config.key_loop(8, 64, 64, 2, H100)
    assert loop == cost.KLoop(8, 3, 16, H100.shared_memory_per_sm // (2 * (16 * 64 + 3 * 64 * 128)))
    step = H100.few_row_step_s.value
    flops, nbytes = 2 * 32 * 2048 * 128, 2 * 2 * 4 * 2048 * 64

    def predict(tiles: int, with_loop: bool = True) -> cost.Prediction:
        key_loop = loop if with_loop else None
        return cost.attention_template(H100, flops, nbytes, torch.bfloat16, tiles, key_loop)

    one_wave = H100.sm_count * loop.resident
    assert predict(128).latency_s == pytest.approx(8 * step)
    assert predict(one_wave).latency_s == pytest.approx(8 * step)
    assert predict(one_wave + 1).latency_s == pytest.approx(16 * step)
    assert predict(128).bound == "latency"
    assert predict(128, with_loop=False).latency_s == 0.0

"""The training step's static report (``python -m benchmarks.static --train``):
forward, backward and optimizer step compiled for the GPU target by tilec and
by Inductor, nothing run."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import static
from benchmarks.inductor_gpu import inductor_gpu_step
from benchmarks.zoo import MODELS


@pytest.mark.parametrize("count", [5, 60])
def test_inductor_optimizer_kernels_move_the_optimizers_bytes(count):
    """AdamW's foreach step in Inductor's combo kernels: each parameter's
    update reads the parameter, its gradient and both moments and writes
    three of them (28 bytes an element in float32), and each step counter
    is read and written by the count kernel and read by the update (12 bytes
    a parameter).  With 60 parameters the foreach node is partitioned into
    several combo kernels, each of which counts its own parts (it was
    "unknown": the node's count was not one kernel's)."""
    params = [torch.nn.Parameter(torch.randn(8 + i % 5, 16)) for i in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, foreach=True)
    optimizer.step()

    def run(backend):
        with torch.no_grad():
            torch.compile(optimizer.step, backend=backend)()

    report = inductor_gpu_step(run)
    numel = sum(p.numel() for p in params)
    assert report.bytes == 28 * numel + 12 * count
    assert (len(report.kernels) > 2) == (count == 60)


def test_training_step_compiles_forward_backward_and_optimizer_on_both_sides(tmp_path):
    out = tmp_path / "report"
    argv = ["--train", "--model", "mlp", "--jobs", "1", "--out", str(out)]
    assert static.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["train"] and "PREDICTIONS FROM STATIC ANALYSIS" in report["notice"]
    (mlp,) = report["results"]
    tilec = mlp["tilec"]
    # Every phase has kernels: 000_forward, 001_backward, 002_inference (the step).
    graphs = {k["graph"].split("_", 1)[1] for k in tilec["kernels"]}
    assert graphs == {"forward", "backward", "inference"}
    assert set(mlp["phases_s"]) == {"forward", "backward", "optimizer"}
    assert sum(mlp["phases_s"].values()) == pytest.approx(mlp["tilec_predicted_s"])
    # Three linear layers: three matmuls forward, five backward (no input
    # gradient for the first layer), all library calls or templates.
    matmuls = len(tilec["library_calls"]) + len(tilec["templated_matmuls"])
    assert matmuls == 8
    assert not tilec["fallbacks"] and not tilec["failed_compiles"]
    saved = mlp["activations"]
    assert 0 < saved["saved_bytes"] <= saved["save_all_bytes"]
    inductor = mlp["inductor"]
    assert inductor["kernel_bytes"] is not None and inductor["launches"] > 0
    assert mlp["ratio"] == pytest.approx(mlp["tilec_predicted_s"] / mlp["inductor_predicted_s"])
    text = (out / "report.md").read_text()
    assert (
        "training step" in text and "| mlp | " in text and "forward / backward / optimizer" in text
    )


def test_dropout_training_step_prices_the_seed_draw():
    """A GPT-2 step with dropout: tilec draws one seed per forward (a library
    call without operands or FLOPs, priced as a launch), falls back on
    nothing, and the backward recomputes part of the forward."""
    torch.manual_seed(0)
    model = MODELS["gpt2"].build("tiny").model.train()
    inputs = MODELS["gpt2"].inputs("tiny", 2, torch.Generator().manual_seed(0))
    captured, splits = static.tilec_step(static.training_step(model, inputs))
    side = static.tilec_side(captured, jobs=1)
    assert not side["fallbacks"]
    seeds = [c for c in side["library_calls"] if "draw_seed" in c["op"]]
    assert len(seeds) == 1 and seeds[0]["flops"] == 0
    (seed,) = static.library_predictions(seeds)
    assert seed.seconds == pytest.approx(static.CONSTANTS["launch_s"][0], rel=0.01)
    (split,) = splits
    assert split.recomputed and split.saved_bytes < split.save_all_bytes

"""Small random-initialised models compiled with tilec, compared with eager.

GPT-2, BERT and LLaMA come from ``transformers`` configs (no download); the
MLP and CNN are defined here.  Sizes are tiny because kernels run in the
Triton interpreter on CPU, but every layer type of the real models is there.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tilec
from tests.compare import assert_matches_eager
from tests.lowering import new_programs, run_time_constants

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 100, 64, 2, 4, 16, 2


def _ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seq))


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _assert_compiled_without_fallbacks() -> None:
    s = tilec.stats()
    assert s["graphs"] >= 1 and s["kernels"] > 0 and s["extern_calls"] > 0
    assert s["fallbacks"] == {}


def test_gpt2_logits():
    torch.manual_seed(0)
    model = _gpt2()
    assert_matches_eager(lambda ids: model(ids).logits, _ids())
    _assert_compiled_without_fallbacks()


def test_bert_last_hidden_state():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN,
        max_position_embeddings=64,
    )
    model = transformers.BertModel(config).eval()
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, SEQ - 5 :] = 0  # a padded second sequence exercises the attention mask
    assert_matches_eager(
        lambda ids, mask: model(ids, attention_mask=mask).last_hidden_state, ids, mask
    )
    _assert_compiled_without_fallbacks()


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_llama_logits():
    torch.manual_seed(0)
    model = _llama()
    assert_matches_eager(lambda ids: model(ids).logits, _ids())
    _assert_compiled_without_fallbacks()


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_frozen_transformers_compute_no_constant_at_run_time(build) -> None:
    torch.manual_seed(0)
    model = build()
    before = set(tilec.programs())
    assert_matches_eager(lambda ids: model(ids).logits, _ids(), options={"freeze": True})
    (program,) = new_programs(before)
    assert len(program.graph.inputs) == 1  # the token ids; every weight is a constant
    assert run_time_constants(program.graph) == []
    _assert_compiled_without_fallbacks()


def test_gpt2_dynamic_sequence_lengths(tmp_path):
    """Six sequence lengths, three specializations kept: the first three
    lengths get specialized programs, the other three run the generic one."""
    torch.manual_seed(0)
    model = _gpt2()
    compiled = torch.compile(
        lambda ids: model(ids).logits,
        backend="tilec",
        dynamic=True,
        options={"dump": str(tmp_path), "max_specializations": 3, "specialize": "first"},
    )
    lengths = (5, 11, 16, 3, 24, 7)
    with torch.no_grad():
        for seq in (*lengths, *lengths[::-1]):  # each length twice: the second is a hit
            ids = _ids(seq)
            torch.testing.assert_close(compiled(ids), model(ids).logits, atol=1e-4, rtol=1e-4)
    # Three specialized programs and one generic, all from compiled kernels.
    assert tilec.stats()["graphs"] == 4
    _assert_compiled_without_fallbacks()
    variants = {d.name: (d / "guards.txt").read_text().splitlines() for d in tmp_path.iterdir()}
    (generic,) = [name for name in variants if name.endswith("_generic")]
    assert [g for g in variants.pop(generic) if g.endswith(">= 2")]
    # Some size symbol is guarded at exactly the first three lengths, one per variant.
    values: dict[str, set[int]] = {}
    for lines in variants.values():
        for symbol, value in (line.split(" == ") for line in lines):
            values.setdefault(symbol, set()).add(int(value))
    assert set(lengths[:3]) in values.values(), values


def test_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.SiLU(),
        nn.LayerNorm(64),
        nn.Linear(64, 10),
    ).eval()
    assert_matches_eager(model, torch.randn(8, 32))
    _assert_compiled_without_fallbacks()


class SmallCNN(nn.Module):
    """conv-bn-relu-pool twice, then a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def test_small_cnn():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    # Non-trivial running statistics, so eval-mode batch norm is not an identity.
    for bn in (model.features[1], model.features[5]):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    assert_matches_eager(model, torch.randn(2, 3, 16, 16))
    s = tilec.stats()
    assert s["kernels"] > 0
    assert s["extern_calls"] >= 3  # two convolutions and the linear layer


def test_small_cnn_trains_like_eager():
    torch.manual_seed(0)
    model = SmallCNN()  # training mode: batch norm uses batch statistics
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    grads = []
    for backend in ("eager", "tilec"):
        torch._dynamo.reset()
        for p in (*model.parameters(), x):
            p.grad = None
        torch.compile(model, backend=backend)(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in (*model.parameters(), x)])
    for actual, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    s = tilec.stats()
    # Convolutions forward and backward are library calls; nothing falls back.
    assert not s["fallbacks"]
    assert s["extern_calls"] >= 5


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_transformers_with_every_matmul_a_gemm_template(build) -> None:
    """``matmul="triton"``: every linear layer and attention product is a
    GEMM kernel with what fuses into it; only attention calls remain."""
    torch.manual_seed(0)
    model = build()
    before = set(tilec.programs())
    assert_matches_eager(lambda ids: model(ids).logits, _ids(), options={"matmul": "triton"})
    (program,) = new_programs(before)
    templates = [step.kernel.template for step in program.launches()]
    assert templates.count("gemm") >= 4 * LAYERS
    library = {str(n.extern.target) for n in program.graph.nodes.values() if n.kind == "extern"}
    assert not any("mm" in op for op in library), library
    assert tilec.stats()["fallbacks"] == {}


def test_mlp_trains_like_eager_with_gemm_templates():
    """Forward and backward (AOTAutograd's transposed products) as templates."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 8))
    x = torch.randn(6, 24, requires_grad=True)
    grads = []
    for backend, options in (("eager", None), ("tilec", {"matmul": "triton"})):
        torch._dynamo.reset()
        for p in (*model.parameters(), x):
            p.grad = None
        compiled = torch.compile(model, backend=backend, options=options)
        compiled(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in (*model.parameters(), x)])
    for actual, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    assert tilec.stats()["extern_calls"] == 0


def test_the_model_sweep_compares_transformers_architectures(capsys):
    """``tests/model_sweep.py``: Falcon's forward (a constant index failed
    its compile once), DeiT's gradients (its pooler gets none in eager,
    zeros through a compiled graph), Gemma's greedy generation under
    ``reduce-overhead`` with SDPA attention (transformers' default; BLOOM,
    which has none, is not compared), two Qwen2 training steps (smooth
    activations: a ReLU network's steps can flip a mask where a residual
    sum rounds to about zero, docs/architecture.md), two Phi-3 training
    steps captured and replayed (the layout of the chunks its forward
    saves) and ALBERT's gradients from replayed graphs (the expanded token
    types its forward saves; compared from a replay, not the warm-up) pass;
    an unknown model type is refused."""
    from tests.model_sweep import main

    assert main(["--models", "falcon", "--mode", "forward"]) == 0
    assert main(["--models", "deit", "--mode", "grad"]) == 0
    assert main(["--models", "gemma,bloom", "--mode", "generate", "--attention", "sdpa"]) == 0
    assert main(["--models", "qwen2", "--mode", "train"]) == 0
    assert main(["--models", "phi3", "--mode", "train", "--cudagraphs"]) == 0
    assert main(["--models", "albert", "--mode", "grad", "--cudagraphs"]) == 0
    out, progress = capsys.readouterr()
    assert "albert: pass" in progress and "2 of 2 programs replayed a graph" in progress
    assert "Model sweep (forward, eager attention, float32, CPU" in out and "1/1 models pass" in out
    assert "Model sweep (grad, eager attention, float32, CPU" in out
    assert "Model sweep (generate, sdpa attention, float32, CPU" in out
    assert "1/2 models pass, 1 not compared" in out
    assert "bloom: not compared: transformers has no sdpa attention for bloom" in out
    assert "Model sweep (train, eager attention, float32, CPU" in out
    assert "Model sweep (train, eager attention, graph capture, float32, CPU" in out
    with pytest.raises(SystemExit):
        main(["--models", "no_such_model"])


def test_the_model_sweeps_error_counts_nan_and_infinity():
    """A NaN where eager has a number is an infinite error (a NaN error
    would drop out of ``max`` and pass); infinities or NaNs where eager has
    the same count nothing, and the scale is eager's largest finite value."""
    from tests.model_sweep import _relative

    expected = torch.tensor([1.0, -float("inf"), 4.0, float("nan")])
    assert _relative(expected.clone(), expected) == 0.0
    assert _relative(torch.tensor([1.0, -float("inf"), 5.0, float("nan")]), expected) == 0.25
    assert _relative(torch.tensor([float("nan"), -float("inf"), 4.0, float("nan")]), expected) == (
        float("inf")
    )
    assert _relative(torch.tensor([1.0, 0.0, 4.0, float("nan")]), expected) == float("inf")


def test_a_training_failure_in_float32_is_judged_again_in_float64():
    """``model_sweep.in_float64``: a float32 judgement past the tolerance
    (chaotic rounding) is replaced by tilec's float64 steps against
    eager's, which a right program passes and a wrong one still fails;
    a passing float32 judgement is kept as it is."""
    from tests.model_sweep import FLOAT64, TOLERANCE, in_float64

    model = torch.nn.Linear(8, 4)
    x = {"input": torch.randn(3, 8)}

    def steps(run, module, x):
        return {"out": run(**x).detach()}

    def wrong_when_compiled(run, module, x):
        out = run(**x).detach()
        return {"out": out if run is module else out + 1e-2 * out.abs().max()}

    kept = (1e-6, "somewhere")
    assert in_float64(kept, steps, model, x) == kept
    float32 = (0.5, "gradient of w: against float64 1e-1, eager 1e-3")
    error, where = in_float64(float32, steps, model, x)
    assert error <= TOLERANCE and where.startswith(FLOAT64) and where.endswith(float32[1])
    error, where = in_float64(float32, wrong_when_compiled, model, x)
    assert error > TOLERANCE and where.startswith(FLOAT64)

"""Mixture-of-experts models (transformers' Mixtral and Qwen2-MoE, tiny
configurations): inference and a training step match eager, the routing's
counting ops (``cumsum``, ``histc``) and its allocations lower instead of
falling back, and a bf16 decode step, whose fallbacks are all device work,
is captured under ``reduce-overhead``."""

from __future__ import annotations

import pytest
import torch

import tilec
from benchmarks.zoo import Logits
from tests.compare import assert_matches_eager

transformers = pytest.importorskip("transformers")

# Ops of the routing that tilec lowers (they fell back: 2 cumsum, 2 histc
# and 2 empty_permuted per inference graph of a 2-layer model).
LOWERED = {"aten.cumsum.default", "aten.histc.default", "aten.empty_permuted.default"}


def _moe(name: str) -> torch.nn.Module:
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    if name == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    return Logits(model, ("input_ids",), "logits")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_inference_matches_eager_with_routing_lowered(name):
    torch.manual_seed(0)
    model = _moe(name).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    tilec.reset_stats()
    assert_matches_eager(model, ids, atol=1e-4, rtol=1e-4)
    stats = tilec.stats()
    assert stats["graphs"] == 1 and stats["kernels"] > 0
    assert not LOWERED & set(stats["fallbacks"]), stats["fallbacks"]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_training_step_gradients_match_eager(name):
    torch.manual_seed(0)
    model = _moe(name).train()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return model(ids).float().pow(2).mean()

    expected = torch.autograd.grad(loss(ids), list(model.parameters()), allow_unused=True)
    torch._dynamo.reset()
    tilec.reset_stats()
    compiled = torch.compile(loss, backend="tilec")
    actual = torch.autograd.grad(compiled(ids), list(model.parameters()), allow_unused=True)
    for (pname, _), a, e in zip(model.named_parameters(), actual, expected):
        if e is None:
            assert a is None or not a.any(), pname
            continue
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4, msg=pname)
    stats = tilec.stats()
    assert stats["graphs"] == 2 and stats["kernels"] > 0  # forward and backward
    assert not LOWERED & set(stats["fallbacks"]), stats["fallbacks"]


def test_a_bf16_moe_decode_step_is_captured_and_matches_eager():
    """In bf16 transformers routes the experts through ``torch._grouped_mm``;
    with the router's ``topk`` and ``sort``, three ATen fallbacks that are
    all device work: ``reduce-overhead`` captures the decode step and
    replays it (the CPU stand-in), with eager's tokens."""
    from tilec.pipeline import programs

    torch.manual_seed(0)
    model = _moe("mixtral").model.eval().to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    options = dict(
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )
    with torch.no_grad():
        expected = model.generate(ids, **options)
        before = set(programs())
        model.forward = torch.compile(model.forward, backend="tilec", mode="reduce-overhead")
        actual = model.generate(ids, **options)
    assert torch.equal(actual, expected)
    assert set(tilec.stats()["fallbacks"]) == {
        "aten.topk.default",
        "aten.sort.default",
        "aten._grouped_mm.default",
    }
    new = [p for name, p in programs().items() if name not in before]
    decode = [p for p in new if p.graph.mutations]
    assert decode and all(p.cudagraphs.startswith("captured") for p in decode)
    assert max(p.executor.replays for p in decode) >= 4
    del new, decode

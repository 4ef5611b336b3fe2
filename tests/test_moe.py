"""Mixture-of-experts models (transformers' Mixtral and Qwen2-MoE, tiny
configurations): inference and a training step match eager, and the routing's
counting ops (``cumsum``, ``histc``) and its allocations lower instead of
falling back."""

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

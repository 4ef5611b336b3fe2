"""The model zoo: twelve random-initialised models, each at two sizes.

``full`` is the realistic size for GPU runs; ``tiny`` keeps every layer type
but is small enough for the Triton interpreter on a CPU.  Transformer models
come from ``transformers`` configs (no download).  Vision models use
torchvision's or timm's classes where those import (the GPU machine) at full
size, and the project's own definitions (``benchmarks/vision.py``) otherwise;
each built model says which definition ran (``source``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from benchmarks import vision

Inputs = tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Built:
    model: nn.Module
    source: str  # which definition ran: "transformers", "torchvision", "timm" or "tilec"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``build(size)`` makes the model; ``inputs(size, batch, generator)`` its
    float32 / int64 inputs on the CPU."""

    name: str
    build: Callable[[str], Built]
    inputs: Callable[[str, int, torch.Generator], Inputs]


class Logits(nn.Module):
    """A transformers model called with positional tensors, returning one tensor."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...], field: str) -> None:
        super().__init__()
        self.model, self.keys, self.field = model, keys, field

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(**dict(zip(self.keys, tensors))), self.field)


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None and bool(__import__(module))
    except Exception:  # torchvision beside a CPU torch build fails at import
        return False


def _images(pixels: dict[str, int]) -> Callable[[str, int, torch.Generator], Inputs]:
    def make(size: str, batch: int, gen: torch.Generator) -> Inputs:
        side = pixels[size]
        return (torch.randn(batch, 3, side, side, generator=gen),)

    return make


def _tokens(lengths: dict[str, int], vocab: dict[str, int], count: int = 1):
    def make(size: str, batch: int, gen: torch.Generator) -> Inputs:
        shape = (batch, lengths[size])
        return tuple(torch.randint(0, vocab[size], shape, generator=gen) for _ in range(count))

    return make


def _vision(own: Callable[[str], nn.Module], library: Callable[[], nn.Module] | None, lib: str):
    """torchvision/timm at full size where it imports, the own definition otherwise."""

    def build(size: str) -> Built:
        if size == "full" and library is not None and _has(lib):
            return Built(library(), lib)
        return Built(own(size), "tilec")

    return build


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(weights=None)

    return make


# ---------------------------------------------------------- transformers


def _transformer(
    model_class: str, config_class: str, tiny: dict, full: dict, keys: tuple[str, ...], field: str
) -> Callable[[str], Built]:
    """A ``transformers`` model from a config (random weights, no download)."""

    def build(size: str) -> Built:
        import transformers

        config = getattr(transformers, config_class)(**(tiny if size == "tiny" else full))
        model = getattr(transformers, model_class)(config)
        return Built(Logits(model, keys, field), "transformers")

    return build


_gpt2 = _transformer(
    "GPT2LMHeadModel",
    "GPT2Config",
    dict(
        vocab_size=128,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    ),
    dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    ("input_ids",),
    "logits",
)
_bert = _transformer(
    "BertModel",
    "BertConfig",
    dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=256, max_position_embeddings=64),
    dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
         intermediate_size=3072, max_position_embeddings=512),
    ("input_ids",),
    "last_hidden_state",
)  # fmt: skip
# RMSNorm, rotary embeddings, SwiGLU and grouped-query attention (TinyLlama's shape).
_llama = _transformer(
    "LlamaForCausalLM",
    "LlamaConfig",
    dict(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
    ("input_ids",),
    "logits",
)  # fmt: skip
_t5 = _transformer(
    "T5ForConditionalGeneration",
    "T5Config",
    dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
         decoder_start_token_id=0),
    dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
         decoder_start_token_id=0),
    ("input_ids", "decoder_input_ids"),
    "logits",
)  # fmt: skip


# ------------------------------------------------------------------- others


class MLP(nn.Module):
    def __init__(self, dims: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.LayerNorm(b), nn.GELU()]
        self.body = nn.Sequential(*layers[:-2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class WithFallbacks(nn.Module):
    """An MLP with ops tilec does not lower natively in the middle (sort,
    top-k, and at full size cumsum, over 4096 elements: tilec lowers it up
    to 1024), so the ATen fallback path is measured too."""

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.inp, self.out, self.k = nn.Linear(dim, dim), nn.Linear(k, dim), k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cumsum(torch.relu(self.inp(x)), -1)
        top = torch.topk(h, self.k, -1).values
        return self.out(torch.sort(top, -1).values.softmax(-1))


class UNetInput(nn.Module):
    """The UNet block with its timestep embedding made from a per-sample time."""

    def __init__(self, channels: int, time_dim: int, groups: int) -> None:
        super().__init__()
        self.block = vision.UNetBlock(channels, time_dim, groups)
        self.time_dim = time_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.mean((1, 2, 3))[:, None] * torch.arange(self.time_dim, device=x.device)
        return self.block(x, torch.sin(t))


def _unet_inputs(size: str, batch: int, gen: torch.Generator) -> Inputs:
    c, side = (32, 8) if size == "tiny" else (512, 32)
    return (torch.randn(batch, c, side, side, generator=gen),)


def _dims(size: str) -> tuple[int, ...]:
    return (32, 64, 64, 10) if size == "tiny" else (1024, 4096, 4096, 1000)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            "mlp",
            lambda size: Built(MLP(_dims(size)), "tilec"),
            lambda size, batch, gen: (torch.randn(batch, _dims(size)[0], generator=gen),),
        ),
        ModelSpec(
            "resnet18",
            _vision(
                lambda s: vision.ResNet((2, 2, 2, 2), False, 64 if s == "full" else 8),
                _torchvision("resnet18"),
                "torchvision",
            ),
            _images({"tiny": 32, "full": 224}),
        ),
        ModelSpec(
            "resnet50",
            _vision(
                lambda s: vision.ResNet((3, 4, 6, 3), True, 64 if s == "full" else 4),
                _torchvision("resnet50"),
                "torchvision",
            ),
            _images({"tiny": 32, "full": 224}),
        ),
        ModelSpec(
            "mobilenet_v3",
            _vision(
                lambda s: vision.MobileNetV3(1.0 if s == "full" else 0.25),
                _torchvision("mobilenet_v3_small"),
                "torchvision",
            ),
            _images({"tiny": 32, "full": 224}),
        ),
        ModelSpec(
            "convnext_t",
            _vision(
                lambda s: vision.ConvNeXt(
                    (3, 3, 9, 3) if s == "full" else (1, 1, 1, 1),
                    (96, 192, 384, 768) if s == "full" else (8, 16, 16, 32),
                ),
                _torchvision("convnext_tiny"),
                "torchvision",
            ),
            _images({"tiny": 32, "full": 224}),
        ),
        ModelSpec(
            "vit_b16",
            _vision(
                lambda s: (
                    vision.ViT(224, 16, 768, 12, 12) if s == "full" else vision.ViT(32, 8, 32, 2, 4)
                ),
                _torchvision("vit_b_16"),
                "torchvision",
            ),
            _images({"tiny": 32, "full": 224}),
        ),
        ModelSpec("bert", _bert, _tokens({"tiny": 16, "full": 512}, {"tiny": 128, "full": 30522})),
        ModelSpec("gpt2", _gpt2, _tokens({"tiny": 16, "full": 1024}, {"tiny": 128, "full": 50257})),
        ModelSpec(
            "llama", _llama, _tokens({"tiny": 16, "full": 1024}, {"tiny": 128, "full": 32000})
        ),
        ModelSpec(
            "t5", _t5, _tokens({"tiny": 16, "full": 512}, {"tiny": 128, "full": 32128}, count=2)
        ),
        ModelSpec(
            "unet_block",
            lambda size: Built(
                UNetInput(*((32, 16, 8) if size == "tiny" else (512, 1280, 32))), "tilec"
            ),
            _unet_inputs,
        ),
        ModelSpec(
            "with_fallbacks",
            lambda size: Built(
                WithFallbacks(*((32, 8) if size == "tiny" else (4096, 256))), "tilec"
            ),
            lambda size, batch, gen: (
                torch.randn(batch, 32 if size == "tiny" else 4096, generator=gen),
            ),
        ),
    ]
}

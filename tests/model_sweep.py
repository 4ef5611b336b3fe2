"""Model sweep: transformers' architectures, tiny and random, through tilec.

    python tests/model_sweep.py [--models falcon,bloom,...]
        [--mode forward|grad|dynamic|train|generate] [--attention eager|sdpa] [--cudagraphs]
        [--chain]

Each architecture is built from its transformers config with every size
made tiny (hidden 64, 2 layers, 4 heads, vocabulary 128; no download),
float32 on the CPU, and compared with eager:

* ``forward``: the main output (logits or last hidden state), no grad;
* ``grad``: every parameter's gradient of that output weighted by fixed
  random numbers, through tilec's backward graph;
* ``dynamic``: ``dynamic=True``, three sequence lengths through one
  compiled model (text models only);
* ``train``: two training steps in train mode (dropout and stochastic depth
  off, so both sides compute the same function; BatchNorm on batch
  statistics, writing its running ones), each a backward of the weighted
  output and an SGD step, from the same weights: the gradients of the
  second step and the parameters and buffers after it.  Where those differ
  by more than the tolerance, each is judged against the same steps in
  float64: the error is how far tilec's exceeds twice eager's float32 one;
  a model still failing is run again in float64, tilec against eager
  (:func:`in_float64`), and reported as passing "in float64" there;
* ``generate``: greedy ``generate`` of :data:`NEW_TOKENS` tokens with the
  forward compiled under ``reduce-overhead`` (decoders only), with a static
  KV cache where the model can compile one (``_can_compile_fullgraph``),
  else its default cache: the tokens must be eager's, and each step's
  logits are compared as outputs are.

A model passes when its worst error, relative to the largest magnitude of
eager's tensor, is under ``TOLERANCE``.  A gradient that is zero in exact
arithmetic (a key projection's bias: softmax ignores a shift shared by a
row) is rounding noise on both sides, so each gradient is measured against
at least a thousandth of the model's largest.  A model whose eager output
is all but zero (MobileNetV2's and EfficientNet's random initialisation
vanishes) is reported as not compared, not as passing.  Fallbacks are
listed.  The
OpInfo sweep (``tests/opinfo_sweep.py``) checks ops one at a time; this
checks them as real models combine them (it found Falcon's constant index,
``tests/test_bounds.py``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import sys
import time
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_map

import tilec
from tilec.pipeline import programs

TOLERANCE = 1e-4
# Below this largest magnitude eager's output compares nothing (:class:`Vacuous`).
VACUOUS = 1e-6

# Every size a config may name, made tiny; a config takes the ones its
# constructor (or attribute map) knows.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "head_dim": 16,
    "d_model": 64,
    "d_ff": 128,
    "d_kv": 16,
    "num_layers": 2,
    "num_heads": 4,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
    "n_inner": 128,
    "embed_dim": 64,
    "ffn_dim": 128,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "sliding_window": 8,
    "rotary_dim": 8,
    "partial_rotary_factor": 0.5,
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
    "hidden_sizes": [16, 32, 64, 64],
    "depths": [1, 1, 1, 1],
    "embedding_size": 16,
    "num_mel_bins": 16,
    "max_source_positions": 32,
    "max_target_positions": 32,
    "conv_dim": (16, 16),
    "conv_stride": (5, 2),
    "conv_kernel": (10, 3),
    "num_conv_pos_embeddings": 8,
    "num_conv_pos_embedding_groups": 4,
    "num_feat_extract_layers": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
}
# Sizes some architectures need other than TINY's (a transformer's vision
# configs have no per-stage lists).
OVERRIDES: dict[str, dict[str, Any]] = {
    "deit": {"hidden_sizes": None, "depths": None},
    "beit": {"hidden_sizes": None, "depths": None},
    "dinov2": {"hidden_sizes": None, "depths": None},
}

# model type -> transformers' auto class that builds it.
MODELS: dict[str, str] = {
    **dict.fromkeys(
        "qwen2 qwen3 gemma gemma2 gemma3_text phi phi3 gpt_neox gptj falcon bloom opt "
        "gpt_bigcode codegen stablelm olmo olmo2 starcoder2 mixtral qwen2_moe mpt xglm "
        "biogpt cohere granite".split(),
        "AutoModelForCausalLM",
    ),
    **dict.fromkeys(
        "roberta distilbert albert electra deberta-v2 deberta mpnet convbert xlm-roberta".split(),
        "AutoModelForMaskedLM",
    ),
    **dict.fromkeys("bart mbart pegasus marian mt5 longt5".split(), "AutoModelForSeq2SeqLM"),
    **dict.fromkeys(
        "resnet regnet beit poolformer".split(),
        "AutoModelForImageClassification",
    ),
    **dict.fromkeys(
        "mobilenet_v2 efficientnet deit dinov2 whisper wav2vec2 hubert".split(), "AutoModel"
    ),
}
# Config probabilities of what a model draws at random in train mode:
# dropout (``*dropout*``, GPT-2-style ``*_pdrop``), stochastic depth
# (``drop_path_rate``), LayerDrop, SpecAugment's masks (wav2vec2).
RANDOM_IN_TRAINING = ("drop", "mask_time_prob", "mask_feature_prob")
SEQ = 12
NEW_TOKENS = 8


@dataclasses.dataclass
class ModelResult:
    name: str
    error: float | None = None  # worst relative error (None: it raised)
    where: str = ""  # the output or parameter of the worst error, or the exception
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    vacuous: bool = False  # nothing compared (NotCompared: why, in ``where``)

    @property
    def passed(self) -> bool:
        return self.error is not None and self.error <= TOLERANCE


def build(kind: str, training: bool = False, attention: str = "eager") -> torch.nn.Module:
    """Model type ``kind``, tiny (:data:`TINY`), random, in eval mode; or in
    train mode with every probability of :data:`RANDOM_IN_TRAINING` 0.
    ``attention``: transformers' ``attn_implementation`` (``eager``: the
    softmax spelled out; ``sdpa``, transformers' default where a model has
    it: ``scaled_dot_product_attention`` with the model's mask)."""
    import transformers

    cls = type(transformers.AutoConfig.for_model(kind))
    known = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {}))
    sizes = {k: v for k, v in {**TINY, **OVERRIDES.get(kind, {})}.items() if v is not None}
    config = transformers.AutoConfig.for_model(
        kind, attn_implementation=attention, **{k: v for k, v in sizes.items() if k in known}
    )
    if training:
        for name, value in config.to_dict().items():
            if isinstance(value, float) and any(word in name for word in RANDOM_IN_TRAINING):
                setattr(config, name, 0.0)
    auto = getattr(transformers, MODELS[kind])
    if attention == "sdpa" and not auto._model_mapping[type(config)]._supports_sdpa:
        raise NotCompared(f"transformers has no sdpa attention for {kind}")
    torch.manual_seed(0)
    model = auto.from_config(config)
    if not training:
        return model.eval()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def inputs(
    model: torch.nn.Module, seq: int = SEQ, batch: int = 2, image: int = 32
) -> dict[str, torch.Tensor]:
    """A batch for ``model``'s forward: images, audio features, waveforms or
    token ids (and decoder ids for an encoder-decoder)."""
    gen = torch.Generator().manual_seed(seq)
    names = inspect.signature(model.forward).parameters
    if "pixel_values" in names:
        return {"pixel_values": torch.randn(batch, 3, image, image, generator=gen)}
    if "input_features" in names:
        return {
            "input_features": torch.randn(batch, 16, 64, generator=gen),
            "decoder_input_ids": torch.randint(1, 100, (batch, 4), generator=gen),
        }
    if "input_values" in names:
        return {"input_values": torch.randn(batch, 800, generator=gen)}
    ids = {"input_ids": torch.randint(1, 100, (batch, seq), generator=gen)}
    if getattr(model.config, "is_encoder_decoder", False):
        ids["decoder_input_ids"] = torch.randint(1, 100, (batch, 5), generator=gen)
    return ids


def main_output(out: Any) -> torch.Tensor:
    for key in ("logits", "last_hidden_state"):
        value = out.get(key) if isinstance(out, dict) else None
        if value is not None:
            return value
    return out[0]


class NotCompared(Exception):
    """The model has nothing to compare in this sweep (the reason is the message)."""


class Vacuous(NotCompared):
    """Eager's output is all (nearly) zero: the comparison would show nothing
    (the random initialisation of MobileNetV2 and EfficientNet vanishes)."""


def _relative(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """The largest difference over eager's largest finite magnitude (at
    least ``floor``).  Equal values (infinities, NaNs) differ by nothing; a
    NaN or infinity where eager has another value is an infinite error, so
    that ``max`` over results never drops it as a NaN would be."""
    finite = expected[expected.isfinite()]
    largest = finite.abs().max().item() if finite.numel() else 0.0
    if max(largest, floor) < VACUOUS:
        raise Vacuous(f"eager's largest magnitude is {largest:.1e}")
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    difference = torch.where(same, 0.0, (actual - expected).abs())
    difference = difference.nan_to_num(nan=float("inf"), posinf=float("inf"))
    return difference.max().item() / max(largest, floor)


# tilec's options for every compile of the sweep but generate's (which runs
# under ``reduce-overhead``); ``--cudagraphs`` sets {"cudagraphs": True}.
OPTIONS: dict[str, Any] = {}
# Calls of a compiled model a forward or gradient check makes under
# ``--cudagraphs``: the first runs eagerly (the warm-up), the second
# captures, the third replays; the last call's result is compared.
GRAPH_CALLS = 3


def graph_calls() -> int:
    """How many times a check calls the compiled model it compares once."""
    return GRAPH_CALLS if OPTIONS.get("cudagraphs") else 1


def replayed(before: set[int]) -> str:
    """How many of the programs compiled since ``before`` (ids of the
    programs then) replayed a graph: a sweep under ``--cudagraphs`` whose
    programs never replayed compared only eager runs of them."""
    new = [p for p in programs().values() if id(p) not in before]
    count = 0
    for program in new:
        executor = program.executor
        graphs = getattr(executor, "graphs", None)  # a BucketExecutor's, by bucket
        executors = [executor] if graphs is None else list(graphs.values())
        count += any(getattr(e, "replays", 0) for e in executors)
    return f"{count} of {len(new)} programs replayed a graph"


def _tilec(model: Any, **kwargs: Any) -> Any:
    return torch.compile(model, backend="tilec", options=dict(OPTIONS) or None, **kwargs)


def _forward(model: torch.nn.Module) -> tuple[float, str]:
    x = inputs(model)
    compiled = _tilec(model)
    with torch.no_grad():
        expected = main_output(model(**x))
        for _ in range(graph_calls()):
            actual = main_output(compiled(**x))
    return _relative(actual, expected), "output"


def _grad(model: torch.nn.Module) -> tuple[float, str]:
    x = inputs(model)
    grads = []
    for compiled in (False, True):
        run = _tilec(model) if compiled else model
        for _ in range(graph_calls() if compiled else 1):
            model.zero_grad(set_to_none=True)
            out = main_output(run(**x))
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
            (out * weights).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    expected, actual = grads
    # A parameter that reaches only an output nobody differentiates (DeiT's
    # pooler) has no gradient in eager and zeros through any compiled
    # graph (AOTAutograd's; aot_eager and Inductor alike): compared as zeros.
    params = dict(model.named_parameters())
    for grads_of in (expected, actual):
        for name in set(expected) | set(actual):
            grads_of.setdefault(name, torch.zeros_like(params[name]))
    largest = max(g.abs().max().item() for g in expected.values())
    return max((_relative(actual[n], g, 1e-3 * largest), n) for n, g in expected.items())


def _dynamic(model: torch.nn.Module) -> tuple[float, str]:
    compiled = _tilec(model, dynamic=True)
    errors = []
    for seq in (SEQ, 9, 7):
        x = inputs(model, seq)
        with torch.no_grad():
            errors.append((_relative(main_output(compiled(**x)), main_output(model(**x))), seq))
    error, seq = max(errors)
    return error, f"sequence length {seq}"


def _train(model: torch.nn.Module) -> tuple[float, str]:
    # BatchNorm on batch statistics over 2 tiny images normalizes a few
    # values per channel (a ResNet's last stage: one pixel each), where
    # float32 rounding of either side grows past any tolerance: 8 images of
    # 64 x 64 (4 left MobileNetV2 5e-4 off float64 on both sides after two
    # steps; 8 took it to 2e-5 in one run, though a flipped ReLU mask can
    # still fail it, docs/architecture.md).  A vision transformer takes its
    # configured size.
    x = inputs(model, batch=8, image=getattr(model.config, "image_size", 64))
    twin = copy.deepcopy(model)
    found = trained_alike(model, _training_steps, x, {k: _double(v) for k, v in x.items()})
    return in_float64(found, _training_steps, twin, x)


def trained_alike(model: torch.nn.Module, steps: Any, x: Any, exact_x: Any) -> tuple[float, str]:
    """``steps(run, model, x)`` (a few training steps of ``run``: ``model``,
    compiled or not; the tensors to compare) of eager and of tilec from the
    same weights, :func:`judged`, against float64 (on ``exact_x``) where
    needed; each tensor against at least a thousandth of the largest."""
    exact = copy.deepcopy(model).double()
    twin = copy.deepcopy(model)
    expected = steps(model, model, x)
    actual = steps(_tilec(twin), twin, x)
    largest = max(v.abs().max().item() for v in expected.values() if v.is_floating_point())
    return judged(actual, expected, lambda: steps(exact, exact, exact_x), floor=1e-3 * largest)


def judged(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    reference: Any,
    floor: float = 0.0,
) -> tuple[float, str]:
    """The worst relative error of ``actual``'s tensors against eager's
    ``expected`` (each measured against at least ``floor``), and where.
    Past the tolerance each is judged against float64 (``reference()``:
    the same tensors computed in float64): a randomly initialised model
    can amplify float32 rounding past the tolerance on both sides
    (MobileNetV2's BatchNorm after two training steps, mT5's attention),
    so what counts then is how far tilec's error exceeds twice eager's."""
    names = [n for n, v in expected.items() if v.numel() and v.is_floating_point()]
    error, where = max(
        (_relative(actual[n].double(), expected[n].double(), floor), n) for n in names
    )
    if error <= TOLERANCE:
        return error, where
    exact = reference()
    excess = []
    for n in names:
        mine = _relative(actual[n].double(), exact[n], floor)
        theirs = _relative(expected[n].double(), exact[n], floor)
        excess.append(
            (max(0.0, mine - 2 * theirs), f"{n}: against float64 {mine:.1e}, eager {theirs:.1e}")
        )
    return max(excess)


def in_float64(
    found: tuple[float, str], steps: Any, model: torch.nn.Module, x: Any
) -> tuple[float, str]:
    """``found`` (a float32 judgement) where it passes; else ``steps`` of
    tilec in float64 judged against eager's in float64, on ``model`` (the
    weights ``found``'s steps began from) and inputs ``x`` (a dict or a
    tuple of tensors).  Deep networks of ReLUs and BatchNorms on a few
    positions per channel amplify float32 rounding chaotically: one
    pre-activation a rounding away from zero flips a mask and moves every
    earlier gradient by percents (MobileNetV2's last ReLU6, -2.1e-6 in
    float64, flipped by tilec's float32 and not by eager's, moved the first
    step's gradients by 6e-3; eager is 7% off float64 on ResNet-101's
    gradients).  In float64 rounding is too small to grow past the
    tolerance, so a wrong program still fails; a model judged there is
    reported as passing "in float64", with its float32 result beside."""
    error, where = found
    if error <= TOLERANCE:
        return found
    exact, mine = copy.deepcopy(model).double(), model.double()
    x64 = tree_map(_double, x)
    expected = steps(exact, exact, x64)
    actual = steps(_tilec(mine), mine, x64)
    largest = max(v.abs().max().item() for v in expected.values() if v.is_floating_point())
    error64, where64 = judged(actual, expected, lambda: expected, floor=1e-3 * largest)
    return error64, f"{FLOAT64} ({where64}); float32: {where}"


# How a result judged in float64 begins (:func:`in_float64`).
FLOAT64 = "in float64"


def _training_steps(run: Any, model: torch.nn.Module, x: dict[str, torch.Tensor]) -> dict:
    """Two steps of ``run`` (``model``, compiled or not): a backward of the
    weighted output and an SGD step each; the second step's gradients, then
    the parameters and buffers after it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        out = main_output(run(**x))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        (out * weights.to(out.dtype)).sum().backward()
        optimizer.step()
    # A parameter no output reaches: None in eager, zeros compiled (as in
    # ``_grad``): compared as zeros.
    state = {
        f"gradient of {n}": torch.zeros_like(p) if p.grad is None else p.grad
        for n, p in model.named_parameters()
    }
    return {**state, **model.state_dict()}


def _double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def _generate(model: torch.nn.Module) -> tuple[float, str]:
    x = inputs(model)
    cache = "static" if getattr(model, "_can_compile_fullgraph", False) else None
    options = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        cache_implementation=cache,
        pad_token_id=0,
    )
    with torch.no_grad():
        expected = model.generate(**x, **options)
        model.forward = torch.compile(model.forward, backend="tilec", mode="reduce-overhead")
        actual = model.generate(**x, **options)
    # Logits step by step, while the tokens agree (a step after a
    # different token compares different inputs).
    steps = zip(actual.sequences.T[x["input_ids"].shape[1] :], expected.sequences.T[-NEW_TOKENS:])
    worst = (0.0, "")
    for k, ((mine, theirs), logits) in enumerate(zip(steps, zip(actual.logits, expected.logits))):
        worst = max(worst, (_relative(*logits), f"step {k} logits, {cache or 'default'} cache"))
        if not torch.equal(mine, theirs):
            return float("inf"), f"tokens differ from step {k} ({cache or 'default'} cache)"
    return worst


# What each mode compares (module docstring).
CHECKS = {
    "forward": _forward,
    "grad": _grad,
    "dynamic": _dynamic,
    "train": _train,
    "generate": _generate,
}


def sweep_model(kind: str, mode: str = "forward", attention: str = "eager") -> ModelResult:
    """Model type ``kind`` through tilec against eager (module docstring)."""
    return measured(
        kind, lambda: CHECKS[mode](build(kind, training=mode == "train", attention=attention))
    )


def measured(name: str, check: Any) -> ModelResult:
    """``check()`` (a model built and compared: the worst error and where)
    from a fresh Dynamo and fresh counters, as model ``name``'s result:
    raising :class:`NotCompared`, it compared nothing; raising anything
    else, it failed with that error (the report names every failing
    model, not just the first)."""
    began = time.perf_counter()
    result = ModelResult(name)
    torch._dynamo.reset()
    tilec.reset_stats()
    before = {id(p) for p in programs().values()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result.error, result.where = check()
    except NotCompared as e:
        result.vacuous = True
        result.where = str(e)
    except Exception as e:
        result.where = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    result.fallbacks = dict(tilec.stats()["fallbacks"])
    if OPTIONS.get("cudagraphs"):
        result.where += f"; {replayed(before)}"
    result.seconds = time.perf_counter() - began
    return result


def _line(r: ModelResult) -> str:
    if r.vacuous:
        outcome = f"not compared: {r.where}"
    elif r.error is None:
        outcome = f"raised {r.where}"
    else:
        outcome = f"{'pass' if r.passed else 'FAIL'}, worst {r.error:.1e} ({r.where})"
    return outcome + (f", fallbacks {r.fallbacks}" if r.fallbacks else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated model types (default: all of MODELS); unknown ones are an error",
    )
    parser.add_argument(
        "--mode",
        default="forward",
        choices=list(CHECKS),
        help="forward outputs (default), parameter gradients, dynamic sequence lengths, "
        "training steps, or greedy generation",
    )
    parser.add_argument(
        "--cudagraphs",
        action="store_true",
        help="compile with graph capture (the CPU stand-in for CUDA graphs): forward and grad "
        f"call the compiled model {GRAPH_CALLS} times and compare the last (a replay), dynamic "
        "and train as always; each result says how many programs replayed a graph",
    )
    parser.add_argument(
        "--chain",
        action="store_true",
        help="compile with the option chain: a graph's consecutive kernels one launch "
        "(passes/chain.py); not generate's compile",
    )
    parser.add_argument(
        "--attention",
        default="eager",
        choices=["eager", "sdpa"],
        help="transformers' attention: the softmax spelled out (default), or "
        "scaled_dot_product_attention (transformers' own default; a model without it raises)",
    )
    args = parser.parse_args(argv)
    OPTIONS.clear()
    if args.cudagraphs:
        OPTIONS["cudagraphs"] = True
    if args.chain:
        OPTIONS["chain"] = True
    kinds = list(MODELS) if args.models is None else args.models.split(",")
    unknown = [k for k in kinds if k not in MODELS]
    if unknown:
        parser.error(f"--models: unknown model type(s): {', '.join(unknown)}")
    if args.mode == "dynamic":
        kinds = [k for k in kinds if "Image" not in MODELS[k] and MODELS[k] != "AutoModel"]
    if args.mode == "generate":
        kinds = [k for k in kinds if MODELS[k] == "AutoModelForCausalLM"]
    results = []
    for k, kind in enumerate(kinds, 1):
        results.append(sweep_model(kind, args.mode, args.attention))
        r = results[-1]
        print(
            f"[{k}/{len(kinds)}] {kind}: {_line(r)} ({r.seconds:.0f}s)", file=sys.stderr, flush=True
        )
    failing = [r for r in results if not r.passed and not r.vacuous]
    judged64 = [r for r in results if r.passed and r.where.startswith(FLOAT64)]
    vacuous = [r for r in results if r.vacuous]
    print(
        f"Model sweep ({args.mode}, {args.attention} attention"
        + (", graph capture" if args.cudagraphs else "")
        + f", float32, CPU, tolerance {TOLERANCE:g}): "
        f"{len(results) - len(failing) - len(vacuous)}/{len(results)} models pass"
        + (f" ({len(judged64)} {FLOAT64})" if judged64 else "")
        + (f", {len(vacuous)} not compared" if vacuous else "")
    )
    for r in failing + judged64 + vacuous:
        print(f"  {r.name}: {_line(r)}")
    with_fallbacks = [r for r in results if r.fallbacks]
    if with_fallbacks:
        print("models with fallbacks:")
        print("\n".join(f"  {r.name}: {r.fallbacks}" for r in with_fallbacks))
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())

"""Vision sweep: torchvision's models, random weights, through tilec.

    python tests/vision_sweep.py [--models resnet18,swin_t,...]
        [--kinds classification,segmentation,video,optical_flow]
        [--mode forward|grad|train] [--cudagraphs]

torchvision installs only beside torch 2.14.1 here (its PyPI wheel fails to
import beside the README's torch 2.13.0), so this sweep runs in a venv of its
own (``pip install torch==2.14.1 torchvision==0.29.1`` and tilec with
``--no-deps``), not in the suite; what it finds becomes tests that need no
torchvision.

Each model is built at its real size with random weights (no download;
backbones too; BatchNorm's running statistics those of one batch, so
that eval mode does not shrink the signal to nothing; zero-initialised
weights, such as ViT's classifier, made random), float32 on the CPU,
and compared with eager at a small input (:data:`INPUTS`; 2 images of
64 x 64 unless named there):

* ``forward``: every output tensor in eval mode, no grad;
* ``grad``: every parameter's gradient of the outputs weighted by fixed
  random numbers, in eval mode (BatchNorm on running statistics), judged
  in float64 where float32 fails, as ``train``'s;
* ``train``: two SGD steps in train mode (dropout and stochastic depth off;
  BatchNorm on batch statistics, writing its running ones), as
  ``tests/model_sweep.py``'s ``train``.  Their float32 rounding grows
  chaotically on both sides (eager's own result is up to 78% off float64),
  so a model that fails in float32 is run again in float64, tilec against
  eager, and judged there (reported as passing "in float64": the program
  is right, its float32 rounding not comparable).

Errors are measured as in ``tests/model_sweep.py`` (relative to eager's
largest magnitude; a result past the tolerance is judged against the same
computation in float64, by how far tilec's error exceeds twice eager's).
Models with more than :data:`MAX_PARAMETERS` parameters are not compared
(the Triton interpreter makes them minutes each).
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import warnings
from typing import Any

import torch
from model_sweep import (
    FLOAT64,
    GRAPH_CALLS,
    OPTIONS,
    ModelResult,
    NotCompared,
    _double,
    _line,
    _tilec,
    graph_calls,
    in_float64,
    judged,
    measured,
    trained_alike,
)

MAX_PARAMETERS = 150_000_000
KINDS = ("classification", "segmentation", "video", "optical_flow")

# Inputs other than 2 images of 64 x 64 (classification, segmentation) or
# 2 clips of 4 frames of 32 x 32 (video): (shape, builder's keywords).
INPUTS: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {
    # Its stem needs 75 pixels; the auxiliary head needs 299 (off).
    "inception_v3": ((2, 3, 96, 96), {"aux_logits": False, "init_weights": True}),
    # Partitions of 7 x 7 at every stage: 224 pixels.
    "maxvit_t": ((1, 3, 224, 224), {}),
    "vit_b_16": ((2, 3, 64, 64), {"image_size": 64}),
    "vit_b_32": ((2, 3, 64, 64), {"image_size": 64}),
    "vit_l_16": ((2, 3, 64, 64), {"image_size": 64}),
    "vit_l_32": ((2, 3, 64, 64), {"image_size": 64}),
    "vit_h_14": ((2, 3, 56, 56), {"image_size": 56}),
    # Two frames of 128 x 128: the correlation pyramid needs 16 x 16 features.
    "raft_small": ((1, 3, 128, 128), {}),
    "raft_large": ((1, 3, 128, 128), {}),
}
# Models whose smallest input is too large for the interpreter.
TOO_LARGE_INPUT = {
    "s3d": "its pooling needs 16 frames of 224 x 224",
    "mvit_v1_b": "it takes 16 frames of 224 x 224 only",
    "mvit_v2_s": "it takes 16 frames of 224 x 224 only",
}


def names(kinds: list[str]) -> list[str]:
    from torchvision import models

    found = []
    for kind in kinds:
        module = models if kind == "classification" else getattr(models, kind)
        found += models.list_models(module=module)
    return found


def kind_of(name: str) -> str:
    from torchvision import models

    for kind in KINDS[1:]:
        if name in models.list_models(module=getattr(models, kind)):
            return kind
    return "classification"


def build(name: str, training: bool = False) -> torch.nn.Module:
    """torchvision's ``name``, random weights (its backbone's too), in eval
    mode, or in train mode with dropout and stochastic depth off."""
    from torchvision import models, ops

    if name in TOO_LARGE_INPUT:
        raise NotCompared(TOO_LARGE_INPUT[name])
    keywords = dict(INPUTS.get(name, ((), {}))[1])
    if kind_of(name) == "segmentation":
        keywords["weights_backbone"] = None
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = models.get_model(name, weights=None, **keywords)
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        raise NotCompared(
            f"{count / 1e6:.0f}M parameters (the sweep takes up to {MAX_PARAMETERS / 1e6:.0f}M)"
        )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            # A zero-initialised weight (ViT's classifier) makes a zero
            # output, which compares nothing.
            if p.dim() > 1 and not p.any():
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    _calibrate(model, inputs(name, batch=8, seed=1))
    if not training:
        return model.eval()
    for module in model.modules():
        if isinstance(module, (torch.nn.Dropout, ops.StochasticDepth)):
            module.p = 0.0
    return model.train()


def _calibrate(model: torch.nn.Module, x: tuple[torch.Tensor, ...]) -> None:
    """BatchNorm's running statistics set to those of batch ``x`` (one
    forward in train mode, their average; 8 images other than those
    compared): as initialised (mean 0, variance 1) a network of BatchNorms
    in eval mode can shrink its input a hundredfold a stage (EfficientNet's
    output is 1e-14), which compares nothing.  Statistics of the 2 images
    compared left channels of almost no variance, whose normalization
    amplified rounding: EfficientNet-B6's eager output was 45% off float64."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        model(*x)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum


def inputs(name: str, batch: int | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    default = (2, 3, 4, 32, 32) if kind_of(name) == "video" else (2, 3, 64, 64)
    shape = INPUTS.get(name, (default, {}))[0]
    if batch is not None and shape[0] > 1:
        shape = (batch, *shape[1:])
    count = 2 if kind_of(name) == "optical_flow" else 1
    return tuple(torch.randn(shape, generator=gen) for _ in range(count))


def outputs(out: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a model's output, by where it is: a tensor, a dict of
    them (segmentation), a list of them (RAFT's flow per update) or a named
    tuple (GoogLeNet's auxiliary logits in train mode)."""
    if isinstance(out, torch.Tensor):
        return {"output": out}
    if isinstance(out, dict):
        items = out.items()
    else:
        items = zip(getattr(out, "_fields", None) or range(len(out)), out)
    return {f"output {k}": v for k, v in items if isinstance(v, torch.Tensor)}


def _weighted(out: Any) -> torch.Tensor:
    """The outputs weighted by fixed random numbers, summed."""
    gen = torch.Generator().manual_seed(2)
    return sum((v * torch.randn(v.shape, generator=gen).to(v)).sum() for v in outputs(out).values())


def _forward(name: str, model: torch.nn.Module) -> tuple[float, str]:
    x = inputs(name)
    exact = copy.deepcopy(model).double()
    compiled = _tilec(model)
    with torch.no_grad():
        expected = outputs(model(*x))
        for _ in range(graph_calls()):
            actual = outputs(compiled(*x))

    def reference() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return outputs(exact(*(_double(t) for t in x)))

    return judged(actual, expected, reference)


def _gradients(
    run: Any, model: torch.nn.Module, x: tuple[torch.Tensor, ...], calls: int = 1
) -> dict:
    """The parameters' gradients of ``run`` (``model``, compiled or not),
    computed ``calls`` times (:func:`model_sweep.graph_calls`), the last kept."""
    for _ in range(calls):
        model.zero_grad(set_to_none=True)
        _weighted(run(*x)).backward()
    # A parameter no output reaches: None in eager, zeros compiled.
    return {
        f"gradient of {n}": torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for n, p in model.named_parameters()
    }


def _grad(name: str, model: torch.nn.Module) -> tuple[float, str]:
    x = inputs(name)
    twin = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    steps = functools.partial(_gradients, calls=graph_calls())
    expected = _gradients(model, model, x)
    actual = steps(_tilec(model), model, x)
    largest = max(g.abs().max().item() for g in expected.values())
    found = judged(
        actual,
        expected,
        lambda: _gradients(exact, exact, tuple(_double(t) for t in x)),
        floor=1e-3 * largest,
    )
    return in_float64(found, steps, twin, x)


def _training_steps(run: Any, model: torch.nn.Module, x: tuple[torch.Tensor, ...]) -> dict:
    """Two SGD steps of ``run`` (``model``, compiled or not); the second
    step's gradients, then the parameters and buffers after it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        _weighted(run(*x)).backward()
        optimizer.step()
    state = {
        f"gradient of {n}": torch.zeros_like(p) if p.grad is None else p.grad
        for n, p in model.named_parameters()
    }
    return {**state, **model.state_dict()}


def _train(name: str, model: torch.nn.Module) -> tuple[float, str]:
    # 8 images where the model takes 2: BatchNorm on batch statistics of a
    # few values per channel amplifies rounding on both sides
    # (``tests/model_sweep.py``'s ``_train``).
    x = inputs(name, batch=8)
    twin = copy.deepcopy(model)
    found = trained_alike(model, _training_steps, x, tuple(_double(t) for t in x))
    return in_float64(found, _training_steps, twin, x)


CHECKS = {"forward": _forward, "grad": _grad, "train": _train}


def sweep_model(name: str, mode: str = "forward") -> ModelResult:
    return measured(name, lambda: CHECKS[mode](name, build(name, training=mode == "train")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="comma-separated (default: every one)")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}"
    )
    parser.add_argument("--mode", default="forward", choices=list(CHECKS))
    parser.add_argument(
        "--cudagraphs",
        action="store_true",
        help="compile with graph capture (the CPU stand-in): forward and grad call the "
        f"compiled model {GRAPH_CALLS} times and compare the last (a replay); each result says how many "
        "programs replayed a graph",
    )
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := [k for k in kinds if k not in KINDS]:
        parser.error(f"--kinds: unknown: {', '.join(unknown)}")
    known = names(list(KINDS))
    chosen = names(kinds) if args.models is None else args.models.split(",")
    if unknown := [m for m in chosen if m not in known]:
        parser.error(f"--models: unknown: {', '.join(unknown)}")
    OPTIONS.clear()
    if args.cudagraphs:
        OPTIONS["cudagraphs"] = True
    results = []
    for k, name in enumerate(chosen, 1):
        results.append(sweep_model(name, args.mode))
        r = results[-1]
        print(f"[{k}/{len(chosen)}] {name}: {_line(r)} ({r.seconds:.0f}s)", file=sys.stderr)
    failing = [r for r in results if not r.passed and not r.vacuous]
    judged64 = [r for r in results if r.passed and r.where.startswith(FLOAT64)]
    vacuous = [r for r in results if r.vacuous]
    print(
        f"Vision sweep ({args.mode}" + (", graph capture" if args.cudagraphs else "") + "): "
        f"{len(results) - len(failing) - len(vacuous)}/{len(results)} models pass"
        + (f" ({len(judged64)} {FLOAT64})" if judged64 else "")
        + (f", {len(vacuous)} not compared" if vacuous else "")
    )
    for r in failing + judged64 + vacuous:
        print(f"  {r.name}: {_line(r)}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())

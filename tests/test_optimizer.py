"""Compiled optimizer steps: no fallbacks, parameters and state written in
place, and a number of launches that does not grow with the parameters.

Oracle: the same optimizer run eagerly on copies of the parameters, its
parameters and state compared after each step; ``prims.fma`` (what Dynamo
writes for ``addcmul_``/``addcdiv_`` with a ``value`` and ``add_`` with a
tensor ``alpha``) against eager and against float64."""

from __future__ import annotations

import pytest
import torch

import tilec
from benchmarks.zoo import MODELS
from tests.compare import assert_close_tree
from tests.lowering import new_programs
from tilec.passes.combine import MAX_ARGS

# ``foreach``: torch's multi-tensor implementation (``torch._foreach_*``
# ops), its default for CUDA tensors; without it, a loop over parameters
# (the CPU's default).
OPTIMIZERS = {
    "AdamW": lambda params, foreach: torch.optim.AdamW(
        params, lr=1e-2, weight_decay=0.1, foreach=foreach
    ),
    "Adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-2, foreach=foreach),
    "SGD": lambda params, foreach: torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach),
}


def _parameters(count: int) -> list[torch.Tensor]:
    """``count`` parameters of a few shapes, one in eight larger than what
    ``passes/combine.SMALL`` combines for being small (300 x 300)."""
    g = torch.Generator().manual_seed(count)
    shapes = [(300, 300) if k % 8 == 0 else (5 + k % 7, 3 + k % 5) for k in range(count)]
    return [torch.randn(s, generator=g) for s in shapes]


def _step_like_eager(name: str, values: list[torch.Tensor], steps: int = 3, foreach=False):
    """The optimizer over ``values`` compiled with tilec and eager, ``steps``
    steps with new gradients each; compares parameters and state after each
    step.  Returns the step's program (the last one compiled)."""
    mine = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    compiled_opt = OPTIMIZERS[name](mine, foreach)
    eager_opt = OPTIMIZERS[name](theirs, foreach)
    before = set(tilec.programs())
    step = torch.compile(compiled_opt.step, backend="tilec")
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for a, b in zip(mine, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        step()
        eager_opt.step()
        assert_close_tree(list(mine), list(theirs), 1e-5, 1e-5)
        for a, b in zip(mine, theirs, strict=True):
            state, expected = compiled_opt.state[a], eager_opt.state[b]
            assert sorted(state) == sorted(expected)
            assert_close_tree([state[k] for k in expected], list(expected.values()), 1e-5, 1e-5)
    programs = new_programs(before)
    return programs[-1]


@pytest.mark.parametrize(
    "name, foreach",
    [("AdamW", True), ("AdamW", False), ("Adam", True), ("SGD", True)],
    ids=["AdamW-foreach", "AdamW-loop", "Adam-foreach", "SGD-foreach"],
)
def test_a_step_over_many_parameters_is_a_few_launches(name, foreach):
    """40 parameters: the updates and step counts run in at most 2
    launches (a combined kernel of step counts, one of updates), every new
    value stored into its own tensor, nothing copied back, whether the
    optimizer loops over its parameters or calls ``torch._foreach_*``.
    (104, near the arguments one kernel takes: the next test.)"""
    tilec.reset_stats()
    program = _step_like_eager(name, _parameters(40), steps=2, foreach=foreach)
    assert tilec.stats()["fallbacks"] == {}
    assert len(program.launches()) <= 2, [s.kernel.group.reason for s in program.launches()]
    assert "write_input" not in program.plan.source()
    assert len(program.graph.in_place) == len(program.graph.mutations)


def test_launches_do_not_grow_with_the_parameters():
    """AdamW over 16 and over 104 parameters: as many launches.  (They grow
    by one per ``combine.MAX_ARGS`` arguments: some 170 AdamW parameters.)"""
    few = _step_like_eager("AdamW", _parameters(16), steps=1)
    many = _step_like_eager("AdamW", _parameters(104), steps=1)
    assert len(few.launches()) == len(many.launches()) == 2
    assert max(len(s.kernel.args) for s in many.launches()) <= MAX_ARGS


def test_adamw_over_the_zoos_gpt2_falls_back_on_nothing():
    """The zoo's tiny GPT-2 (28 parameters): at most 8 launches (the issue's
    bound; 2 today), nothing falls back."""
    model = MODELS["gpt2"].build("tiny").model
    tilec.reset_stats()
    program = _step_like_eager("AdamW", [p.detach() for p in model.parameters()], steps=2)
    assert tilec.stats()["fallbacks"] == {}
    assert len(program.launches()) <= 8


def test_clip_grad_norm_matches_eager_in_three_launches():
    """The gradients' norms (one combined kernel), their total, the scaled
    gradients (one combined kernel): ``_foreach_norm`` and ``_foreach_mul``
    taken apart per tensor, nothing falls back."""
    values = _parameters(40)
    mine = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    for k, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(k))
        b.grad = a.grad.clone()
    tilec.reset_stats()
    before = set(tilec.programs())
    norm = torch.compile(lambda: torch.nn.utils.clip_grad_norm_(mine, 1.0), backend="tilec")()
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    torch.testing.assert_close(norm, expected)
    assert_close_tree([p.grad for p in mine], [p.grad for p in theirs], 1e-6, 1e-5)
    assert tilec.stats()["fallbacks"] == {}
    (program,) = new_programs(before)
    assert len(program.launches()) <= 3


def _fma_ops(p, a, b, alpha):
    p.addcmul_(a, b, value=0.3)
    p.addcdiv_(a, b.abs() + 1, value=-0.7)
    p.add_(a, alpha=alpha)
    return p * 1


@pytest.mark.parametrize("interpret", [False, True], ids=["kernels", "ir-interpreter"])
def test_fma_matches_eager_and_rounds_once(interpret):
    g = torch.Generator().manual_seed(0)
    p, a, b = (torch.randn(64, generator=g) for _ in range(3))
    alpha = torch.tensor(0.25)
    expected_p = p.clone()
    tilec.reset_stats()
    compiled = torch.compile(_fma_ops, backend="tilec", options={"interpret": interpret})
    with torch.no_grad():
        out = compiled(p, a, b, alpha)
        expected = _fma_ops(expected_p, a, b, alpha)
    assert tilec.stats()["fallbacks"] == {}
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(p, expected_p)


def test_fma_in_the_ir_interpreter_is_one_rounding():
    """``a * b + c`` with a product that float32 cannot hold: rounded once,
    the result is float64's rounded to float32."""
    from tilec.scalar_ops import run_call

    a = torch.tensor([1 + 2**-12], dtype=torch.float32)
    c = -torch.tensor([1 + 2**-11], dtype=torch.float32)
    once = run_call("fma", [a, a, c], torch.float32)
    exact = (a.double() * a.double() + c.double()).float()
    assert once.item() == exact.item() == 2**-24
    assert (a * a + c).item() == 0.0  # two roundings lose it


def test_the_optimizer_step_report_for_the_gpu_target():
    """``python -m benchmarks.optimizer_step``: the zoo's tiny GPT-2, AdamW's
    multi-tensor step compiled for the H100: two combined launches over
    its 28 parameters, nothing falls back, and the bytes are the step's
    (parameters, gradients and both moments read, three of them written)."""
    from benchmarks.optimizer_step import optimizer_step

    r = optimizer_step("gpt2", "tiny", "AdamW", foreach=True)
    assert r["parameters"] == 28 and r["launches"] <= 2 and r["fallbacks"] == {}
    elements = sum(p.numel() for p in MODELS["gpt2"].build("tiny").model.parameters())
    assert 7 * 4 * elements <= r["kernel_bytes"] <= 7 * 4 * elements + 4096
    assert r["predicted_s"] > 0

"""Host time around the kernels: what one compiled call costs with no compute.

    python -m benchmarks.overhead [--model gpt2] [--calls N] [--repeats R] [--json FILE]

The zoo model (tiny size, batch 1, CPU, inference) is compiled with tilec and
called once for real; then every kernel launch and library call of its
programs is replaced by a no-op (a library call returns the tensor its first
call returned), so what remains is tilec's own host work: binding arguments,
views, allocations, the call path.  Printed as JSON:

* ``program_us``: one call of the model's Program, called directly,
* ``program_us_per_step``: that over the Program's steps (launches, library
  calls and views; each counted in ``steps``),
* ``call_us``: one call of the ``torch.compile``d model (Dynamo's guards,
  AOTAutograd's wrapper and the Program),
* ``floor_call_us``: the same model compiled through AOTAutograd with a
  compiler that returns its first call's outputs without computing anything:
  the cost of Dynamo and AOTAutograd alone, which tilec does not control,
* ``around_program_us``: ``call_us - program_us``, what the call costs
  besides the Program (goal: at most 1.25 x ``floor_call_us``).

Every figure is the median over ``--repeats`` timings of ``--calls``
back-to-back calls after a warm-up; all are measured in the same run.  The
times are this thread's CPU time: nothing runs on a device, so that is the
host time a call costs, and other processes on the machine do not inflate it.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd

import tilec
from benchmarks.zoo import MODELS
from tilec.decompositions import decomposition_table
from tilec.pipeline import programs

GOAL_PER_STEP_US = 1.5
GOAL_AROUND_RATIO = 1.25


def per_call_us(fns: dict[str, Callable[[], Any]], calls: int, repeats: int) -> dict[str, float]:
    """Per function: the median over ``repeats`` rounds of the mean time of
    ``calls`` back-to-back calls.  Rounds interleave the functions, so a busy
    machine slows them alike."""
    for fn in fns.values():  # warm-up
        for _ in range(calls):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.thread_time()
            for _ in range(calls):
                fn()
            samples[name].append((time.thread_time() - start) / calls * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def _first_outputs_compiler(gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable:
    """An AOTAutograd compiler whose program computes once and then only
    returns the first call's outputs."""
    outputs: list[Any] = []

    def run(args: list[Any]) -> list[Any]:
        if not outputs:
            outputs.extend(gm(*args))
        args.clear()  # boxed calling convention: the callee owns the inputs
        return outputs

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def floor_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
    return aot_autograd(
        fw_compiler=_first_outputs_compiler,
        inference_compiler=_first_outputs_compiler,
        decompositions=decomposition_table(),
    )(gm, example_inputs)


def _twin(model: torch.nn.Module) -> torch.nn.Module:
    """The same model (shared parameters) whose ``forward`` runs a copy of
    its class's code: Dynamo keeps its compiled code per code object."""
    twin = copy.copy(model)
    forward = type(model).forward
    code = forward.__code__.replace()
    own = types.FunctionType(
        code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
    )
    twin.forward = types.MethodType(own, twin)
    return twin


def measure(model_name: str, calls: int, repeats: int) -> dict[str, Any]:
    spec = MODELS[model_name]
    model = spec.build("tiny").model.eval()
    inputs = spec.inputs("tiny", 1, torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    before = set(programs())
    with torch.no_grad():
        compiled = torch.compile(model, backend="tilec")
        expected = model(*inputs)
        actual = compiled(*inputs)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        new = [p for name, p in programs().items() if name not in before]
        if len(new) != 1:
            raise RuntimeError(f"expected one compiled program for {model_name}, got {len(new)}")
        (program,) = new
        program.stub_compute()
        # The arguments the compiled call passes (parameters among them: torch
        # makes views of those a little slower than of plain tensors).
        seen: list[tuple] = []
        run = program.executor
        program.executor = lambda args, sizes: seen.append(tuple(args)) or run(args, sizes)
        compiled(*inputs)
        program.executor = run
        args = seen[0]
        # The floor compiles a twin of the model whose forward is its own code
        # object, so each has Dynamo's cache to itself and all three figures
        # are timed in the same rounds.
        floor = torch.compile(_twin(model), backend=floor_backend)
        floor(*inputs)
        result: dict[str, Any] = {"model": model_name, "steps": program.step_counts()}
        result |= per_call_us(
            {
                "program_us": lambda: program(*args),
                "call_us": lambda: compiled(*inputs),
                "floor_call_us": lambda: floor(*inputs),
            },
            calls,
            repeats,
        )
        compiles = sum(1 for p in programs() if p not in before)
        if compiles != 1:  # the floor must not have displaced tilec's compiled code
            raise RuntimeError(f"{model_name} was compiled {compiles} times by tilec")
    torch._dynamo.reset()
    steps = sum(result["steps"].values())
    result["program_us_per_step"] = result["program_us"] / steps
    result["around_program_us"] = result["call_us"] - result["program_us"]
    result["goals"] = {
        "program_us_per_step": result["program_us_per_step"] <= GOAL_PER_STEP_US,
        "around_program_us": result["around_program_us"]
        <= GOAL_AROUND_RATIO * result["floor_call_us"],
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="gpt2",
        choices=sorted(MODELS),
        help="zoo model, tiny size, batch 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=200,
        help="back-to-back calls per timing (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=15,
        help="timings per figure; each figure is their median (default: %(default)s)",
    )
    parser.add_argument(
        "--json", default=None, help="also write the result to this file (default: none)"
    )
    args = parser.parse_args(argv)
    tilec.reset_stats()
    result = measure(args.model, args.calls, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

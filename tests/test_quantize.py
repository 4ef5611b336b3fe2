"""Weight quantization (``options={"quantize": ...}``): options, names, the pass.

Quantized programs are compared twice: tightly against eager computed on the
dequantized weights the program holds (rebuilt here with torch from the
same integer values and scales: the program must compute exactly that), and
loosely against the float model (the quantization error itself).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tilec
from tests.compare import assert_matches_eager
from tests.lowering import new_programs
from tilec.freeze import parameter_name
from tilec.options import Options, check_target


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"quantize": "int8_weight_only"}, ValueError, "needs options=.'freeze': True."),
        ({"quantize": "int3", "freeze": True}, ValueError, "one of .*int8_weight_only.*fp8"),
        (
            {"quantize": "int4_weight_only", "freeze": True, "quantize_group_size": 48},
            ValueError,
            r"one of \(32, 64, 128\)",
        ),
        ({"quantize_skip": "lm_head.weight"}, TypeError, "list of fnmatch patterns"),
        ({"quantize_head": 1}, TypeError, "'quantize_head' must be a bool"),
    ],
)
def test_quantize_options_are_checked_with_clear_errors(options, error, match) -> None:
    with pytest.raises(error, match=match):
        Options.from_user(None, options)


def test_quantize_options_defaults() -> None:
    opts = Options.from_user(None, {"quantize": "int4_weight_only", "freeze": True})
    assert (opts.quantize_group_size, opts.quantize_skip, opts.quantize_head) == (128, (), False)
    assert Options.from_user(None, None).quantize is None


def test_fp8_needs_an_fp8_gpu_at_compile_time() -> None:
    opts = Options.from_user(None, {"quantize": "fp8", "freeze": True})
    with pytest.raises(ValueError, match="fp8.*compute capability 8.9 or newer.*runs on cpu"):
        check_target(opts, torch.device("cpu"))
    check_target(
        Options.from_user(None, {"quantize": "int8_weight_only", "freeze": True}),
        torch.device("cpu"),
    )
    compiled = torch.compile(
        nn.Linear(4, 3), backend="tilec", options={"quantize": "fp8", "freeze": True}
    )
    with torch.no_grad(), pytest.raises(Exception, match="compute capability 8.9"):
        compiled(torch.randn(2, 4))


def test_parameter_names_from_dynamo_sources() -> None:
    source = "L['self']._modules['model']._modules['layers']._modules['0']._parameters['weight']"
    assert parameter_name(source) == "model.layers.0.weight"
    assert parameter_name("L['self']._buffers['inv_freq']") == "inv_freq"


def test_frozen_constants_keep_their_parameter_names() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    before = set(tilec.programs())
    assert_matches_eager(model, torch.randn(2, 4), options={"freeze": True})
    (program,) = new_programs(before)
    names = sorted(program.graph.constant_names.values())
    assert names == ["0.bias", "0.weight", "2.bias", "2.weight"]

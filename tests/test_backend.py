"""The torch.compile entry: registration, options, stats, training, dynamic sizes."""

import gc
import logging
import os
import re
import subprocess
import sys
import weakref

import pytest
import torch

import tilec
from tests.compare import assert_matches_eager
from tilec.options import Options


def test_backend_name_works_without_importing_tilec():
    # The torch_dynamo_backends entry point registers "tilec" for any process.
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: torch.relu(x) * 2, backend='tilec')\n"
        "x = torch.randn(8)\n"
        "assert torch.allclose(f(x), torch.relu(x) * 2)\n"
        "import sys; assert 'tilec' in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_stats_count_and_reset():
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    assert_matches_eager(lambda x, w: torch.cumprod(x @ w, 0).exp(), x, w)
    s = tilec.stats()
    assert s["graphs"] == 1
    assert s["kernels"] == 1
    assert s["extern_calls"] == 1
    assert s["fallbacks"] == {"aten.cumprod.default": 1}
    tilec.reset_stats()
    assert tilec.stats() == {"graphs": 0, "kernels": 0, "extern_calls": 0, "fallbacks": {}}


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_modes_are_accepted(mode):
    x = torch.randn(5, 7)
    assert_matches_eager(lambda x: torch.softmax(x, -1), x, mode=mode)


def test_bad_options_name_the_problem():
    x = torch.randn(3)
    with pytest.raises(Exception, match="unknown option"):
        torch.compile(lambda x: x + 1, backend="tilec", options={"fusion": False})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="must be a bool"):
        torch.compile(lambda x: x + 1, backend="tilec", options={"fuse": "no"})(x)


def test_options_built_directly_check_their_choices():
    """Options built in code (benchmarks, tests) are checked too: an unknown
    choice would otherwise act as the default."""
    from tilec.options import Options

    with pytest.raises(ValueError, match="option 'matmul' must be one of"):
        Options(matmul="template")
    with pytest.raises(ValueError, match="option 'layout' must be one of"):
        Options(layout="nhwc")
    assert Options(matmul="triton").matmul == "triton"


def test_options_that_are_not_a_dict_name_the_problem():
    with pytest.raises(Exception, match="options must be a dict of option names to values"):
        torch.compile(lambda x: x + 1, backend="tilec", options=["dump"])(torch.randn(3))


def test_a_dump_path_that_is_a_file_names_the_option_and_the_path(tmp_path, monkeypatch):
    file = tmp_path / "notes.txt"
    file.write_text("")
    x = torch.randn(3)
    with pytest.raises(Exception, match=r"option 'dump' is '.*notes\.txt', which is a file"):
        torch.compile(lambda x: x + 1, backend="tilec", options={"dump": str(file)})(x)
    torch._dynamo.reset()
    # Under a file: no one, root included, can create it.
    monkeypatch.setenv("TILEC_DUMP", str(file / "sub"))
    with pytest.raises(
        Exception, match=r"TILEC_DUMP \(environment variable\) is .*which is a file"
    ):
        torch.compile(lambda x: x + 1, backend="tilec")(x)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_an_unwritable_dump_directory_names_the_option_and_the_path(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    try:
        for path, why in (
            (folder, "is a directory tilec cannot write to"),
            (folder / "sub", "would be created in"),
        ):
            with pytest.raises(
                ValueError, match=re.escape(f"option 'dump' is '{path}', which {why}")
            ):
                Options.from_user(None, {"dump": str(path)})
    finally:
        folder.chmod(0o700)


def test_dump_folders_are_numbered_per_folder(tmp_path):
    """Each dump folder numbers its own graphs, whatever else the process compiled."""
    x = torch.randn(4)
    for name, fns in (("a", [torch.sin]), ("b", [torch.cos, torch.exp])):
        for fn in fns:
            torch._dynamo.reset()
            with torch.no_grad():
                torch.compile(fn, backend="tilec", options={"dump": str(tmp_path / name)})(x)
    assert sorted(d.name for d in (tmp_path / "a").iterdir()) == ["000_inference"]
    assert sorted(d.name for d in (tmp_path / "b").iterdir()) == [
        "000_inference",
        "001_inference",
    ]
    assert "graph 000_inference" in (tmp_path / "b" / "000_inference" / "summary.txt").read_text()


def test_training_gradients_match_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
    )
    x = torch.randn(6, 8)
    target = torch.randn(6, 2)

    def loss_fn(m):
        return torch.nn.functional.mse_loss(m(x), target)

    loss_fn(model).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="tilec")
    loss = loss_fn(compiled)
    loss.backward()
    torch.testing.assert_close(loss, loss_fn(model), atol=1e-5, rtol=1e-5)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, atol=1e-4, rtol=1e-4)
    assert tilec.stats()["graphs"] == 2  # forward and backward


def _writes_an_input_with_a_gradient(w, x):
    x.mul_(torch.sigmoid(w))
    return (torch.softmax(w, -1) * x).sum()


def test_a_dropped_training_graph_frees_its_programs_and_inputs():
    """A graph that writes an input needing a gradient gives that input a
    grad_fn leading to the compiled graph, whose backward compiler autograd
    keeps.  Had that compiler held Dynamo's real inputs, the cycle ran
    through autograd's C++ edges, which the garbage collector cannot see:
    programs, inputs and gradients lived as long as the process."""
    w = torch.randn(4, 5, requires_grad=True)
    b = torch.randn(4, 5, requires_grad=True)
    x = b * 1
    compiled = torch.compile(_writes_an_input_with_a_gradient, backend="tilec")
    compiled(w, x).backward()
    assert tilec.programs(), "nothing compiled: the test checks nothing"
    kept = [weakref.ref(t) for t in (w, b, x)]
    del w, b, x, compiled
    torch._dynamo.reset()
    gc.collect()
    assert not tilec.programs()
    assert all(ref() is None for ref in kept)


def test_dynamic_sizes_specialize_per_size_and_reuse():
    w = torch.randn(16, 8)

    def f(x):
        return torch.softmax(x @ w, -1).sum(0)

    compiled = torch.compile(f, backend="tilec", dynamic=True, options={"specialize": "first"})
    with torch.no_grad():
        for n in (3, 5, 9, 5, 3):
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), f(x), atol=1e-5, rtol=1e-5)
    # One symbolic graph from Dynamo; tilec built one program per distinct size.
    assert tilec.stats()["graphs"] == 3


def test_data_dependent_sizes_run_the_graph_in_aten(tmp_path):
    x = torch.tensor([[1.0, -1.0], [2.0, 3.0]])
    with torch._dynamo.config.patch(
        capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True
    ):
        assert_matches_eager(
            lambda x: torch.nonzero(x > 0).float().sum(0) + 1,
            x,
            fullgraph=True,
            options={"dump": str(tmp_path)},
        )
    s = tilec.stats()
    assert s["kernels"] == 0 and s["fallbacks"]["aten.nonzero.default"] == 1
    (graph_dir,) = tmp_path.iterdir()
    assert "runs in ATen: data-dependent sizes u0" in (graph_dir / "summary.txt").read_text()


def test_side_effecting_fallbacks_are_named_by_their_op():
    x = torch.randn(4, 4) + 4 * torch.eye(4)
    assert_matches_eager(lambda x: torch.linalg.inv(x * 2) + 1, x, atol=1e-4, rtol=1e-4)
    fallbacks = tilec.stats()["fallbacks"]
    assert any("linalg_inv" in op for op in fallbacks)
    assert not any("with_effects" in op for op in fallbacks)


def test_beyond_the_cache_new_shapes_run_the_generic_variant(tmp_path, caplog):
    compiled = torch.compile(
        lambda x: x.sin() * 2,
        backend="tilec",
        dynamic=True,
        options={"dump": str(tmp_path), "max_specializations": 2, "specialize": "first"},
    )
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="tilec.guards"):
        for n in (3, 4, 5, 6, 7, 3):
            x = torch.randn(n)
            torch.testing.assert_close(compiled(x), x.sin() * 2)
    # Two specializations and one generic program: nothing evicted or recompiled.
    assert sorted(d.name.split("_", 2)[-1] for d in tmp_path.iterdir()) == ["0", "1", "generic"]
    assert not [r for r in caplog.records if "dropping" in r.getMessage()]
    assert tilec.stats()["graphs"] == 3


def test_a_failed_guard_is_logged_with_the_guard(caplog):
    compiled = torch.compile(
        lambda x: x.cos() + 1, backend="tilec", dynamic=True, options={"specialize": "first"}
    )
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="tilec.guards"):
        compiled(torch.randn(6))
        compiled(torch.randn(6))  # the same guards hold: no new variant, nothing logged
        assert not [r for r in caplog.records if "rejected" in r.getMessage()]
        compiled(torch.randn(9))
    (message,) = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert "== 6 failed" in message and "= 9)" in message
    assert tilec.stats()["graphs"] == 2


def test_max_specializations_must_not_be_negative():
    with pytest.raises(Exception, match="max_specializations"):
        torch.compile(lambda x: x + 1, backend="tilec", options={"max_specializations": -1})(
            torch.randn(2)
        )


def test_views_of_parameters_follow_a_parameter_that_moved():
    """A linear layer's transposed weight is a view made once per parameter
    storage: after ``weight.data = ...`` the next call makes it again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
    before = set(tilec.programs())
    compiled = torch.compile(model, backend="tilec")
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        (program,) = [p for n, p in tilec.programs().items() if n not in before]
        assert program.plan.refreshed(), "the transposed weight should be made once"
        model[0].weight.data = torch.randn(8, 8)
        torch.testing.assert_close(compiled(x), model(x))

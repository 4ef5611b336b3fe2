"""The forward/backward split of training graphs (``compiler/partition.py``):
the min-cut partitioner recomputes cheap forward values in the backward
instead of saving them; the dump says which; gradients match eager."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from benchmarks.zoo import MODELS
from tilec.options import Options


def _train_step(name: str, options: dict) -> tuple[list, list]:
    """Gradients of one step of the zoo's tiny ``name``: tilec's, eager's."""
    spec = MODELS[name]
    model = spec.build("tiny").model.eval()  # dropout off: the same function both ways
    twin = copy.deepcopy(model)
    inputs = spec.inputs("tiny", 2, torch.Generator().manual_seed(0))
    torch.compile(model, backend="tilec", options=options)(*inputs).square().mean().backward()
    twin(*inputs).square().mean().backward()
    return [p.grad for p in model.parameters()], [p.grad for p in twin.parameters()]


def _split(folder) -> tuple[int, int, list[str]]:
    """Saved bytes, save-all bytes and the recomputed ops of the dumped split."""
    (path,) = folder.glob("*_forward/partition.txt")
    text = path.read_text()
    saved, save_all = map(int, re.search(r", (\d+) bytes .*: (\d+) bytes", text).groups())
    recomputed = text.split("recomputed in the backward:")[1].splitlines()[1:]
    return saved, save_all, [line.split(" = ")[1] for line in recomputed]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_min_cut_saves_less_and_recomputes_in_the_backward(tmp_path, name):
    mine, eager = _train_step(name, {"dump": str(tmp_path)})
    for a, b in zip(mine, eager, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    saved, save_all, recomputed = _split(tmp_path)
    assert 0 < saved < save_all
    # Pointwise ops are recomputed (GPT-2's tanh GELU, LLaMA's SiLU), never a matmul.
    assert recomputed and not {"mm.default", "addmm.default", "bmm.default"} & set(recomputed)
    assert {"mul.Tensor", "tanh.default", "sigmoid.default"} & set(recomputed), recomputed


def test_save_all_saves_what_the_backward_reads(tmp_path):
    mine, eager = _train_step("gpt2", {"dump": str(tmp_path), "partitioner": "save_all"})
    for a, b in zip(mine, eager, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    saved, save_all, recomputed = _split(tmp_path)
    assert saved == save_all and recomputed == []


def test_an_unknown_partitioner_is_refused():
    with pytest.raises(ValueError, match="option 'partitioner' must be one of"):
        Options.from_user(None, {"partitioner": "greedy"})


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.nn.functional.gelu(self.a(x)).sin())


class _Blocks(torch.nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(3)])
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_checkpointed_regions_are_recomputed(tmp_path, checkpointed):
    """Blocks under ``torch.utils.checkpoint``: the forward saves only what
    enters the second and third block (two 16 x 32 float32 tensors), the
    backward recomputes the rest; without it, the linear layers' outputs
    and the GELU's are saved.  Gradients as eager's either way."""
    torch.manual_seed(0)
    model = _Blocks(checkpointed)
    twin = copy.deepcopy(model)
    x = torch.randn(16, 32)
    torch.compile(model, backend="tilec", options={"dump": str(tmp_path)})(x).sum().backward()
    twin(x).sum().backward()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    saved, _, recomputed = _split(tmp_path)
    if checkpointed:
        assert saved == 2 * 16 * 32 * 4
        assert {"addmm.default", "mm.default"} & set(recomputed), recomputed
    else:
        assert saved > 4 * 16 * 64 * 4


def _written_after_read(w, b):
    """``b + 1`` is read by the backward (the product's gradient); ``b`` is
    written after it.  Recomputed in the backward, ``b + 1`` would read the
    new ``b``."""
    y = torch.softmax(w, -1) * (b + 1)
    b.clamp_(-0.5, 0.5)
    return (y * y).sum()


def _through_a_view(w, b):
    """The same, reading ``b`` through a transpose, and ``b`` written
    through a slice."""
    y = torch.softmax(w, -1) * (b.t() + 1).t()
    b[1:].mul_(3)
    return (y * y).sum()


def _written_with_gradient(w, x):
    """``x`` needs a gradient and is written: AOTAutograd returns its new
    value for the call to copy instead of writing it in the graph.  Unpinned,
    the backward's recompute read the input and the saved-tensor check
    raised where eager gives the gradient."""
    y = torch.softmax(w, -1) * (x + 1)
    x.mul_(torch.sigmoid(w))
    return (y * y).sum() + (x * x).sum()


@pytest.mark.parametrize("fn", [_written_after_read, _through_a_view, _written_with_gradient])
@pytest.mark.parametrize("partitioner", ["min_cut", "save_all"])
def test_a_read_of_an_input_written_later_is_saved_not_recomputed(tmp_path, fn, partitioner):
    """torch's min-cut partitioner recomputes ``b + 1`` in the backward from
    the input, which the call has written by then: a wrong gradient with no
    error (Inductor's too, torch 2.13 and 2.14).  tilec saves it."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    grads, values = [], []
    options = {"partitioner": partitioner, "dump": str(tmp_path)}
    for run in (fn, torch.compile(fn, backend="tilec", options=options)):
        mine_w, mine_b = w.clone().requires_grad_(), b.clone().requires_grad_()
        x = mine_b * 1 if fn is _written_with_gradient else mine_b.detach()
        run(mine_w, x).backward()
        grads.append((mine_w.grad, mine_b.grad))
        values.append(x.detach())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values[1], values[0])
    if partitioner == "min_cut" and fn is not _written_with_gradient:
        # The read is saved: the backward recomputes no addition.  (With a
        # gradient, AOTAutograd clones the input first, and the backward
        # may recompute from the clone, which is saved.)
        assert "add.Tensor" not in _split(tmp_path)[2]

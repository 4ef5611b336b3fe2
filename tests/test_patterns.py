"""Real-world programs outside the model zoo, compiled with tilec and compared with eager.

Hand-written norms, rotary embeddings and attention, losses, optimizer steps,
awkward inputs (non-contiguous, mixed and half dtypes, 0-d), and outputs that
are views of intermediates, whose strides users can observe.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilec
from tests.compare import assert_matches_eager, run_tilec


def _assert_same_strides(actual: object, expected: object) -> None:
    if isinstance(expected, torch.Tensor):
        assert actual.stride() == expected.stride(), f"{actual.stride()} != {expected.stride()}"
    elif isinstance(expected, (list, tuple)):
        for a, e in zip(actual, expected):
            _assert_same_strides(a, e)


def _matches_with_strides(fn, *inputs: torch.Tensor) -> None:
    """Values and strides of every output as eager's."""
    actual = assert_matches_eager(fn, *inputs)
    with torch.no_grad():
        _assert_same_strides(actual, fn(*inputs))


# ----------------------------------------------------------------- norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * weight + bias


def test_rms_norm_is_one_kernel():
    x, w = torch.randn(2, 8, 64), torch.randn(64)
    assert_matches_eager(rms_norm, x, w)
    assert tilec.stats()["kernels"] == 1


def test_layer_norm_by_hand_is_one_kernel():
    x, w, b = torch.randn(4, 5, 48), torch.randn(48), torch.randn(48)
    assert_matches_eager(layer_norm, x, w, b)
    assert tilec.stats()["kernels"] == 1


def test_layer_norm_over_long_rows_loops():
    # Rows longer than a persistent block take the looped reduction path.
    x, w, b = torch.randn(3, 5000), torch.randn(5000), torch.randn(5000)
    assert_matches_eager(layer_norm, x, w, b)


# ------------------------------------------------------- rotary embeddings


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    dim = q.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def test_rotary_embeddings():
    q, k = torch.randn(2, 4, 16, 32), torch.randn(2, 4, 16, 32)
    assert_matches_eager(apply_rotary, q, k, torch.arange(16))


# --------------------------------------------------------------- attention


def causal_attention_triu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    n = q.shape[-2]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def causal_attention_where(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    n = q.shape[-2]
    keep = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
    scores = torch.where(keep, scores, torch.finfo(scores.dtype).min)
    probs = scores - scores.amax(-1, keepdim=True)
    probs = probs.exp() / probs.exp().sum(-1, keepdim=True)
    return probs @ v


@pytest.mark.parametrize("attention", [causal_attention_triu, causal_attention_where])
def test_masked_attention_by_hand(attention):
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    assert_matches_eager(attention, q, k, v)
    assert tilec.stats()["fallbacks"] == {}


def test_padding_mask_attention():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    lengths = torch.tensor([16, 9])

    def attend(q, k, v, lengths):
        pad = torch.arange(16)[None, :] >= lengths[:, None]
        scores = (q @ k.transpose(-1, -2)).masked_fill(pad[:, None, None, :], -1e9)
        return F.softmax(scores, -1) @ v

    assert_matches_eager(attend, q, k, v, lengths)


# ------------------------------------------------------------------ losses


def test_cross_entropy_with_ignore_index():
    logits = torch.randn(12, 10)
    target = torch.randint(0, 10, (12,))
    target[3] = -100
    assert_matches_eager(lambda x, t: F.cross_entropy(x, t), logits, target)


def test_cross_entropy_label_smoothing_3d():
    logits, target = torch.randn(2, 7, 5), torch.randint(0, 7, (2, 5))
    assert_matches_eager(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), logits, target)


def test_nll_and_mse_losses():
    logp = torch.log_softmax(torch.randn(8, 6), -1)
    target = torch.randint(0, 6, (8,))
    pred, goal = torch.randn(4, 9), torch.randn(4, 9)

    def losses(logp, target, pred, goal):
        return (
            F.nll_loss(logp, target, reduction="sum"),
            F.mse_loss(pred, goal),
            F.mse_loss(pred, goal, reduction="none"),
        )

    assert_matches_eager(losses, logp, target, pred, goal)


# --------------------------------------------------------- optimizer steps


def sgd_momentum(p, grad, buf, lr: float = 0.1, momentum: float = 0.9, wd: float = 1e-4):
    grad = grad + wd * p
    buf = momentum * buf + grad
    return p - lr * buf, buf


def adam_step(p, grad, m, v, step, lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999):
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    m_hat = m / (1 - b1**step)
    v_hat = v / (1 - b2**step)
    return p - lr * m_hat / (v_hat.sqrt() + 1e-8), m, v


def test_sgd_momentum_step():
    p, g, buf = torch.randn(33, 17), torch.randn(33, 17), torch.randn(33, 17)
    assert_matches_eager(sgd_momentum, p, g, buf)
    assert tilec.stats()["kernels"] == 1


def test_in_place_optimizer_step_mutates_like_eager():
    def step(p, grad, buf):
        buf.mul_(0.9).add_(grad)
        p.add_(buf, alpha=-0.1)
        return p.norm()

    torch.manual_seed(0)
    p, g, buf = torch.randn(3, 10), torch.randn(3, 10), torch.randn(3, 10)
    expected = [t.clone() for t in (p, g, buf)]
    actual = [t.clone() for t in (p, g, buf)]
    with torch.no_grad():
        norm = step(*expected)
    torch.testing.assert_close(run_tilec(step, *actual), norm)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_adam_step_with_tensor_step_count():
    p, g, m = torch.randn(40), torch.randn(40), torch.randn(40)
    v = torch.rand(40)
    assert_matches_eager(adam_step, p, g, m, v, torch.tensor(3.0))


# --------------------------------------------------- non-contiguous inputs


def test_transposed_input():
    x = torch.randn(12, 20)
    assert_matches_eager(lambda x: torch.softmax(x, -1) * 2, x.t())


def test_sliced_input():
    x = torch.randn(10, 24)
    assert_matches_eager(lambda x: (x * x).sum(-1) + 1, x[1::3, 2:20:2])


def test_expanded_input():
    row = torch.randn(1, 16).expand(6, 16)
    assert_matches_eager(lambda x: torch.log_softmax(x + 1, -1), row)


def test_permuted_4d_input_with_reduction():
    x = torch.randn(2, 8, 4, 6).permute(0, 2, 1, 3)
    assert_matches_eager(lambda x: x.amax(2) - x.mean(2), x)


# ------------------------------------------------------------ mixed dtypes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_input_fp32_params(dtype):
    x = torch.randn(4, 32).to(dtype)
    w, b = torch.randn(32), torch.randn(32)

    def norm(x, w, b):
        return F.layer_norm(x.float(), (32,), w, b).to(dtype) * 2

    assert_matches_eager(norm, x, w, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_rms_norm(dtype):
    x, w = torch.randn(3, 64).to(dtype), torch.randn(64).to(dtype)
    assert_matches_eager(rms_norm, x, w)


def test_int64_plus_float():
    a, b = torch.randint(-5, 5, (6, 7)), torch.randn(6, 7)
    assert_matches_eager(lambda a, b: (a + b, a * 3, a // 2, a.sum(1), a.float().mean()), a, b)


def test_bool_and_int_mix():
    x = torch.randn(5, 9)
    assert_matches_eager(lambda x: ((x > 0).sum(-1), (x > 0) & (x < 1), (x > 0).int() * 7), x)


# ------------------------------------------------------------- 0-d tensors


def test_scalar_tensors():
    x, s = torch.randn(5, 4), torch.tensor(2.5)
    assert_matches_eager(lambda x, s: (x * s + s, (x * s).sum(), s.exp()), x, s)


def test_scalar_result_feeds_full_tensor():
    x = torch.randn(7, 3)
    assert_matches_eager(lambda x: x / x.abs().max() - x.mean(), x)


# ------------------------------------------------------------ broadcasting


def test_broadcasting_chain():
    a, b, c = torch.randn(4, 1, 6), torch.randn(5, 1), torch.randn(6)
    assert_matches_eager(lambda a, b, c: ((a + b) * c - a).tanh() / (1 + b), a, b, c)


# ---------------------------------------------- reductions over other dims


@pytest.mark.parametrize("dims", [0, 1, (0, 2), (1, 2)])
def test_reduction_over_non_last_dims(dims):
    x = torch.randn(6, 7, 5)
    assert_matches_eager(lambda x: (x.sum(dims), x.amax(dims), x.var(dims)), x)


@pytest.mark.parametrize("shape", [(9, 5), (3000, 3)], ids=["persistent", "looped"])
def test_softmax_over_first_dim_is_one_kernel(shape):
    # The kernel stores the result in the order the reductions read it (x[r0, i0]).
    assert_matches_eager(lambda x: torch.softmax(x, 0), torch.randn(shape))
    assert tilec.stats()["kernels"] == 1


def test_batch_norm_statistics_over_batch_and_space_is_one_kernel():
    x, w, b = torch.randn(4, 3, 5, 5), torch.randn(3), torch.randn(3)
    assert_matches_eager(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), x, w, b)
    assert tilec.stats()["kernels"] == 1


def test_softmax_over_middle_dim_keeps_strides():
    _matches_with_strides(lambda x: torch.log_softmax(x, 1), torch.randn(2, 3, 4, 5))


def test_argmax_over_logits():
    logits = torch.randn(2, 16, 50)
    assert_matches_eager(lambda x: (x.argmax(-1), x.argmax(1), x.max(-1)), logits)


def test_argmax_long_rows():
    logits = torch.randn(3, 6000)
    assert_matches_eager(lambda x: x.argmax(-1), logits)


# ----------------------------------------- outputs that are views of values


def test_output_is_transpose_of_intermediate():
    x = torch.randn(5, 8)
    _matches_with_strides(lambda x: (x.exp() + 1).t(), x)


def test_outputs_are_slices_and_reshapes_of_intermediates():
    x = torch.randn(4, 12)

    def f(x):
        y = x.sin() * 2
        return y[:, ::2], y.view(4, 3, 4), y[1], y.unsqueeze(0).expand(3, 4, 12)

    _matches_with_strides(f, x)


def test_output_views_split_heads():
    x = torch.randn(2, 16, 32)

    def split_heads(x):
        y = x * 0.5 + 1
        return y.view(2, 16, 4, 8).transpose(1, 2)

    _matches_with_strides(split_heads, x)


def test_output_of_extern_and_view_of_input():
    x, w = torch.randn(6, 4), torch.randn(4, 3)
    _matches_with_strides(lambda x, w: ((x @ w).t(), x.t(), x[2:]), x, w)


def test_permuted_pointwise_output_keeps_eager_strides():
    # Eager keeps the input's memory format for pointwise ops on permuted inputs.
    x = torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1)
    _matches_with_strides(lambda x: x * 2 + 1, x)


def test_repeated_calls_are_stable():
    x = torch.randn(4, 8)
    f = torch.compile(lambda x: torch.softmax(x, -1), backend="tilec")
    with torch.no_grad():
        first = f(x)
        torch.testing.assert_close(f(x), first, atol=0, rtol=0)
        assert run_tilec(lambda x: torch.softmax(x, -1), x).shape == (4, 8)


@pytest.mark.parametrize("causal", [False, True])
def test_scaled_dot_product_attention_trains_like_eager(causal):
    # CPU flash attention is a library call: its own backward needs its own
    # logsumexp (the core decomposition returned the probabilities instead).
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    outs, grads = [], []
    for backend in ("eager", "tilec"):
        torch._dynamo.reset()
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = torch.compile(f, backend=backend)(*ins)
        out.sum().backward()
        outs.append(out)
        grads.append([t.grad for t in ins])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert outs[1].stride() == outs[0].stride()
    for actual, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert tilec.stats()["fallbacks"] == {} and tilec.stats()["extern_calls"] == 2

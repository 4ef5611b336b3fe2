"""The attention template (``compiler/attention.py``, ``codegen/attention.py``):
FlexAttention lowered to one fused kernel, against eager (float32, Triton
interpreter) and against the IR interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tilec
from tests.compare import assert_close_tree, run_tilec


def _causal(b, h, q, kv):
    return q >= kv


def _sliding(window):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv <= window)

    return mask


def _relative(score, b, h, q, kv):
    return score + (q - kv).to(score.dtype) * 0.1


def _alibi(slopes):
    def score_mod(score, b, h, q, kv):
        return score + slopes[h] * (kv - q).to(score.dtype)

    return score_mod


def _documents(doc):
    def mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return mask


# Without a block mask, flex_attention builds a full one in the graph (a
# sort): lowering counts the sort's fallback, which the template never reads,
# and dead-code elimination removes it (no library call runs; see the note
# in docs/architecture.md, known limits).
DEFAULT_BLOCK_MASK = {"aten.sort.stable": 1}


def _check(fn, *inputs, kernels=1, atol=2e-5, rtol=2e-5, fallbacks=None):
    """``fn`` through tilec matches eager, in ``kernels`` kernels, with no
    fallback (but ``fallbacks``, counted and never run) and no library
    call; returns tilec's result."""
    with torch.no_grad():
        expected = fn(*inputs)
    actual = run_tilec(fn, *inputs)
    assert_close_tree(actual, expected, atol, rtol)
    stats = tilec.stats()
    assert stats["fallbacks"] == (fallbacks or {}), stats
    assert stats["extern_calls"] == 0, stats
    (program,) = tilec.programs().values()
    templates = [step.kernel.template for step in program.launches()]
    assert templates.count("attention") == 1 and len(templates) == kernels, templates
    assert program.step_counts().get("library", 0) == 0
    return actual


def _qkv(batch=1, heads=2, m=64, n=64, e=16, kv_heads=None, ev=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, m, e, generator=g)
    k = torch.randn(batch, kv_heads or heads, n, e, generator=g)
    v = torch.randn(batch, kv_heads or heads, n, ev or e, generator=g)
    return q, k, v


@pytest.mark.parametrize(
    "name, mask_mod, score_mod",
    [
        ("causal", _causal, None),
        ("causal+relative", _causal, _relative),
        ("sliding window", _sliding(8), None),
        ("alibi", _causal, _alibi(torch.tensor([0.5, 0.25]))),
        ("documents", _documents(torch.tensor([0] * 20 + [1] * 30 + [2] * 14)), None),
        ("no mask", None, _relative),
    ],
)
def test_flex_attention_is_one_kernel_matching_eager(name, mask_mod, score_mod):
    q, k, v = _qkv()
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, 1, 2, 64, 64, "cpu")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

    _check(fn, q, k, v, fallbacks=None if mask_mod else DEFAULT_BLOCK_MASK)


def test_grouped_query_attention_indexes_shared_heads():
    q, k, v = _qkv(heads=4, kv_heads=2, ev=8)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, enable_gqa=True)

    _check(fn, q, k, v, fallbacks=DEFAULT_BLOCK_MASK)


@pytest.mark.parametrize("m, n", [(37, 77), (1, 50), (5, 130)])
def test_odd_lengths_and_a_single_query_row(m, n):
    q, k, v = _qkv(batch=2, m=m, n=n, e=24)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, scale=0.3)

    _check(fn, q, k, v, fallbacks=DEFAULT_BLOCK_MASK)


def test_fully_masked_rows_give_zero_and_minus_inf_log_sum_exp():
    """Row 0 sees no position (kv < q): eager's output is 0 there and its
    log-sum-exp -inf; the template's are the same."""
    q, k, v = _qkv(m=32, n=32)
    block_mask = create_block_mask(lambda b, h, q, kv: kv < q, 1, 2, 32, 32, "cpu", BLOCK_SIZE=16)

    def fn(q, k, v):
        out, lse = flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        return out, lse

    out, lse = _check(fn, q, k, v, kernels=2)  # the log-sum-exp's base-2 scaling
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -float("inf")).all()


def test_the_ir_interpreter_agrees(tmp_path):
    """option interpret runs the graph's IR, the template's reference semantics."""
    q, k, v = _qkv(m=33, n=40)
    block_mask = create_block_mask(_sliding(5), 1, 2, 33, 40, "cpu", BLOCK_SIZE=16)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, block_mask=block_mask, return_lse=True)

    with torch.no_grad():
        expected = fn(q, k, v)
    actual = run_tilec(fn, q, k, v, options={"interpret": True})
    assert_close_tree(actual, expected, 2e-5, 2e-5)


def test_bf16_on_a_cpu_falls_back_counted():
    """The interpreter has no bf16 dot: the op runs in ATen, counted."""
    q, k, v = (t.bfloat16() for t in _qkv())
    block_mask = create_block_mask(_causal, 1, 2, 64, 64, "cpu")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, block_mask=block_mask)

    with torch.no_grad():
        expected = fn(q, k, v)
    assert_close_tree(run_tilec(fn, q, k, v), expected)
    assert tilec.stats()["fallbacks"] == {"higher_order.flex_attention": 1}


# ---------------------------------------------------------------- written out


def _written_out(causal=True, scale_first=False, float_mask=None, softmax_fp32=False):
    """softmax(q @ k^T * scale + mask) @ v, as models write it by hand."""

    def fn(q, k, v):
        scale = q.shape[-1] ** -0.5
        if scale_first:
            s = (q * scale) @ k.transpose(-1, -2)
        else:
            s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        m, n = s.shape[-2:]
        if causal:
            keep = torch.ones(m, n, dtype=torch.bool).tril(n - m)
            s = s.masked_fill(~keep, float("-inf"))
        if float_mask is not None:
            s = s + float_mask
        p = torch.softmax(s.float() if softmax_fp32 else s, dim=-1).to(v.dtype)
        return p @ v

    return fn


def _check_written_out(fn, *inputs, atol=2e-5, rtol=2e-5, kernels=None):
    with torch.no_grad():
        expected = fn(*inputs)
    actual = run_tilec(fn, *inputs)
    assert_close_tree(actual, expected, atol, rtol)
    assert tilec.stats()["fallbacks"] == {}
    (program,) = tilec.programs().values()
    templates = [step.kernel.template for step in program.launches()]
    assert templates.count("attention") == 1, templates
    assert program.step_counts().get("library", 0) == 0, "a matmul is left"
    if kernels is not None:
        assert len(templates) == kernels, templates
    return actual


@pytest.mark.parametrize(
    "form",
    [
        dict(),
        dict(scale_first=True),
        dict(causal=False, float_mask=torch.randn(48, 48).clamp(max=0) * 5),
        dict(causal=False),
    ],
    ids=["causal", "scaled-q", "float-mask", "no-mask"],
)
def test_attention_written_out_is_one_kernel(form):
    q, k, v = _qkv(batch=2, m=48, n=48)
    kernels = 2 if form.get("scale_first") else 1  # q * scale stays its own kernel
    _check_written_out(_written_out(**form), q, k, v, kernels=kernels)


def test_written_out_in_fp16_with_an_fp32_softmax():
    q, k, v = (t.half() for t in _qkv(m=40, n=40))
    _check_written_out(_written_out(softmax_fp32=True), q, k, v, atol=2e-3, rtol=2e-3)


def test_written_out_decode_row_and_rectangular_cache():
    """One query row against 70 cached positions (causal: it sees them all)."""
    q, k, v = _qkv(m=1, n=70)
    _check_written_out(_written_out(), q, k, v)


def test_written_out_rows_with_nothing_unmasked_are_nan_as_in_eager():
    q, k, v = _qkv(m=16, n=16)
    mask = torch.zeros(16, 16)
    mask[3] = -float("inf")
    out = _check_written_out(_written_out(causal=False, float_mask=mask), q, k, v)
    assert out[:, :, 3].isnan().all() and not out[:, :, :3].isnan().any()


def test_written_out_with_grouped_heads_expanded():
    """K and V repeated for grouped-query heads (Llama's repeat_kv): read by index."""

    def fn(q, k, v):
        k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
        return _written_out()(q, k, v)

    q, k, v = _qkv(heads=4, kv_heads=2, m=32, n=32)
    _check_written_out(fn, q, k, v)


def test_written_out_bmm_of_three_dimensional_operands():
    def fn(q, k, v):
        return torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.2, dim=-1).bmm(v)

    q, k, v = (t[0] for t in _qkv(m=20, n=33, ev=8))
    _check_written_out(fn, q, k, v)


def test_written_out_matches_the_ir_interpreter():
    q, k, v = _qkv(m=24, n=24)
    mask = torch.zeros(24, 24)
    mask[5] = -float("inf")
    fn = _written_out(float_mask=mask)
    with torch.no_grad():
        expected = fn(q, k, v)
    actual = run_tilec(fn, q, k, v, options={"interpret": True})
    assert_close_tree(actual, expected, 2e-5, 2e-5)


def test_a_softmax_read_elsewhere_is_left_alone():
    """The probabilities are returned too (as a forward graph saves them for
    its backward): they are computed anyway, so ``p @ v`` stays a matmul."""

    def fn(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return p @ v, p

    program = _left_alone(fn, *_qkv(m=16, n=16))
    assert program.step_counts()["library"] == 2


def test_softmax_over_another_dimension_is_not_attention():
    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v

    _left_alone(fn, *_qkv(m=16, n=16))


def _left_alone(fn, *inputs, tolerance=2e-5):
    """``fn`` through tilec matches eager with no attention kernel; its program."""
    with torch.no_grad():
        expected = fn(*inputs)
    assert_close_tree(run_tilec(fn, *inputs), expected, tolerance, tolerance)
    (program,) = tilec.programs().values()
    assert "attention" not in [s.kernel.template for s in program.launches()]
    return program


def _gpt2(positions: int = 64, dtype: torch.dtype = torch.float32):
    import transformers

    config = transformers.GPT2Config(
        vocab_size=128, n_positions=positions, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval().to(dtype)
    return lambda ids: model(input_ids=ids).logits


def test_gpt2_with_attention_written_out_launches_one_attention_kernel_per_layer():
    """transformers' GPT-2 with its eager attention (causal ``tril`` buffer,
    ``masked_fill`` with the dtype's minimum, softmax, matmuls)."""
    fn = _gpt2()
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = fn(ids)
    assert_close_tree(run_tilec(fn, ids), expected, 1e-4, 1e-4)
    assert tilec.stats()["fallbacks"] == {}
    (program,) = tilec.programs().values()
    assert [s.kernel.template for s in program.launches()].count("attention") == 2


def test_gpt2_kernel_bytes_grow_linearly_with_the_sequence():
    """Compiled for the GPU target (``benchmarks.static``), in bf16:
    doubling the sequence doubles the attention kernels' bytes and at most
    doubles the whole model's (the scores are never in memory).  (In float32
    the cost model keeps these small products in the library: the template's
    FMA dot on a few SMs is predicted slower.)"""
    from benchmarks.static import tilec_graphs

    fn = _gpt2(positions=512, dtype=torch.bfloat16)
    totals, attention = [], []
    for length in (128, 256):
        (captured,) = tilec_graphs(fn, (torch.zeros(1, length, dtype=torch.long),))
        kernels = captured.kernels
        totals.append(sum(k.bytes_read + k.bytes_written for k in kernels))
        attention.append(
            [k.bytes_read + k.bytes_written for k in kernels if k.template == "attention"]
        )
    assert len(attention[0]) == 2 and [2 * b for b in attention[0]] == attention[1]
    assert totals[1] <= 2 * totals[0], totals


# ------------------------------------------------------------- tile skipping


@pytest.mark.parametrize("mask_mod", [_causal, _sliding(40)], ids=["causal", "sliding"])
def test_masked_key_tiles_are_skipped_and_results_unchanged(mask_mod):
    """300 rows and positions: several row and key tiles under the
    interpreter (64 x 128), so whole key tiles fall outside the mask."""
    q, k, v = _qkv(m=300, n=300, e=16)
    block_mask = create_block_mask(mask_mod, 1, 2, 300, 300, "cpu")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, block_mask=block_mask)

    _check(fn, q, k, v)


def _sources(program) -> str:
    return "\n".join(step.kernel.source for step in program.launches())


def test_a_document_mask_walks_the_block_mask_lists():
    """Packed documents (a mask no linear constraint captures): the kernel
    walks the key blocks the BlockMask lists for its query block (32 x 32
    blocks, so the interpreter's tiles shrink to fit one), and matches eager."""
    q, k, v = _qkv(m=150, n=150)
    doc = torch.tensor([0] * 40 + [1] * 50 + [2] * 27 + [3] * 33)
    block_mask = create_block_mask(_documents(doc), 1, 2, 150, 150, "cpu", BLOCK_SIZE=32)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, block_mask=block_mask)

    _check(fn, q, k, v)
    (program,) = tilec.programs().values()
    assert "listed = partial" in _sources(program)


def test_the_lists_decide_which_blocks_are_visited():
    """A BlockMask whose lists leave out blocks that its mask_mod allows
    (lists of one document per 32-block, a mask_mod of documents that cross
    block edges): the kernel visits only the listed blocks, as Inductor's
    kernel does, so the result is attention under mask_mod & listed
    (eager's dense path reads mask_mod alone: lists made by
    create_block_mask always agree with it)."""
    from torch.nn.attention.flex_attention import BlockMask

    q, k, v = _qkv(m=96, n=96)
    lists = create_block_mask(
        _documents(torch.arange(96) // 32), 1, 2, 96, 96, "cpu", BLOCK_SIZE=32
    )
    crossing = _documents(torch.tensor([0] * 30 + [1] * 40 + [2] * 26))
    block_mask = BlockMask.from_kv_blocks(
        lists.kv_num_blocks, lists.kv_indices, lists.full_kv_num_blocks,
        lists.full_kv_indices, BLOCK_SIZE=32, mask_mod=crossing, seq_lengths=(96, 96),
    )  # fmt: skip

    def listed_too(b, h, q_idx, kv_idx):
        return crossing(b, h, q_idx, kv_idx) & (q_idx // 32 == kv_idx // 32)

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask)

    with torch.no_grad():
        expected = flex_attention(
            q, k, v, block_mask=create_block_mask(listed_too, 1, 2, 96, 96, "cpu")
        )
        mask_mod_only = flex_attention(
            q, k, v, block_mask=create_block_mask(crossing, 1, 2, 96, 96, "cpu")
        )
    actual = run_tilec(fn, q, k, v)
    assert_close_tree(actual, expected, 2e-5, 2e-5)
    assert (actual - mask_mod_only).abs().max() > 0.1


def _predicted_flops(fn, *inputs) -> tuple[int, int]:
    """(the attention kernel's FLOPs compiled for the GPU, the full square's)."""
    from benchmarks.static import tilec_graphs

    kernels = [k for c in tilec_graphs(fn, inputs) for k in c.kernels]
    (kernel,) = [k for k in kernels if k.template == "attention"]
    q, k = inputs[:2]
    full = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    return kernel.flops, full


def test_causal_and_windowed_kernels_compute_only_what_they_see():
    """The kernel's FLOPs (what the metrics and the cost model read) count
    the key tiles it visits: about half the square for causal attention at
    1024, a band for a 128-wide window."""
    q, k, v = _qkv(m=1024, n=1024, e=64)
    for mask_mod, most in ((_causal, 0.6), (_sliding(128), 0.35)):
        block_mask = create_block_mask(mask_mod, 1, 2, 1024, 1024, "cpu")
        flops, full = _predicted_flops(
            lambda q, k, v, b=block_mask: flex_attention(q, k, v, block_mask=b), q, k, v
        )
        assert flops <= most * full, (mask_mod, flops / full)


def test_an_additive_lowest_float_mask_becomes_the_mask():
    """transformers' causal mask: 0 where allowed, the dtype's minimum
    elsewhere.  Every row sees a key, so the masked positions add nothing
    and the template may skip them; results equal eager's."""

    def fn(q, k, v):
        m, n = q.shape[-2], k.shape[-2]
        rows, cols = torch.arange(m)[:, None], torch.arange(n)[None, :]
        mask = torch.where(cols <= rows, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + mask, dim=-1) @ v

    q, k, v = _qkv(m=200, n=200)
    _check_written_out(fn, q, k, v)
    big = _qkv(heads=12, m=1024, n=1024, e=64)  # 96 programs: the template pays
    flops, full = _predicted_flops(fn, *(t.bfloat16() for t in big))
    assert flops <= 0.6 * full


def test_an_additive_mask_that_empties_a_row_is_not_hoisted():
    """Row 0 sees no key (``kv < q``): eager spreads its softmax over every
    masked position; the template must too, so nothing is skipped."""

    def fn(q, k, v):
        m, n = q.shape[-2], k.shape[-2]
        rows, cols = torch.arange(m)[:, None], torch.arange(n)[None, :]
        mask = torch.where(cols < rows, 0.0, torch.finfo(torch.float32).min)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + mask, dim=-1) @ v

    q, k, v = _qkv(m=150, n=150)
    out = _check_written_out(fn, q, k, v)
    assert not out.isnan().any()


def test_transformers_bf16_causal_layer_is_one_kernel_skipping_masked_tiles():
    """``benchmarks.static_attention``'s layer: bf16 scores, the causal mask
    of bf16's minimum added, an fp32 softmax.  Compiled for the GPU target:
    one attention kernel, no library call, about half the square computed."""
    from benchmarks.static import tilec_graphs
    from benchmarks.static_attention import DIM, HEADS, layer

    q, k, v = (torch.zeros(1, HEADS, 1024, DIM, dtype=torch.bfloat16) for _ in range(3))
    (captured,) = tilec_graphs(layer, (q, k, v))
    (kernel,) = captured.kernels
    assert kernel.template == "attention"
    assert not [n for n in captured.graph.nodes.values() if n.kind == "extern"]
    assert kernel.flops <= 0.6 * 4 * HEADS * 1024 * 1024 * DIM


# ----------------------------------------------------------------- split-KV


def _split_count(program) -> int:
    """Key chunks of the program's attention kernel (1: not split)."""
    (step,) = [s for s in program.launches() if s.kernel.template == "attention"]
    return (
        1
        if "sp = pid %" not in step.kernel.source
        else int(step.kernel.source.split("sp = pid % ")[1].split("\n")[0])
    )


@pytest.mark.parametrize("mask_mod", [None, _sliding(100)], ids=["all keys", "window"])
def test_a_decode_row_against_many_keys_is_split_over_chunks(mask_mod):
    """One query row of 2 heads against 700 keys fills 2 programs of 132
    SMs: the keys are split into chunks of at least 256 and combined; the
    output and the log-sum-exp match eager's (with a window, most chunks
    see nothing)."""
    q, k, v = _qkv(m=1, n=700)
    mask = (
        None
        if mask_mod is None
        else create_block_mask(
            lambda b, h, q_idx, kv: (kv <= q_idx + 699) & (q_idx + 699 - kv <= 100),
            1,
            2,
            1,
            700,
            "cpu",
        )
    )

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, block_mask=mask, return_lse=True)

    with torch.no_grad():
        expected = fn(q, k, v)
    assert_close_tree(run_tilec(fn, q, k, v), expected, 2e-5, 2e-5)
    (program,) = tilec.programs().values()
    assert _split_count(program) == 2
    # One launch combines the chunks' partial results: the output's kernel
    # and the log-sum-exp's side by side (passes/combine.py).
    launches = program.launches()
    assert [s.kernel.template for s in launches] == ["attention", "combined"]
    assert len(launches[1].kernel.group.parts) == 2


def test_on_the_h100_a_decode_rows_keys_are_split_as_the_cost_model_predicts_fastest(
    monkeypatch,
):
    """One bf16 query row of 32 heads against 2048 keys of 4 (TinyLlama's
    decode step; the keys expanded over the heads that share them, as
    transformers' ``repeat_kv``, and read through the copy).  A program
    computes the 8 query heads that share a key/value head, as the rows of
    its tile, so 4 chunks of 512 fill 16 programs, each walking 8 blocks of
    64 keys one after another, each taking a few-row tile's measured step
    (``cost.KEY_STEPS``).  The split the cost model predicts fastest has
    one block a chunk; its kernel's loop is the one the model priced, and
    the step's kernels (the split and its combine, as the static report
    prices them) are predicted faster than with 4 chunks.  It compiles
    for sm_90 without a spill."""
    from benchmarks.sm90 import compile_kernel
    from benchmarks.static import kernel_prediction, tilec_graphs
    from tilec.codegen.record import kernel_entry
    from tilec.passes import attention_split

    q = torch.randn(1, 32, 1, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, 2048, 64, dtype=torch.bfloat16) for _ in range(2))

    def fn(q, k, v):
        k, v = (t[:, :, None].expand(1, 4, 8, 2048, 64).reshape(1, 32, 2048, 64) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def kernels() -> tuple:
        (captured,) = tilec_graphs(fn, (q, k, v))
        (kernel,) = [k for k in captured.kernels if k.template == "attention"]
        chunk = int(kernel.source.split("kv_end = tl.minimum(kv_end, sp * ")[1].split(" ")[0])
        assert kernel.bytes_read < 2 * 4 * 2048 * 64 * 2 + 8192  # the keys and values once
        return captured, kernel, chunk

    captured, kernel, chunk = kernels()
    chosen = captured.kernels
    # At the H100's figures: 32 chunks of 64 keys, 128 programs of one
    # block.  A program a query head, 16 chunks of 128 (512 programs of 2
    # blocks); priced as the 16.8 MB that repeat_kv's expanded keys and
    # values would be if stored, 5 chunks of 448 had looked as fast (the
    # bytes hid the loop).
    assert chunk == 64
    assert kernel.launch.grid == (4 * 2048 // chunk,)
    assert kernel.program_loop.steps == chunk // 64
    compiled = compile_kernel(kernel_entry(captured.graph, kernel.group, kernel))
    assert compiled["ok"] and not compiled.get("spill_bytes"), compiled
    monkeypatch.setattr(attention_split, "splits_of", lambda *args: (4, 512))
    captured, kernel, chunk = kernels()
    filled = captured.kernels
    assert chunk == 512 and kernel.program_loop.steps == 8
    seconds = lambda ks: sum(kernel_prediction(k).seconds for k in ks)  # noqa: E731
    assert len(filled) == len(chosen)
    assert seconds(chosen) < seconds(filled)


@pytest.mark.parametrize("chunks", [1, 3, 6])
def test_the_option_attention_chunks_sets_the_split(chunks):
    """``attention_chunks`` splits a decode row's 700 keys into about that
    many chunks of whole key blocks (the interpreter's blocks are 128 keys:
    3 of 256 or 6 of 128, the last one short) or none, and the result is
    eager's."""
    q, k, v = _qkv(m=1, n=700)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=_relative, return_lse=True)

    torch._dynamo.reset()
    with torch.no_grad():
        expected = fn(q, k, v)
    got = run_tilec(fn, q, k, v, options={"attention_chunks": chunks})
    assert_close_tree(got, expected, 2e-5, 2e-5)
    (program,) = tilec.programs().values()
    assert _split_count(program) == chunks


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "4"])
def test_a_bad_attention_chunks_is_refused_by_name(bad):
    from tilec.options import Options

    with pytest.raises(ValueError, match="option 'attention_chunks' must be an int >= 1"):
        Options.from_user(None, {"attention_chunks": bad})


def test_split_decode_written_out_and_under_the_ir_interpreter():
    """A written-out decode step (rows with nothing unmasked give nan) split
    over chunks, by the kernels and by the IR interpreter."""
    q, k, v = _qkv(m=2, n=600)
    mask = torch.zeros(2, 600)
    mask[1] = -float("inf")
    fn = _written_out(causal=False, float_mask=mask)
    with torch.no_grad():
        expected = fn(q, k, v)
    assert_close_tree(run_tilec(fn, q, k, v), expected, 2e-5, 2e-5)
    (program,) = tilec.programs().values()
    assert _split_count(program) == 2
    torch._dynamo.reset()
    assert_close_tree(run_tilec(fn, q, k, v, options={"interpret": True}), expected, 2e-5, 2e-5)


def test_attention_over_channels_with_the_probabilities_transposed():
    """A convolutional block's attention (the zoo's unet_block): ``v @ p^T``
    with V as (channels, positions); one attention kernel, output permuted."""

    def fn(q, k, v):
        p = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / 4.0, dim=-1)
        return torch.bmm(v.transpose(1, 2), p.transpose(1, 2))

    q, k, v = (t[0] for t in _qkv(m=40, n=40, ev=24))
    _check_written_out(fn, q, k, v)


def test_head_dimensions_over_the_limit_stay_matmuls():
    """A 320-wide head (a convolutional block's channels): the template
    would hold a whole head row per query row in registers; it is not used."""
    q, k, v = (t[0] for t in _qkv(m=20, n=20, e=320))
    _left_alone(_written_out(causal=False), q, k, v, tolerance=1e-4)


def test_the_cost_model_decides_float32_attention_on_the_gpu_target():
    """On the GPU target, float32 (FMA dots): the rewrite follows the cost
    model's comparison with two library matmuls and a softmax.  With
    32-row tiles it kept this layer in the library (8 programs); with the
    16 x 16 tiles float32 now uses (no spills on sm_90) it predicts the
    template faster.  Unmeasured on a GPU: see docs/architecture.md."""
    from benchmarks.static import tilec_graphs

    (captured,) = tilec_graphs(_gpt2(positions=512), (torch.zeros(1, 256, dtype=torch.long),))
    assert [k.template for k in captured.kernels].count("attention") == 2  # one per layer

"""``scaled_dot_product_attention`` routed to the attention template
(``passes/attention_sdpa.py``): against eager SDPA (float32, Triton
interpreter) and the IR interpreter, with static and with symbolic query
and key lengths (the generic program), and the cost model's choice on the
GPU target."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F

import tilec
from tests.compare import assert_close_tree, run_tilec
from tests.lowering import gpu_graph
from tilec.codegen.kernel import write_kernel
from tilec.options import Options
from tilec.target import H100_SXM

aten = torch.ops.aten


def _qkv(batch=2, heads=4, m=37, n=45, e=16, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, m, e, generator=g)
    k = torch.randn(batch, kv_heads or heads, n, e, generator=g)
    v = torch.randn(batch, kv_heads or heads, n, e, generator=g)
    return q, k, v


def _masks(seed=1):
    """A boolean mask per batch (row 3 of batch 0 sees nothing) and a float
    mask per head (row 5 of head 1 all ``-inf``), for 37 x 45."""
    g = torch.Generator().manual_seed(seed)
    boolean = torch.rand(2, 1, 37, 45, generator=g) > 0.5
    boolean[0, 0, 3] = False
    additive = torch.randn(1, 4, 37, 45, generator=g)
    additive[0, 1, 5] = -float("inf")
    return boolean, additive


def _template_only(fn, *inputs, atol=2e-5, rtol=2e-5):
    """``fn`` through tilec matches eager SDPA, in one kernel, the attention
    template, with no library call and no fallback; returns tilec's result."""
    with torch.no_grad():
        expected = fn(*inputs)
    actual = run_tilec(fn, *inputs)
    assert_close_tree(actual, expected, atol, rtol)
    stats = tilec.stats()
    assert stats["extern_calls"] == 0 and stats["fallbacks"] == {}, stats
    gc.collect()
    program = list(tilec.programs().values())[-1]
    assert [step.kernel.template for step in program.launches()] == ["attention"]
    return actual


BOOLEAN, ADDITIVE = _masks()
FORMS = {
    "boolean mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=BOOLEAN),
    "float mask, scale": lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=ADDITIVE, scale=0.3
    ),
    "is_causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "no mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
}


@pytest.mark.parametrize("form", FORMS)
def test_sdpa_is_one_attention_kernel_matching_eager(form):
    """Rows with nothing unmasked give 0, as eager's SDPA does (row 3 of
    batch 0, row 5 of head 1)."""
    out = _template_only(FORMS[form], *_qkv())
    if form == "boolean mask":
        assert (out[0, :, 3] == 0).all()
    if form.startswith("float"):
        assert (out[:, 1, 5] == 0).all()


def test_grouped_query_attention_by_flag_and_by_expanded_heads():
    """``enable_gqa`` (two K/V heads for four query heads) and the same
    heads expanded by hand: indexed, never copied (one kernel)."""
    q, k, v = _qkv(kv_heads=2)

    def flag(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=BOOLEAN, enable_gqa=True)

    def expanded(q, k, v):
        b, h, n, e = k.shape
        k = k[:, :, None].expand(b, h, 2, n, e).reshape(b, 2 * h, n, e)
        v = v[:, :, None].expand(b, h, 2, n, e).reshape(b, 2 * h, n, e)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=BOOLEAN)

    _template_only(flag, q, k, v)
    torch._dynamo.reset()
    _template_only(expanded, q, k, v)


def test_the_gpu_ops_route_too():
    """The ops SDPA dispatches to on a GPU (memory-efficient with a bias,
    flash with ``is_causal``) route to the template here: their graphs run
    on the CPU only through it, and match eager SDPA."""
    q, k, v = _qkv()
    bias = torch.randn(2, 1, 37, 45)

    def efficient(q, k, v):
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, scale=0.2)[0]

    def flash(q, k, v):
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=0.2)[0]

    with torch.no_grad():
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.2)
        causal = F.scaled_dot_product_attention(
            q, k[:, :, :37], v[:, :, :37], is_causal=True, scale=0.2
        )
    assert_close_tree(run_tilec(efficient, q, k, v), expected, 2e-5, 2e-5)
    torch._dynamo.reset()
    assert_close_tree(run_tilec(flash, q, k[:, :, :37], v[:, :, :37]), causal, 2e-5, 2e-5)
    assert tilec.stats()["extern_calls"] == 0


def test_the_ir_interpreter_agrees():
    q, k, v = _qkv()
    fn = FORMS["boolean mask"]
    with torch.no_grad():
        expected = fn(q, k, v)
    assert_close_tree(run_tilec(fn, q, k, v, options={"interpret": True}), expected, 2e-5, 2e-5)


def test_left_to_the_library_when_its_log_sum_exp_is_saved_or_dropout_is_on():
    """A training forward saves the log-sum-exp for the library's backward:
    the call stays, and gradients match eager.  Dropout stays too."""
    q, k, v = (t.requires_grad_() for t in _qkv())

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ADDITIVE.clamp(min=-1e4))

    expected = torch.autograd.grad(fn(q, k, v).square().sum(), (q, k, v))
    compiled = torch.compile(fn, backend="tilec")
    actual = torch.autograd.grad(compiled(q, k, v).square().sum(), (q, k, v))
    assert_close_tree(actual, expected, 1e-4, 1e-4)
    assert tilec.stats()["extern_calls"] >= 2  # forward and backward

    torch._dynamo.reset()
    q, k, v = (t.detach() for t in (q, k, v))
    dropped = run_tilec(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5),
                        q, k, v)  # fmt: skip
    assert dropped.shape == q.shape and tilec.stats()["extern_calls"] >= 1


def _padding_causal(q, k, v, keep):
    """transformers' way: a float mask of ``-inf`` where a key is after the
    row or is padding, materialized (B, 1, M, N) for SDPA."""
    m, n = q.shape[-2], k.shape[-2]
    rows, cols = torch.arange(m)[:, None], torch.arange(n)[None, :]
    allowed = (cols <= rows)[None, None] & keep[:, None, None, :].bool()
    mask = torch.where(allowed, 0.0, float("-inf")).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_mask_built_from_padding_and_positions_is_inlined():
    """The mask is never written: the template reads the padding vector
    and compares positions.  Padded keys and the causal half give what
    eager gives."""
    q, k, v = _qkv(m=45)
    keep = torch.ones(2, 45, dtype=torch.long)
    keep[1, 30:] = 0
    _template_only(_padding_causal, q, k, v, keep)


def _gpu_graph(fn, *inputs):
    from benchmarks.static import tilec_graphs

    (captured,) = tilec_graphs(fn, inputs)
    library = [n for n in captured.graph.nodes.values() if n.kind == "extern"]
    attention = [k for k in captured.kernels if k.template == "attention"]
    return library, attention, captured.kernels


def test_the_cost_model_routes_masked_sdpa_on_the_gpu_target():
    """bf16, 16 heads x 1024 x 64 (predictions, unmeasured on a GPU):

    - a padding + causal mask: the library would read a mask some kernel
      wrote and visit every key; the template reads the padding vector and
      skips the masked half: routed, one kernel, about half the square;
    - ``is_causal`` with no mask: the library's flash kernel skips the half
      too, at a higher rate than the template's: kept;
    - a constant boolean mask: the template would visit every key (nothing
      proves tiles empty), at its lower rate: kept."""
    q, k, v = (torch.zeros(1, 16, 1024, 64, dtype=torch.bfloat16) for _ in range(3))
    full = 4 * 16 * 1024 * 1024 * 64
    keep = torch.ones(1, 1024, dtype=torch.long)
    library, attention, kernels = _gpu_graph(_padding_causal, q, k, v, keep)
    assert not library and len(kernels) == 1 and attention[0].flops <= 0.6 * full
    library, attention, _ = _gpu_graph(FORMS["is_causal"], q, k, v)
    assert library and not attention
    tril = torch.ones(1024, 1024, dtype=torch.bool).tril()
    library, attention, _ = _gpu_graph(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, tril
    )
    assert library and not attention


def _decode_mask(position):
    """A decode step's additive mask: keys after ``position`` off."""
    keys = torch.arange(2048)
    return torch.where(keys[None, None, None, :] <= position, 0.0, -math.inf).to(torch.bfloat16)


def _one_layer(q, k, v, k2, v2, position):
    return F.scaled_dot_product_attention(q + 1, k, v, attn_mask=_decode_mask(position))


def _two_layers(q, k, v, k2, v2, position):
    mask = _decode_mask(position)
    out = F.scaled_dot_product_attention(q + 1, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(out + 1, k2, v2, attn_mask=mask)


def test_sdpa_calls_sharing_one_mask_are_routed_alike():
    """Llama-2-7B's decode attention (32 heads of 128, a 2048-key cache,
    bf16, launches priced as replayed): routed for one layer, since the
    template also saves the kernel that writes the mask.  Every layer reads
    the same mask, and the kernel goes only once every call is routed: each
    call is credited its share, so two layers route both calls, as one does
    (they kept both library calls when a shared mask counted for neither)."""
    from benchmarks.static import tilec_graphs
    from tilec.options import Options

    q = torch.zeros(1, 32, 1, 128, dtype=torch.bfloat16)
    caches = [torch.zeros(1, 32, 2048, 128, dtype=torch.bfloat16) for _ in range(4)]
    options = Options.from_user(None, {"cudagraphs": True})
    for fn, layers in ((_one_layer, 1), (_two_layers, 2)):
        (captured,) = tilec_graphs(fn, (q, *caches, torch.tensor(2047)), options)
        library = [n for n in captured.graph.nodes.values() if n.kind == "extern"]
        attention = [k for k in captured.kernels if k.template == "attention"]
        assert not library and len(attention) == layers, fn.__name__


def _lengths_only(q, k, v, mask) -> None:
    """Every dimension static but the lengths (dimension 2 of q, k and v;
    the mask's last two), as in a decode step whose batch, heads and head
    dimension come from the weights."""
    for t, lengths in ((q, (2,)), (k, (2,)), (v, (2,)), (mask, (2, 3))):
        for d in range(t.dim()):
            if d not in lengths:
                torch._dynamo.mark_static(t, d)


def _gqa_flag(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], attn_mask=mask, enable_gqa=True)


def _gqa_expanded(q, k, v, mask):
    b, _, n, e = k.shape
    k = k[:, :1, None].expand(b, 1, 2, n, e).reshape(b, 2, n, e)
    v = v[:, :1, None].expand(b, 1, 2, n, e).reshape(b, 2, n, e)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _lowest_float_causal(q, k, v, mask):
    """transformers' float mask: the lowest float32 (not ``-inf``) where a
    key is after the row; whether every row keeps a key depends on the
    lengths, so the addend stays in the score."""
    rows, cols = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    lowest = torch.finfo(q.dtype).min
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(cols <= rows, 0.0, lowest))


SYMBOLIC_FORMS = {
    "no mask": lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v),
    "is_causal": lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "boolean mask": lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    "float mask, scale": lambda q, k, v, mask: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.where(mask, 0.5, -math.inf), scale=0.3
    ),
    "lowest-float causal mask": _lowest_float_causal,
    "GQA by flag": _gqa_flag,
    "GQA by expanded heads": _gqa_expanded,
}
# (query rows, keys) per call: the first sizes are the generic program's
# hints (16-row, 32-key tiles); the second call has two row tiles and loops
# over three key tiles.  ``is_causal`` runs square (SDPA aligns it top left).
LENGTHS = ((3, 20), (20, 70))


@pytest.mark.parametrize("form", SYMBOLIC_FORMS)
def test_symbolic_lengths_run_the_template_in_the_generic_program(form):
    """With symbolic query and key lengths (static batch, heads and head
    dimension), the generic program computes SDPA with the attention
    template: one launch over a grid of the lengths' symbols, sizes as
    arguments, no library call; it matches eager at every length."""
    fn = SYMBOLIC_FORMS[form]
    compiled = torch.compile(fn, backend="tilec", dynamic=True, options={"max_specializations": 0})
    g = torch.Generator().manual_seed(0)
    for m, n in LENGTHS:
        m = n if form == "is_causal" else m
        q = torch.randn(2, 2, m, 16, generator=g)
        k, v = (torch.randn(2, 2, n, 16, generator=g) for _ in range(2))
        mask = torch.rand(2, 1, m, n, generator=g) > 0.5
        mask[0, 0, 1] = False  # a row with nothing unmasked gives 0, as eager's
        _lengths_only(q, k, v, mask)
        with torch.no_grad():
            assert_close_tree(compiled(q, k, v, mask), fn(q, k, v, mask), 2e-5, 2e-5)
    assert tilec.stats()["graphs"] == 1  # one compile served every length
    gc.collect()
    ((name, program),) = tilec.programs().items()
    assert name.endswith("_generic") and not program.plan.library_calls()
    (step,) = program.launches()
    assert step.kernel.template == "attention" and step.symbolic
    lengths = {2} if form == "is_causal" else {2, 3}
    assert len(step.kernel.sizes) == len(lengths), step.kernel.sizes


def test_the_cost_model_prices_symbolic_lengths_at_their_hints():
    """On the GPU target a graph of symbolic lengths is priced at its hints
    (1024 x 1024 here), as its kernels' tiles are chosen: the same choices
    as :func:`test_the_cost_model_routes_masked_sdpa_on_the_gpu_target`'s
    static graph.  Routed, the kernel's grid is a function of the query
    length's symbol."""
    q, k, v = (torch.zeros(1, 16, 1024, 64, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.ones(1, 1024, dtype=torch.long)
    lengths = ((2,), (2,), (2,), (1,))
    graph = gpu_graph(_padding_causal, q, k, v, keep, generic=True, dynamic=lengths)
    assert not [n for n in graph.nodes.values() if n.kind == "extern"]
    (kernel,) = [write_kernel(graph, group, H100_SXM) for group in graph.groups]
    m, n = (graph.nodes[graph.inputs[i]].shape[2] for i in (0, 1))
    assert kernel.template == "attention" and {m, n} <= set(kernel.sizes)
    (grid,) = kernel.launch.grid
    assert grid.free_symbols == {m}

    graph = gpu_graph(FORMS["is_causal"], q, k, v, generic=True, dynamic=lengths[:3])
    (library,) = [
        n for n in graph.nodes.values() if n.kind == "extern" and n.extern.role == "library"
    ]
    assert library.extern.target == aten._scaled_dot_product_flash_attention_for_cpu.default


def test_under_cuda_graphs_symbolic_lengths_take_the_template_unpriced():
    """A decode row over a symbolic cache length: priced, the library wins on
    the GPU target (no mask); but a library call over symbolic sizes keeps a
    generic program out of CUDA graphs (``Plan.sizes_refusal``), so under
    ``cudagraphs`` the call goes to the template wherever it takes it.  A
    static graph is priced either way."""
    q = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)
    k, v = (torch.zeros(1, 16, 1024, 64, dtype=torch.bfloat16) for _ in range(2))
    lengths = ((), (2,), (2,))

    def library_calls(options: Options, generic: bool) -> list:
        dynamic = lengths if generic else None
        graph = gpu_graph(
            FORMS["no mask"], q, k, v, generic=generic, options=options, dynamic=dynamic
        )
        return [n for n in graph.nodes.values() if n.kind == "extern"]

    assert library_calls(Options(), generic=True)
    assert not library_calls(Options(cudagraphs=True), generic=True)
    assert library_calls(Options(cudagraphs=True), generic=False)


def test_a_decode_row_over_a_symbolic_cache_is_split_into_chunks():
    """A decode step over a cache of symbolic length (the generic program of
    a ``DynamicCache`` decode) is split over the keys like a static one, in
    chunks of a fixed length (256 here), their number a function of the
    length: one chunk at 20 keys, three at 700; a second kernel combines
    them.  Results equal eager's at every length."""

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    compiled = torch.compile(fn, backend="tilec", options={"max_specializations": 0})
    g = torch.Generator().manual_seed(0)
    for n in (20, 300, 700):
        q = torch.randn(1, 4, 1, 16, generator=g)
        k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(2))
        for t in (k, v):
            torch._dynamo.mark_dynamic(t, 2)
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), atol=2e-5, rtol=2e-5)
    assert tilec.stats()["graphs"] == 1
    gc.collect()
    ((name, program),) = tilec.programs().items()
    assert name.endswith("_generic") and not program.plan.library_calls()
    split, combine = program.launches()
    assert split.kernel.template == "attention" and combine.kernel.template != "attention"
    (grid,) = split.grid
    (length,) = grid.free_symbols
    # Four query heads over two key/value heads: a program per key/value
    # head (its two query heads the rows of its tile) per chunk of 256 keys.
    assert [grid.subs(length, n) for n in (20, 256, 257, 700)] == [2, 2, 4, 6]

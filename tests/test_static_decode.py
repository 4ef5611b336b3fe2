"""``python -m benchmarks.static --decode`` (``benchmarks/static_decode.py``)
on a small LLaMA shape: the decode step compiled for the GPU target, its
bytes against the ideal, and the cache written in place."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import static  # noqa: E402
from benchmarks.static_decode import SHAPE, run  # noqa: E402

SMALL = SHAPE | {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    """The report's rows of the small shape at batch 1 with a 128-position
    cache, by scheme, Inductor's beside tilec's: compiled once for the tests
    that read them."""
    return {r["scheme"]: r for r in run([1], ["bf16", "int8", "int4"], 128, SMALL, inductor=True)}


def test_decode_step_bytes_weights_and_caches_once(rows):
    """Per scheme: no fallback, every cache written in place, the step's
    bytes within 5 % of the ideal (weights and cache read once, new entries
    and logits written once), quantized weights moving fewer bytes, and
    the predicted tokens/s under the bandwidth limit."""
    for r in rows.values():
        assert r["fallbacks"] == {}, r
        assert r["caches_in_place"] == r["caches_written"] == 4, r
        assert 1.0 <= r["bytes_over_ideal"] <= 1.05, r
        assert r["tokens_per_s"] < r["limit_tokens_per_s"], r
    assert rows["int4"]["ideal_bytes"] < rows["int8"]["ideal_bytes"] < rows["bf16"]["ideal_bytes"]


def test_every_kernel_of_the_step_compiles_for_sm90_within_a_blocks_shared_memory(rows):
    """Each row's kernels, compiled for sm_90: none fails or asks for more
    shared memory than a block may have (Triton would refuse to launch
    it); the report's table says so."""
    from benchmarks.static_decode import _sm90_lines

    for r in rows.values():
        c = r["sm90"]
        assert c["kernels"] > 0 and not c["failed"] and not c["over_shared"], c
        assert 0 < c["max_shared"] <= static.GPU.shared_memory_per_block, c
    table = "\n".join(_sm90_lines(list(rows.values())))
    assert "| int4 | 1 |" in table and "over shared" in table


def test_launch_bound_is_between_the_prediction_and_the_limit(rows):
    """Each row's launch bound (ideal bytes at the bandwidth plus its
    launches at the replayed launch's figure) is what its launches and
    bytes allow at best: tilec's and Inductor's predictions are at or under
    it, and it is under the bandwidth limit.  The report's ratios to bf16
    are the rows' own tokens/s divided."""
    from benchmarks.static_decode import GPU, markdown, speedups
    from tilec import cost

    for r in rows.values():
        for side in (r, r["inductor"]):
            launches = side["launches"] + side["library_calls"]
            bound_s = cost.memory_seconds(GPU, side["ideal_bytes"]) + launches * (
                cost.launch_seconds(GPU, True)
            )
            assert side["launch_bound_tokens_per_s"] == pytest.approx(1 / bound_s)
            assert side["tokens_per_s"] <= side["launch_bound_tokens_per_s"] * (1 + 1e-9)
            assert side["launch_bound_tokens_per_s"] < side["limit_tokens_per_s"]
    ratios = {r["scheme"]: r for r in speedups(list(rows.values()))}
    assert set(ratios) == {"int8", "int4"}
    for scheme, ratio in ratios.items():
        for key in ("tokens_per_s", "launch_bound_tokens_per_s", "limit_tokens_per_s"):
            assert ratio[key] == pytest.approx(rows[scheme][key] / rows["bf16"][key]), key
        inductor = (
            rows[scheme]["inductor"]["tokens_per_s"] / rows["bf16"]["inductor"]["tokens_per_s"]
        )
        assert ratio["inductor"] == pytest.approx(inductor)
    text = markdown(
        list(rows.values()),
        {"date": "-", "command": "-", "torch": "-", "shape": SMALL, "cache": 128},
    )
    int4 = ratios["int4"]
    assert (
        f"| int4 | 1 | {int4['tokens_per_s']:.2f} | {int4['launch_bound_tokens_per_s']:.2f} | "
        f"{int4['limit_tokens_per_s']:.2f} | {int4['inductor']:.2f} |"
    ) in text


def test_the_command_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.static_decode.SHAPE", SMALL)
    out = tmp_path / "decode"
    argv = ["--decode", "--layers", "1", "--cache", "64", "--batches", "2", "--schemes", "bf16"]
    assert static.main([*argv, "--no-inductor", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    (row,) = report["rows"]
    assert row["batch"] == 2 and row["caches_in_place"] == 2
    assert "| bf16 | 2 |" in (out / "report.md").read_text()


def test_inductor_side_is_priced_like_tilec(rows):
    """Inductor's step for the same model: each kernel's bytes by its own
    estimate, which reads the gathered embedding row, not the table the
    scheduler counts; one library entry per call in the wrapper, with the
    attention's FLOPs as the CUDA op counts them; its bytes at or over the
    ideal and its tokens/s under the bandwidth limit."""
    from benchmarks.inductor_gpu import inductor_gpu_kernels
    from benchmarks.static_decode import decoder

    cache, heads, head_dim = 128, 4, 64
    decode = decoder(1, cache, SMALL)
    report = inductor_gpu_kernels(decode.step, decode.inputs)
    table = SMALL["vocab_size"] * SMALL["hidden_size"] * 2
    gathers = [k for k in report.kernels if "embedding" in k.name]
    assert gathers
    for k in gathers:
        assert k.bytes >= table > k.kernel_bytes, k
    assert len(report.library) == report.extern_calls
    attention = [c for c in report.library if c["op"] in static.ATTENTION_OPS]
    assert len(attention) == SMALL["num_hidden_layers"]
    assert {c["flops"] for c in attention} == {4 * heads * cache * head_dim}
    assert all(c["flops"] > 0 for c in report.library)

    tilec = rows["bf16"]
    row = tilec["inductor"]
    assert row["bytes_over_ideal"] >= 1.0
    assert row["tokens_per_s"] < tilec["limit_tokens_per_s"]


def test_extrapolated_layers_match_the_compiled_model():
    """Rows of 2 and 3 layers extended to 4 give the 4-layer model's counts
    (tilec's and Inductor's): the layers are alike.  Launches and calls
    exactly; bytes and times within 1 %: at this small shape the 4-layer
    step's kernels move 512 bytes fewer than the line (a few small kernels
    of neighbouring layers share a launch differently).  The TinyLlama step
    from 2 and 3 layers gives its 22 layers' figures exactly."""
    from benchmarks.static_decode import PER_LAYER, run_extrapolated

    four = SMALL | {"num_hidden_layers": 4}
    (compiled,) = run([1], ["bf16"], 64, four, inductor=True, sm90=False)
    (extended,) = run_extrapolated([1], ["bf16"], 64, four, inductor=True, layers=2, sm90=False)
    assert extended["layers"] == 4 and extended["extrapolated_from"] == [2, 3]
    for side in (lambda r: r, lambda r: r["inductor"]):
        for key in (*PER_LAYER, "step_bytes", "tokens_per_s"):
            if key in side(compiled):
                exact = isinstance(side(compiled)[key], int) and "bytes" not in key
                rel = 0 if exact else 0.01
                assert side(extended)[key] == pytest.approx(side(compiled)[key], rel=rel), key


def test_inductor_quantized_as_gpt_fast_quantizes(rows):
    """Inductor's int8 and int4 steps use gpt-fast's layers: int8 products
    of one row are reduction kernels that convert the int8 weight in
    registers (no library call but attention, fewer bytes than bf16's
    step); int4 products are tinygemm library calls, one per linear layer."""
    layers = SMALL["num_hidden_layers"]
    rows = {scheme: row["inductor"] for scheme, row in rows.items()}
    for scheme, row in rows.items():
        assert row["bytes_over_ideal"] >= 1.0, (scheme, row)
    assert rows["int8"]["library_calls"] == layers  # attention only
    assert rows["int8"]["step_bytes"] < rows["bf16"]["step_bytes"]
    # q, k, v, o, gate, up and down per layer, the head, and attention.
    assert rows["int4"]["library_calls"] == 7 * layers + 1 + layers
    assert rows["int4"]["step_bytes"] < rows["int8"]["step_bytes"]


@pytest.mark.parametrize("writes_last", [True, False])
def test_the_step_writes_the_position_it_decodes(writes_last):
    """The report's step (run eagerly here) writes its new key and value at
    the cache's last position, the one it decodes; a GPU timing's decoder
    leaves the first step's counter, with room for many steps."""
    import torch

    from benchmarks.static_decode import decoder

    cache = 16
    decode = decoder(
        1, cache, SMALL | {"num_hidden_layers": 1}, torch.float32, writes_last=writes_last
    )
    (layer,) = decode.cache.layers
    with torch.no_grad():
        decode.step(*decode.inputs)
    written = layer.keys.abs().sum(dim=(0, 1, 3)) != 0  # per position
    expected = torch.zeros(cache, dtype=torch.bool)
    expected[[0, cache - 1 if writes_last else 1]] = True
    assert torch.equal(written, expected), written


def test_the_cache_goes_by_the_keyword_the_forward_takes():
    """Recent transformers (5.24) take the KV cache as ``cache``, earlier
    ones (5.17, 4.x) as ``past_key_values``; a cache passed by the other
    name is swallowed by the forward's ``**kwargs`` and the step writes no
    cache (the first GPU run of ``decode_step``: "expected one decode graph
    writing the cache, got 0")."""
    import torch

    from benchmarks.static_decode import cache_keyword, decoder

    class Before(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, cache_position=None, **kwargs):
            return input_ids

    class Recent(torch.nn.Module):
        def forward(self, input_ids, cache=None, cache_position=None, **kwargs):
            return input_ids

    assert cache_keyword(Before()) == "past_key_values"
    assert cache_keyword(Recent()) == "cache"
    # The installed transformers' model: its cache is the one written.
    decode = decoder(1, 16, SMALL | {"num_hidden_layers": 1}, torch.float32)
    (layer,) = decode.cache.layers
    before = layer.keys.clone()
    with torch.no_grad():
        decode.step(*decode.inputs)
    assert not torch.equal(layer.keys, before)


def test_a_chained_step_is_priced_as_its_launches_until_a_wait_is_measured():
    """With the option ``chain`` (``passes/chain.py``) the step's kernels
    between two attentions are one launch; each stage after a chained
    kernel's first is a wait, priced at ``Target.chain_wait_s`` (assumed
    equal to a replayed launch): launches plus waits are the unchained
    step's launches, its predicted time and launch bound are the same, and
    its bytes are the same but for each chain's 16 bytes of counters."""
    from benchmarks.static_decode import GPU, markdown

    assert GPU.chain_wait_s.value == GPU.replay_s.value
    extra = {"gemv_reduction": True, "split_combine": True}
    (plain,) = run([1], ["int4"], 128, SMALL, inductor=False, extra=extra, sm90=False)
    (chained,) = run([1], ["int4"], 128, SMALL, False, extra | {"chain": True}, sm90=False)
    layers = SMALL["num_hidden_layers"]
    assert plain["stage_waits"] == 0 and chained["launches"] == 2 * layers + 1
    assert chained["launches"] + chained["stage_waits"] == plain["launches"]
    chains = chained["launches"] - layers
    assert chained["kernel_bytes"] == plain["kernel_bytes"] + 16 * chains
    for key in ("predicted_step_s", "launch_bound_tokens_per_s"):
        assert chained[key] == pytest.approx(plain[key]), key
    meta = {"date": "-", "command": "-", "torch": "-", "shape": SMALL, "cache": 128}
    waits = chained["stage_waits"]
    assert f"| {chained['launches']} + {waits} waits |" in markdown([chained], meta)

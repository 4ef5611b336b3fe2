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


def test_decode_step_bytes_weights_and_caches_once():
    """Per scheme: no fallback, every cache written in place, the step's
    bytes within 5 % of the ideal (weights and cache read once, new entries
    and logits written once), quantized weights moving fewer bytes, and
    the predicted tokens/s under the bandwidth limit."""
    rows = run([1], ["bf16", "int8", "int4"], 128, SMALL, inductor=False)
    by_scheme = {r["scheme"]: r for r in rows}
    for r in rows:
        assert r["fallbacks"] == {}, r
        assert r["caches_in_place"] == r["caches_written"] == 4, r
        assert 1.0 <= r["bytes_over_ideal"] <= 1.05, r
        assert r["tokens_per_s"] < r["limit_tokens_per_s"], r
    assert (
        by_scheme["int4"]["ideal_bytes"]
        < by_scheme["int8"]["ideal_bytes"]
        < by_scheme["bf16"]["ideal_bytes"]
    )


def test_the_command_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.static_decode.SHAPE", SMALL)
    out = tmp_path / "decode"
    argv = ["--decode", "--layers", "1", "--cache", "64", "--batches", "2", "--schemes", "bf16"]
    assert static.main([*argv, "--no-inductor", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    (row,) = report["rows"]
    assert row["batch"] == 2 and row["caches_in_place"] == 2
    assert "| bf16 | 2 |" in (out / "report.md").read_text()

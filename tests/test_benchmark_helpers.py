"""The benchmarks' arithmetic on CPU: what the decode loop counts as a step's bytes, its --plan, the plot."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_loop  # noqa: E402
from compile_pass.examples import TinyLlama, TinyLlamaConfig  # noqa: E402


def test_weight_bytes_count_every_weight_but_the_embedding_table():
    c = TinyLlamaConfig(vocab=50, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                        dtype=torch.bfloat16)
    model = TinyLlama(c)
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    per_layer = (q + 2 * kv) * c.hidden + c.hidden * q + 2 * c.intermediate * c.hidden + c.hidden * c.intermediate
    per_layer += 2 * c.hidden  # the two norms
    expected = (c.layers * per_layer + c.hidden + c.vocab * c.hidden) * 2  # final norm, lm_head; bf16
    assert decode_loop.weight_bytes_per_step(model) == expected


def test_kv_bytes_average_the_growing_lengths():
    c = TinyLlamaConfig(layers=2, kv_heads=2, head_dim=8)
    batch, ctx, steps = 3, 100, 5
    per_key = 2 * c.layers * c.kv_heads * c.head_dim * 2  # K and V, every layer, bf16
    # Step i reads ctx + i keys per row (the first step's new token is among the ctx).
    total = sum(batch * (ctx + i) * per_key for i in range(steps))
    assert decode_loop.kv_bytes_per_step(c, batch, ctx, steps) == pytest.approx(total / steps)


def test_plan_parses_and_names_a_bad_item():
    assert decode_loop.parse_plan(["1:4096,32768", "64:2048"]) == {1: [4096, 32768], 64: [2048]}
    with pytest.raises(SystemExit, match="'8-4096'"):
        decode_loop.parse_plan(["8-4096"])


def test_plot_writes_a_png_of_the_rows(tmp_path):
    pytest.importorskip("matplotlib")
    import plot_decode_loop

    rows = [dict(B=b, ctx=ctx, bound_tokens_per_s=1000.0 * b / ctx, e_tokens_per_s=900.0 * b / ctx,
                 f_tokens_per_s=905.0 * b / ctx) for b in (1, 64) for ctx in (8192, 2048, 4096)]
    rows.append(dict(B=64, ctx=32768, skipped="does not fit"))
    path = tmp_path / "r.json"
    path.write_text(json.dumps(dict(rows=rows)))
    loaded = plot_decode_loop.load_rows([str(path)])
    assert len(loaded) == 6  # the skipped row is left out
    assert plot_decode_loop.series(loaded, 64, "e_tokens_per_s")[0] == [2048, 4096, 8192]
    assert plot_decode_loop.series(loaded, 1, "a_tokens_per_s") == ([], [])
    out = tmp_path / "p.png"
    plot_decode_loop.plot(loaded, [1, 64], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="B=8"):
        plot_decode_loop.plot(loaded, [8], str(tmp_path / "none.png"))


def test_regional_reaches_the_model_and_the_cold_processes():
    args = decode_loop.parse_args(["--regional", "--cold-compile", "--warm-compile", "--contexts", "4096", "--steps",
                                   "64"])
    assert decode_loop.model_config(args, 1, args.contexts).regional is True
    cmd = decode_loop.cold_command(args, "e")
    assert "--regional" in cmd and cmd[cmd.index("--cold-compile-variant") + 1] == "e"
    plain = decode_loop.parse_args([])
    assert decode_loop.model_config(plain, 1, plain.contexts).regional is False
    assert "--regional" not in decode_loop.cold_command(plain, "b")
    assert not plain.warm_compile and not plain.cold_compile and plain.variants == list("abef")

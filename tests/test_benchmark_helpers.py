"""The benchmarks' arithmetic on CPU: what the decode loop counts as a step's bytes, its --plan, the plot; the host
overhead benchmark's CPU path (issue 43); the engine steps' CPU dry run (issue 45)."""

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


def test_compile_time_plans_cold_runs_first_then_warm_reruns_then_knobs():
    import compile_time

    runs = compile_time.plan_runs(["stock-whole"], ["threads1", "cfg:triton.cudagraph_trees=False"],
                                  "syncfree-regional", warm=True)
    assert [r["name"] for r in runs] == ["syncfree-regional cold", "stock-whole cold", "syncfree-regional warm",
                                         "stock-whole warm", "syncfree-regional cold threads1",
                                         "syncfree-regional cold cfg:triton.cudagraph_trees=False"]
    # a warm rerun shares its cold run's caches; a knob run gets its own
    assert runs[2]["caches"] == runs[0]["caches"] and len({r["caches"] for r in runs}) == 4
    assert [r["name"] for r in compile_time.plan_runs(["stock-whole"], [], "syncfree-regional", warm=False)] == [
        "stock-whole cold"]


def test_compile_time_knobs_parse_and_name_a_bad_one():
    import compile_time

    assert compile_time.parse_knob("default") == {"env": {}, "config": {}, "prewarm_pool": False, "stacked_kv": False}
    assert compile_time.parse_knob("stacked-kv")["stacked_kv"] is True
    assert compile_time.parse_knob("per-layer-kv") == compile_time.parse_knob("default")
    assert compile_time.parse_knob("threads1")["env"] == {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    assert compile_time.parse_knob("cfg:triton.cudagraph_trees=False")["config"] == {"triton.cudagraph_trees": False}
    assert compile_time.parse_knob("cfg:worker_start_method=fork")["config"] == {"worker_start_method": "fork"}
    assert compile_time.parse_knob("env:TORCH_WARM_POOL=0")["env"] == {"TORCH_WARM_POOL": "0"}
    with pytest.raises(SystemExit, match="'threads2'"):
        compile_time.parse_knob("threads2")


def test_compile_time_phases_are_what_torch_recorded_and_absent_ones_are_none():
    import compile_time

    before = {"_compile.compile_inner": [1.0], "OutputGraph.call_user_compiler": [0.5]}
    after = {"_compile.compile_inner": [1.0, 30.0], "OutputGraph.call_user_compiler": [0.5, 25.0],
             "create_aot_dispatcher_function": [20.0], "compile_fx.<locals>.fw_compiler_base": [18.0],
             "async_compile.wait": [2.0, 3.0]}
    delta = compile_time.timed_delta(before, after)
    assert delta == {"_compile.compile_inner": [30.0], "OutputGraph.call_user_compiler": [25.0],
                     "create_aot_dispatcher_function": [20.0], "compile_fx.<locals>.fw_compiler_base": [18.0],
                     "async_compile.wait": [2.0, 3.0]}
    phases = compile_time.phases_of(delta)
    assert phases["dynamo_compile"] == 30.0 and phases["triton_async_wait"] == 5.0
    assert phases["inductor_lowering"] is None  # no record: not run, or not in this torch
    derived = compile_time.derived_of(phases, first_call_s=34.0)
    assert derived["dynamo_own"] == 5.0 and derived["backend_outside_aot"] == 5.0
    assert derived["aot_outside_inductor"] == 2.0 and derived["inductor_other"] is None
    assert derived[compile_time.OUTSIDE[0]] == 4.0


def test_compile_time_sorts_triton_compiles_by_whose_kernel_they_are():
    import compile_time

    compiles = [dict(name="triton_poi_fused_add_0", s=0.5, cache_hit=False),
                dict(name="triton_red_fused_mean_1", s=0.01, cache_hit=True),
                dict(name="paged_decode_split_kernel", s=1.0, cache_hit=False),
                dict(name="page_table_kernel", s=0.25, cache_hit=None)]
    summary = compile_time.triton_summary(compiles, [("triton_poi_fused_add_0", 0.5), ("triton_per_x", None)])
    assert summary["inductor_kernels"] == 2 and summary["inductor_kernel_compile_s_sum"] == 0.5
    inductor = summary["compiles_in_this_process"]["inductor"]
    assert (inductor["n"], inductor["misses"], inductor["cache_hits"]) == (2, 1, 1)
    assert summary["project_kernels_jit_s"] == 1.25
    assert set(summary["project_and_other_kernels"]) == {"paged_decode_split_kernel", "page_table_kernel"}
    launches = compile_time.launch_summary([("page_table_kernel", 0.8), ("page_table_kernel", 1e-5),
                                            ("paged_decode_split_kernel", 1.5)])
    assert launches["page_table_kernel"] == dict(n=2, first_s=0.8, max_s=0.8, total_s=0.8 + 1e-5)
    assert launches["paged_decode_split_kernel"]["first_s"] == 1.5


def test_host_overhead_runs_on_cpu_and_writes_its_json(tmp_path):
    """benchmarks/host_overhead.py on CPU (one layer, batch 1, a few calls): every variant timed, the differences,
    the report of ours, and the profile of ours with its top functions."""
    import host_overhead

    out = tmp_path / "host.json"
    result = host_overhead.main(["--device", "cpu", "--layers", "1", "--batches", "1", "--rounds", "2",
                                 "--calls", "2", "--profile", "2", "--profile-top", "3", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"], default=str))
    assert saved["env"]["device"] == "cpu" and saved["env"]["torch"] == torch.__version__
    assert saved["variants"] == ["ours", "stock", "eager", "ours_dynamo"]
    (row,) = saved["rows"]
    assert "error" not in row, row.get("error")
    assert (row["layers"], row["batch"]) == (1, 1)
    assert set(row["variants"]) == {"ours", "stock", "eager", "ours_dynamo"}
    for timing in row["variants"].values():
        for key in ("host_us", "wall_us", "thread_us"):
            assert timing[key] > 0 and len(timing[f"rounds_{key}"]) == 2
    assert row["ours_minus_stock_host_us"] == pytest.approx(row["variants"]["ours"]["host_us"]
                                                            - row["variants"]["stock"]["host_us"])
    assert row["ours_report"]["rewritten"] == 1 and row["ours_report"]["syncs_remaining"] == 0
    profile = row["profile"]["ours"]
    assert profile["calls"] == 2 and len(profile["top_cumulative"]) == len(profile["top_self"]) == 3
    assert any("backend.py" in entry["function"] for entry in profile["top_cumulative"])
    layers = [layer["layer"] for layer in profile["layers"]]
    assert layers[0].startswith("ours: compile_pass.compile's call wrapper") and any("Dynamo" in x for x in layers)
    assert all(layer["cumulative_us"] >= layer["own_us"] for layer in profile["layers"])
    assert all(entry["function"].startswith("compile_pass/") for entry in profile["compile_pass_functions"])


def test_host_overhead_profile_paths_are_short():
    import host_overhead

    assert host_overhead.short_path("/x/lib/python3.11/site-packages/torch/_dynamo/eval_frame.py") == \
        "torch/_dynamo/eval_frame.py"
    assert host_overhead.short_path("/work/main/compile_pass/backend.py") == "compile_pass/backend.py"
    assert host_overhead.short_path("~") == "~"


def test_the_engine_steps_dry_run_is_eager_s_values_on_cpu(tmp_path):
    """benchmarks/engine_steps_gpu.py's CPU dry run at its default bound (4096; the regional model's own is 256):
    the regional step, TRTLLM-MLA's round-up and FlashMLA's grown scratch, `cudagraphs=True` decided as on the
    GPU, each rewritten and equal to eager on its own state. Found 2026-12-05: the regional step's eager reference
    ran on a KV pool that nothing reset between vectors (the compiled run's differed from it by up to 0.13), and at
    the old default bound (1024, not a multiple of TRTLLM's round-up span) the round-up broke the graph, an error
    under fullgraph=True."""
    import subprocess

    out = tmp_path / "engine_steps.json"
    proc = subprocess.run([sys.executable, "engine_steps_gpu.py", "--device", "cpu", "--cudagraphs", "--steps",
                           "regional", "trtllm_round_up", "flashmla_scratch", "--batches", "2", "--vectors", "2",
                           "--json", str(out)], cwd=Path(__file__).resolve().parents[1] / "benchmarks",
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["env"]["device"] == "cpu"
    steps = {s["step"]: s for s in result["steps"]}
    assert set(steps) == {"regional", "trtllm_round_up", "flashmla_scratch"}
    for name, step in steps.items():
        assert step["ok"] and step["status"] == "rewritten", (name, step.get("problems"))
        assert step["options"]["max_context_len"] == (256 if name == "regional" else 4096)  # the model's own
        assert step["options"]["cudagraphs"] is True
        assert len(step["vectors"]) == 2 and all(v["equal"] for v in step["vectors"]), (name, step["vectors"])
    assert result["ok"]

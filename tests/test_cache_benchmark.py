"""benchmarks/compile_time.py's start-up runs (issue 29): the plan of cold, warm, shipped and precompiled runs, the
backend-option knobs, and the count of distinct kernel sources (the pure helpers; the script itself is run with
--smoke)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def test_shipped_and_precompiled_runs_follow_the_warm_ones_and_use_the_cold_runs_files():
    import compile_time

    runs = compile_time.plan_runs(["syncfree-regional", "stock-whole"], ["no-checked"], "syncfree-regional",
                                  warm=True, shipped=True)
    assert [r["name"] for r in runs] == [
        "syncfree-regional cold", "stock-whole cold", "syncfree-regional warm", "stock-whole warm",
        "syncfree-regional shipped", "stock-whole shipped", "syncfree-regional precompiled",
        "syncfree-regional precompiled kept-triton", "syncfree-regional cold no-checked"]
    shipped = runs[4]
    assert shipped["artifacts"] == runs[0]["caches"] and shipped["caches"] != runs[0]["caches"]
    # 2 cold (warm reruns share them), 2 shipped, 1 precompiled, 1 precompiled kept-triton, 1 knob
    assert len({r["caches"] for r in runs}) == 7
    assert "shipped" not in {r["cache"] for r in compile_time.plan_runs(["stock-whole"], [], "syncfree-regional",
                                                                        warm=True)}


def test_a_kept_triton_start_reads_the_cold_runs_step_and_triton_cache_with_new_inductor_caches():
    import compile_time

    runs = compile_time.plan_runs(["syncfree-regional", "stock-whole"], [], "syncfree-regional", warm=False,
                                  shipped=True)
    assert [r["name"] for r in runs] == ["syncfree-regional cold", "stock-whole cold", "syncfree-regional shipped",
                                         "stock-whole shipped", "syncfree-regional precompiled",
                                         "syncfree-regional precompiled kept-triton"]
    cold, precompiled, kept = runs[0], runs[4], runs[5]
    # fresh Inductor caches of its own, the cold run's step file and Triton cache
    assert kept["caches"] not in (cold["caches"], precompiled["caches"]) and "triton_from" not in precompiled
    assert kept["artifacts"] == kept["triton_from"] == cold["caches"] == "syncfree-regional"
    assert compile_time.SAVED[kept["cache"]] == compile_time.SAVED["precompiled"]
    env = compile_time.cache_env("/r/kept", triton_root="/r/cold")
    assert env == {"TORCHINDUCTOR_CACHE_DIR": "/r/kept/inductor", "TMPDIR": "/r/kept/tmp",
                   "TRITON_CACHE_DIR": "/r/cold/triton"}
    assert compile_time.cache_env("/r/x")["TRITON_CACHE_DIR"] == "/r/x/triton"
    assert "syncfree-regional precompiled kept-triton" not in [
        r["name"] for r in compile_time.plan_runs(["syncfree-regional"], [], "syncfree-regional", warm=False,
                                                  shipped=True, kept_triton=False)]
    walls = {("syncfree-regional", "cold"): 80.0, ("syncfree-regional", "precompiled"): 20.0}
    assert compile_time.expected_wall(walls, kept) == 20.0 and compile_time.expected_wall(walls, runs[2]) == 80.0
    assert compile_time.triton_written(None) == "-"
    assert compile_time.triton_written(dict(kernels=3, written=3, present=0, conflicts=0, failed=0)) == \
        "3 kernels: 3 written, 0 present, 0 conflicts, 0 failed"


def test_backend_option_knobs():
    import compile_time

    assert compile_time.parse_knob("no-checked")["options"] == {"checked": False}
    assert compile_time.parse_knob("opt:checked=False")["options"] == {"checked": False}
    assert compile_time.parse_knob("opt:length_bounds={'verify_lens': 8}")["options"] == {
        "length_bounds": {"verify_lens": 8}}
    with pytest.raises(SystemExit, match="opt:KEY=VALUE"):
        compile_time.parse_knob("opts:checked=False")


def test_distinct_kernels_are_counted_by_source_without_their_names():
    import compile_time

    body = "def {0}(in_ptr0, out_ptr0):\n    meta = {{'kernel_name': '{0}'}}\n    x = tl.load(in_ptr0)\n"
    kernels = [("triton", f"triton_poi_fused_add_{i}", body.format(f"triton_poi_fused_add_{i}")) for i in range(32)]
    kernels.append(("triton", "triton_red_fused_mean_0", body.format("triton_red_fused_mean_0") + "    r = 1\n"))
    kernels.append(("cpp", "", "extern \"C\" void kernel(float* x) {}"))
    assert compile_time.kernel_sources_summary(kernels) == {"triton": dict(n=33, distinct=2),
                                                            "cpp": dict(n=1, distinct=1)}


def test_smoke_settings_and_the_stage():
    import compile_time

    args = compile_time.parse_args(["--smoke"])
    assert args.device == "cpu" and args.shape == "tiny" and args.layers == 2 and args.shipped
    assert args.variants == compile_time.SMOKE["variants"]
    script = open(os.path.join(os.path.dirname(compile_time.__file__), "run_h200.sh")).read()
    stage = script.split("    startup)")[1].split(";;")[0]
    assert "    startup)" in script and "compile_time.py" in stage
    assert "--variants ${STARTUP_VARIANTS:-syncfree-regional syncfree-whole stock-whole stock-regional}" in stage


def test_the_budget_expects_a_start_to_take_what_its_warm_run_took():
    import compile_time

    walls = {("syncfree-regional", "cold"): 60.0, ("syncfree-regional", "warm"): 20.0, ("stock-whole", "cold"): 45.0}
    run = lambda variant, cache: dict(variant=variant, cache=cache)  # noqa: E731
    assert compile_time.expected_wall(walls, run("syncfree-regional", "shipped")) == 20.0
    assert compile_time.expected_wall(walls, run("syncfree-regional", "cold")) == 60.0
    assert compile_time.expected_wall(walls, run("stock-whole", "shipped")) == 45.0
    assert compile_time.expected_wall(walls, run("syncfree-whole", "cold")) == 60.0


def test_repeated_cold_runs_come_in_rounds_each_on_caches_of_its_own_and_only_the_first_round_is_rerun():
    import compile_time

    runs = compile_time.plan_runs(["syncfree-regional", "stock-regional"], [], "syncfree-regional", warm=True,
                                  shipped=True, kept_triton=False, repeat=3)
    names = [r["name"] for r in runs]
    assert names[:6] == ["syncfree-regional cold", "stock-regional cold", "syncfree-regional cold #2",
                         "stock-regional cold #2", "syncfree-regional cold #3", "stock-regional cold #3"]
    cold = [r for r in runs if r["cache"] == "cold"]
    assert len({r["caches"] for r in cold}) == 6  # every cold run starts on empty caches of its own
    assert [r.get("round") for r in cold] == [None, None, 2, 2, 3, 3]
    # warm, shipped and precompiled reruns only of the first round's runs
    for rerun in runs[6:]:
        assert rerun["cache"] != "cold"
        assert rerun.get("artifacts", rerun["caches"]).split("+")[0] in ("syncfree-regional", "stock-regional")
        assert "#" not in rerun["caches"]
    assert compile_time.plan_runs(["stock-whole"], [], "syncfree-regional", warm=False, repeat=1) == \
        compile_time.plan_runs(["stock-whole"], [], "syncfree-regional", warm=False)
    with pytest.raises(ValueError, match="repeat"):
        compile_time.plan_runs(["stock-whole"], [], "syncfree-regional", warm=False, repeat=0)
    with pytest.raises(SystemExit):
        compile_time.parse_args(["--repeat", "0"])


def test_repeated_rounds_interleave_the_knobs_runs_with_the_plain_ones():
    import compile_time

    runs = compile_time.plan_runs(["syncfree-regional"], ["no-kernel-warmup"], "syncfree-regional", warm=False,
                                  repeat=2)
    assert [r["name"] for r in runs] == [
        "syncfree-regional cold", "syncfree-regional cold no-kernel-warmup", "syncfree-regional cold #2",
        "syncfree-regional cold no-kernel-warmup #2"]
    assert len({r["caches"] for r in runs}) == 4 and runs[3]["knob"] == "no-kernel-warmup"


def test_cold_medians_take_every_round_per_variant_and_knob_and_count_failures():
    import compile_time

    def result(variant, first_call, cache="cold", knob="default", **extra):
        return dict(run=dict(variant=variant, cache=cache, knob=knob), first_call_s=first_call, **extra)

    medians = compile_time.cold_medians([
        result("syncfree-regional", 12.0), result("syncfree-regional", 10.0), result("syncfree-regional", 15.0),
        result("syncfree-regional", 11.0), result("syncfree-regional", None, error="timed out after 200 s"),
        result("syncfree-regional", 1.0, cache="warm"), result("syncfree-regional", 2.0, knob="no-checked"),
        result("stock-regional", 22.5)])
    regional = medians["syncfree-regional"]
    assert regional["runs"] == 4 and regional["failed"] == 1
    assert regional["median_s"] == 11.5 and (regional["min_s"], regional["max_s"]) == (10.0, 15.0)
    assert medians["syncfree-regional no-checked"]["median_s"] == 2.0
    assert medians["stock-regional"]["median_s"] == 22.5
    assert set(medians) == {"syncfree-regional", "syncfree-regional no-checked", "stock-regional"}

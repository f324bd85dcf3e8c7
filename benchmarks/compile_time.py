"""Benchmark: where the first call of the 8B-shaped decode loop spends its time, cold, warm and from shipped
cache artifacts (issues 22 and 29).

    python benchmarks/compile_time.py [--variants syncfree-regional syncfree-whole stock-regional stock-whole]
                                      [--knobs threads1 prewarm-pool ... | cfg:KEY=VALUE | env:NAME=VALUE
                                       | opt:KEY=VALUE]
                                      [--knob-variant syncfree-regional ...] [--repeat N] [--no-warm] [--no-shipped]
                                      [--no-precompiled] [--no-kept-triton]
                                      [--budget S] [--timeout S] [--smoke]
                                      [--layers 32] [--batch 1] [--context 4096] [--steps 128]
                                      [--device cuda|cpu] [--shape 8b|tiny] [--trace DIR] [--profile DIR]
                                      [--json out.json]

Every run is a fresh process (this script with --child) that builds the model and the step exactly as
decode_loop.py's --cold-compile does (decode_loop.model_config, TinyLlama, Loop, make_variant), makes the first
call and prints one RESULT line of JSON; this process never imports torch, so it holds no GPU. A "cold" run gets
empty TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and TMPDIR (temporary directories); its "warm" rerun is a second
fresh process on the same, now filled, directories (Dynamo traces again; AOT, Inductor and Triton artifacts come
from the caches). A "shipped" run is a fresh process on new, empty directories that first loads the artifacts
file its variant's cold run saved (compile_pass.cache.save_artifacts / load_artifacts: torch's mega-cache, the
post-grad findings and, from cache FORMAT 2 on, the Triton binaries of the project's own kernels), as a serving
machine does with artifacts built at image build time. A "precompiled" run (syncfree variants, where torch has
aot_compile) is a fresh process on new, empty directories that reads the step its variant's cold run AOT-compiled
after its timed calls (compile_pass.cache.aot_compile / load_compiled: no Dynamo trace at the first call; the step
file carries the project's Triton binaries too, so that all caches empty, the project's kernels do not JIT).
A "precompiled-kept-triton" run reads the same step in a fresh process on new, empty Inductor and TMPDIR
directories but the cold run's own TRITON_CACHE_DIR (a Triton cache kept on disk from the build: the binaries
the step brings are already there, so loading writes none). Their cache_load / precompiled_load records say what
the load wrote into the Triton cache (`triton`: entries written, already present, conflicts). Variants:
  syncfree-regional   decode_loop's (e): compile_pass.compile(..., cudagraphs=True), TinyLlamaConfig(regional=True)
  syncfree-whole      (e) without regions
  stock-regional      decode_loop's (b): stock torch.compile, regional
  stock-whole         (b) without regions
  stock-static-regional  decode_loop's (f): stock torch.compile of the hand-written sync-free step (a static-width
                      page table filled on the device), regional: the graph an engine writing it by hand gives
                      torch.compile, without the pass (the floor for the syncfree rows)
  stock-static-whole  (f) without regions
  syncfree-whole-outlined  (e) without regions, with the backend option outline_repeats=True (the repeated layers
                      compiled once as one compiled region: compile_pass.outline_repeats)
Knobs (each one more cold run of each --knob-variant, after the variants and their warm reruns):
  threads1               TORCHINDUCTOR_COMPILE_THREADS=1: every Triton compile in this process, no worker pool
  prewarm-pool           start Inductor's compile-worker pool at process start (overlaps the model build and
                         Dynamo's tracing; otherwise compile_fx starts it, and kernels compile here until it is up)
  fork-pool              worker_start_method="fork" instead of the default (a subprocess that imports torch)
  no-pointwise-autotune  triton.autotune_pointwise=False: one config per pointwise kernel, nothing benchmarked
  no-cudagraph-trees     triton.cudagraph_trees=False: plain cudagraphify instead of CUDA-graph trees
  no-pattern-matcher     pattern_matcher=False: no pre/post-grad pattern passes
  cfg:KEY=VALUE          any Inductor config (dotted, e.g. cfg:triton.persistent_reductions=False)
  env:NAME=VALUE         any environment variable of the child (e.g. env:TORCHINDUCTOR_COMPILE_THREADS=16)
  opt:KEY=VALUE          a syncfree backend option of the (e) variants (e.g. opt:checked=False: no device assert)
  no-schema-cache        SYNCFREE_REGION_SCHEMA_CACHE=0: torch 2.11's own region-schema derivation, a make_fx
                         trace of the body at every region call in each AOTAutograd pass, instead of the backend's
                         cache (compile_pass._compat.region_schema_cache; later torch caches it itself)
  no-checked             opt:checked=False (what the pass's device assertion costs in compile time)
  stacked-kv             one stacked KV pool, the views k_pool[i] per layer, instead of the default tensor per
                         layer (TinyLlama.new_kv_pool(per_layer=True), as SGLang keeps a buffer per layer). A
                         region's body is keyed by its inputs' storage offsets too, so the stacked pool gives a body
                         per layer, each lowered again (the regional default before 2026-12-02, the whole-model
                         default before its eighth session; `per-layer-kv` is now the same as no knob)
  no-kernel-warmup       SYNCFREE_PREWARM_KERNELS=0: this package's kernels compile at their first launch, in the
                         first call, instead of in the backend's helper process while Inductor compiles
                         (compile_pass.kernel_warmup, kernels/compile_ahead.py)
  kernel-warmup-thread   SYNCFREE_PREWARM_KERNELS=thread: they compile in a thread of this process beside
                         Inductor's compile (the ninth session's way), not in the helper process
  outline-repeats        opt:outline_repeats=True: the backend outlines the whole model's repeated stretches into
                         one compiled region (compile_pass.outline_repeats); for the syncfree-whole variant
--repeat N: N cold runs of every variant and knob, each in a fresh process on new empty caches, in rounds (every
variant and knob once, then again): the medians of the first calls per variant and knob close the output and go to
the JSON's `cold_medians`.
Only the first round's runs save artifacts and get warm, shipped and precompiled reruns.
--smoke: the CPU smoke run (tiny model, 2 layers, the syncfree-regional and stock-whole variants, one knob).
With --budget a run is not started when the time left is below what it is expected to take (the process wall of
its variant's cold run, else the longest cold run so far), and each run's timeout is cut to the time left; the
skipped runs are listed in the JSON, which is rewritten after every run. Per run the JSON holds:
  wall: process, import (torch, the project, Inductor), model build, first / second / third call;
  phases (seconds, inclusive, summed over every call of each phase: they nest) from torch's own dynamo_timed
    records (torch._dynamo.utils.compilation_time_metrics, what compile_times() prints): Dynamo's whole compile,
    bytecode tracing, guards, the backend call, AOTAutograd, Inductor's compile_fx_inner, pre/joint/post-grad
    passes, lowering, scheduling, codegen, module load, the wait for async Triton compiles, in-process Triton
    compiles, runtime autotuning, CUDA-graph recording; `derived` subtracts the nested ones (Dynamo's own
    tracing = the whole compile - the backend call; the first call's time outside any compile = warm-up run,
    the project's kernels' JIT, autotuning, CUDA graphs); `raw` is every dynamo_timed key seen;
  compilation_metrics: torch's CompilationMetrics records (get_compilation_metrics()), their numeric fields
    summed (dynamo/aot/inductor cumulative us, triton_compile_time_us, runtime_cudagraphify_time_us, ...);
  counts: frames, Dynamo graphs, graph breaks (and reasons), recompiles, outer compile_fx calls (the syncfree
    backend compiles once more when a cached graph lacks its post-grad findings), Inductor graphs lowered (top-level
    and region subgraphs, by name: each nested_compile_region body should lower once), FX-graph / AOT caches;
  triton: Inductor kernels (count, the compile time each took in its worker or here, the slowest), every Triton
    compile made in this process (count, time, cache hits: early Inductor kernels before the worker pool is up,
    re-loads of worker-built ones, and the project's own kernels, paged_decode and page_table, which JIT at their
    first launch), each @triton.jit kernel's launches from Python (the first one holds its JIT), the binaries
    left in TRITON_CACHE_DIR;
  cudagraphs: Inductor's partition lines, its cudagraph counters; syncfree: the pass's and the backend's seconds
    (SyncReport.pass_seconds / backend_seconds), rewritten / kept.
Fields this torch or triton lacks are null. --trace DIR sets TORCH_TRACE for each run (DIR/<run>, for tlparse).
--profile DIR runs each first call under cProfile and writes DIR/<run>.pstats (`python -m pstats`); the profiler
slows Python down, so such a run's seconds are for the profile's proportions, not for the tables.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

_START = time.perf_counter()

VARIANTS = {  # name -> (decode_loop variant, regional)
    "syncfree-regional": ("e", True),
    "syncfree-whole": ("e", False),
    "stock-regional": ("b", True),
    "stock-whole": ("b", False),
    # stock torch.compile of the hand-written sync-free step (decode_loop's (f): a static-width page table filled
    # on the device): the same kind of graph as ours, compiled without the pass. What a sync-free step costs
    # torch.compile when an engine writes it by hand: the floor to compare the syncfree rows against.
    "stock-static-regional": ("f", True),
    "stock-static-whole": ("f", False),
    # (e) on the whole model with the backend option outline_repeats=True: the repeated layers compiled once
    "syncfree-whole-outlined": ("e", False),
}
VARIANT_OPTIONS = {"syncfree-whole-outlined": {"outline_repeats": True}}  # backend options of a variant

KNOBS = {
    "threads1": dict(env={"TORCHINDUCTOR_COMPILE_THREADS": "1"}),
    "prewarm-pool": dict(prewarm_pool=True),
    "fork-pool": dict(config={"worker_start_method": "fork"}),
    "no-pointwise-autotune": dict(config={"triton.autotune_pointwise": False}),
    "no-cudagraph-trees": dict(config={"triton.cudagraph_trees": False}),
    "no-pattern-matcher": dict(config={"pattern_matcher": False}),
    "no-checked": dict(options={"checked": False}),
    "stacked-kv": dict(stacked_kv=True),
    "no-schema-cache": dict(env={"SYNCFREE_REGION_SCHEMA_CACHE": "0"}),
    "no-kernel-warmup": dict(env={"SYNCFREE_PREWARM_KERNELS": "0"}),
    "kernel-warmup-thread": dict(env={"SYNCFREE_PREWARM_KERNELS": "thread"}),
    "outline-repeats": dict(options={"outline_repeats": True}),
    "per-layer-kv": dict(),  # the regional variants' default since 2026-12-02 (kept: older commands name it)
}

# A small model for a CPU smoke run: the loop's structure, not its size.
TINY = dict(vocab=256, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)

# Labels -> the dynamo_timed key whose records make the phase (inclusive; a phase inside another counts in both).
PHASES = {
    "dynamo_compile": "_compile.compile_inner",
    "dynamo_bytecode_tracing": "bytecode_tracing",
    "dynamo_build_guards": "build_guards",
    "dynamo_invoke_subgraph_trace": "invoke_subgraph_trace",
    "backend_call": "OutputGraph.call_user_compiler",
    "aot_autograd": "create_aot_dispatcher_function",
    "aot_collect_metadata": "aot_collect_metadata",
    "aot_trace_joint_graph": "aot_trace_joint_graph",
    "inductor_fw_compiler": "compile_fx.<locals>.fw_compiler_base",
    "inductor_compile_fx_inner": "compile_fx_inner",
    "inductor_fx_codegen_and_compile": "fx_codegen_and_compile",
    "inductor_pre_grad_passes": "_recursive_pre_grad_passes",
    "inductor_joint_graph_passes": "_recursive_joint_graph_passes",
    "inductor_post_grad_passes": "_recursive_post_grad_passes",
    "inductor_lowering": "GraphLowering.run",
    "inductor_code_gen": "GraphLowering.compile_to_module",
    "inductor_graph_codegen": "GraphLowering.codegen",
    "inductor_scheduler_init": "Scheduler.__init__",
    "inductor_scheduler_codegen": "Scheduler.codegen",
    "inductor_wrapper_codegen": "PythonWrapperCodegen.generate",
    "inductor_load_module": "PyCodeCache.load_by_key_path",
    "triton_async_wait": "async_compile.wait",
    "triton_in_process_precompile": "async_compile.precompile",
    "triton_reload_in_parent": "reload_kernel_in_parent",
    "triton_bundler_collect": "TritonBundler.collect",
    "triton_runtime_autotune": "CachingAutotuner.benchmark_all_configs",
    "cudagraph_get_container": "cudagraphify.get_container",
    "cudagraph_record": "CUDAGraphNode.record",
    "cpp_compile": "compile_file",
    "inductor_torch_key": "inductor_codecache_torch_key",
    "inductor_triton_key": "CacheBase.get_system.triton_key",
    "gc": "gc",
}

# Differences of nested phases: key -> (what it is, outer phase, inner phases subtracted).
DERIVED = {
    "dynamo_own": ("Dynamo's own work: its whole compile less the backend call", "dynamo_compile", ("backend_call",)),
    "backend_outside_aot": ("the backend call less AOTAutograd: the syncfree pass, compile_fx's setup",
                            "backend_call", ("aot_autograd",)),
    "aot_outside_inductor": ("AOTAutograd less Inductor's forward compiler", "aot_autograd",
                             ("inductor_fw_compiler",)),
    "inductor_other": ("compile_fx_inner less post-grad passes, lowering and code_gen", "inductor_compile_fx_inner",
                       ("inductor_post_grad_passes", "inductor_lowering", "inductor_code_gen")),
    "code_gen_other": ("code_gen less the Triton wait and the module load", "inductor_code_gen",
                       ("triton_async_wait", "inductor_load_module")),
}
OUTSIDE = ("outside_compile", "the first call less Dynamo's whole compile: the warm-up run, the project's kernels' "
           "JIT, runtime autotuning, CUDA graphs")
NO_KNOB = {"env": {}, "config": {}, "prewarm_pool": False, "stacked_kv": False}
ARTIFACTS = "artifacts.bin"  # in a cold run's cache root: compile_pass.cache.save_artifacts' file
PRECOMPILED = "step.aot"  # beside it: the step compile_pass.cache.aot_compile saved (syncfree variants)
SAVED = {"shipped": (ARTIFACTS, "load_artifacts"), "precompiled": (PRECOMPILED, "load_precompiled"),
         "precompiled-kept-triton": (PRECOMPILED, "load_precompiled")}  # start kind -> the file it loads, spec key
SMOKE = dict(variants=["syncfree-regional", "stock-whole"], knobs=["no-checked"], device="cpu")


# -- pure helpers (tested on CPU in tests/test_benchmark_helpers.py) ------------------------------------------------
def parse_knob(name: str) -> dict:
    """A knob's settings: {"env": {...}, "config": {...}, "prewarm_pool": bool}; SystemExit naming a bad one."""
    if name == "default":
        return dict(NO_KNOB)
    if name in KNOBS:
        return {**NO_KNOB, **KNOBS[name]}
    kind, _, setting = name.partition(":")
    key, eq, value = setting.partition("=")
    if kind not in ("cfg", "env", "opt") or not key or not eq:
        raise SystemExit(f"unknown knob {name!r}: one of {', '.join(KNOBS)}, cfg:KEY=VALUE, env:NAME=VALUE or "
                         "opt:KEY=VALUE")
    if kind == "env":
        return {**NO_KNOB, "env": {key: value}}
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    return {**NO_KNOB, ("config" if kind == "cfg" else "options"): {key: parsed}}


def plan_runs(variants, knobs, knob_variant: str | list[str], warm: bool, shipped: bool = False,
              kept_triton: bool = True, repeat: int = 1) -> list[dict]:
    """The runs in the order they are worth having: every variant cold; with repeat > 1, the knobs' cold runs and
    `repeat - 1` more rounds of every variant and knob (`round` 2, 3, ...: one round after another, so that a
    machine's drift reaches them alike; each run on new empty caches of its own); the first round's warm reruns
    (same caches), shipped-cache starts (new empty caches, the cold run's artifacts loaded first: `artifacts` names
    the cold run's caches), precompiled starts (new empty caches) and, with kept_triton, precompiled starts on the
    cold run's Triton cache (`triton_from` names the cold run's caches); with repeat == 1, one cold run per knob of
    each knob variant last. knob_variant: one name or a list; a knob variant not among the variants gets its plain
    cold run first."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    knob_variants = [knob_variant] if isinstance(knob_variant, str) else list(knob_variant)
    cold = list(variants)
    for v in reversed(knob_variants):
        if knobs and v not in cold:
            cold.insert(0, v)

    def cold_run(v: str, knob: str, i: int) -> dict:
        """Round i's cold run of variant v with one knob ("default": none)."""
        knobbed, again = ("" if knob == "default" else knob), ("" if i == 1 else f"#{i}")
        return dict(name=" ".join(filter(None, (v, "cold", knobbed, again))), variant=v, knob=knob, cache="cold",
                    caches=v + (f"+{knobbed}" if knobbed else "") + again, **({"round": i} if i > 1 else {}))

    def knob_runs(i: int) -> list[dict]:
        return [cold_run(v, k, i) for v in knob_variants for k in knobs]

    runs = [cold_run(v, "default", 1) for v in cold]
    if repeat > 1:
        runs += knob_runs(1)
        for i in range(2, repeat + 1):
            runs += [cold_run(v, "default", i) for v in cold] + knob_runs(i)
    if warm:
        runs += [dict(name=f"{v} warm", variant=v, knob="default", cache="warm", caches=v) for v in cold]
    if shipped:
        runs += [dict(name=f"{v} shipped", variant=v, knob="default", cache="shipped", caches=f"{v}+shipped",
                      artifacts=v) for v in cold]
        runs += [dict(name=f"{v} precompiled", variant=v, knob="default", cache="precompiled",
                      caches=f"{v}+precompiled", artifacts=v) for v in cold if VARIANTS[v][0] == "e"]
        if kept_triton:
            runs += [dict(name=f"{v} precompiled kept-triton", variant=v, knob="default",
                          cache="precompiled-kept-triton", caches=f"{v}+precompiled-kept-triton", artifacts=v,
                          triton_from=v) for v in cold if VARIANTS[v][0] == "e"]
    if repeat == 1:
        runs += knob_runs(1)
    return runs


def cold_medians(results: list[dict]) -> dict:
    """{"variant" or "variant knob": {runs, median_s, min_s, max_s, first_calls_s, failed}} over the cold first
    calls (every round of --repeat); a run that failed is left out, and counted under `failed`."""
    by_variant: dict[str, dict] = {}
    for r in results:
        run = r["run"]
        if run["cache"] != "cold":
            continue
        label = run["variant"] if run["knob"] == "default" else f"{run['variant']} {run['knob']}"
        entry = by_variant.setdefault(label, dict(first_calls_s=[], failed=0))
        if "error" in r or r.get("first_call_s") is None:
            entry["failed"] += 1
        else:
            entry["first_calls_s"].append(r["first_call_s"])
    for entry in by_variant.values():
        calls = sorted(entry["first_calls_s"])
        entry.update(runs=len(calls), median_s=statistics.median(calls) if calls else None,
                     min_s=calls[0] if calls else None, max_s=calls[-1] if calls else None)
    return by_variant


def expected_wall(walls: dict, run: dict) -> float:
    """What a run is expected to take: its variant's run of the same cache kind, else (a kept-triton start) its
    precompiled start, else (a shipped or precompiled start) its warm run, else its cold run, else the longest run
    so far."""
    for cache in (run["cache"], "precompiled" if run["cache"] == "precompiled-kept-triton" else None,
                  "warm" if run["cache"] != "cold" else None, "cold"):
        if (run["variant"], cache) in walls:
            return walls[(run["variant"], cache)]
    return max(walls.values(), default=0.0)


def timed_delta(before: dict, after: dict) -> dict:
    """{key: [seconds...]} records added between two copies of compilation_time_metrics."""
    return {k: list(v[len(before.get(k, ())):]) for k, v in after.items() if len(v) > len(before.get(k, ()))}


def phases_of(delta: dict) -> dict:
    """Seconds per phase label (None where no record of its key was made: not run, or not in this torch)."""
    return {label: (sum(delta[key]) if key in delta else None) for label, key in PHASES.items()}


def derived_of(phases: dict, first_call_s: float | None = None) -> dict:
    """The DERIVED differences (None where the outer phase has no record), and with the first call's wall, the
    time it spent outside Dynamo's compile."""
    out = {}
    for key, (_, outer, inner) in DERIVED.items():
        out[key] = None if phases.get(outer) is None else phases[outer] - sum(phases.get(i) or 0.0 for i in inner)
    if first_call_s is not None:
        out[OUTSIDE[0]] = first_call_s - (phases.get("dynamo_compile") or 0.0)
    return out


def kernel_kind(name: str) -> str:
    """Inductor's generated kernels are named triton_*; the project's are its @triton.jit functions."""
    if name.startswith("triton_"):
        return "inductor"
    if any(mark in name for mark in ("paged_decode", "page_table", "kv_indices", "store_kv", "kv_store")):
        return "project"
    return "other"


def triton_summary(parent_compiles: list[dict], worker_infos: list[tuple[str, float | None]]) -> dict:
    """Triton compiles seen in this process (`parent_compiles`: name, s, cache_hit) and Inductor's per-kernel
    compile records (`worker_infos`: name, seconds, measured in the worker that built it, or here)."""
    by_kind: dict = defaultdict(lambda: dict(n=0, s=0.0, cache_hits=0, misses=0, unknown=0))
    per_kernel: dict = {}
    for c in parent_compiles:
        kind = kernel_kind(c["name"])
        slot = by_kind[kind]
        slot["n"] += 1
        slot["s"] += c["s"]
        slot["cache_hits" if c["cache_hit"] is True else "misses" if c["cache_hit"] is False else "unknown"] += 1
        if kind != "inductor":
            k = per_kernel.setdefault(c["name"], dict(n=0, s=0.0, cache_hits=0))
            k["n"] += 1
            k["s"] += c["s"]
            k["cache_hits"] += c["cache_hit"] is True
    timed = [(n, s) for n, s in worker_infos if s is not None]
    project = [c for c in parent_compiles if kernel_kind(c["name"]) == "project"]
    return dict(
        inductor_kernels=len(worker_infos),
        inductor_kernel_compile_s_sum=sum(s for _, s in timed) if timed else None,
        inductor_kernel_compile_s_max=max((s for _, s in timed), default=None),
        slowest_inductor_kernels=[dict(name=n[:90], s=s) for n, s in sorted(timed, key=lambda x: -x[1])[:8]],
        compiles_in_this_process=dict(by_kind),
        project_and_other_kernels=per_kernel,
        project_kernels_jit_s=sum(c["s"] for c in project),
        # of which in the calling thread, i.e. not in compile_pass.kernel_warmup's thread (a load of the helper
        # process's compile, or with =thread the compile itself) beside Inductor's compile
        project_kernels_jit_in_call_s=sum(c["s"] for c in project if c.get("thread", "MainThread") == "MainThread"),
    )


def kernel_sources_summary(kernels: list[tuple[str, str, str]]) -> dict:
    """Per kind (triton, cpp): kernels Inductor asked to compile (name, source) and how many distinct sources among
    them, a kernel's own name left out of its source (the same layer body compiled in two graphs gets two names):
    32 identical layers should give one set."""
    import hashlib

    out: dict = {}
    for kind, name, source in kernels:
        slot = out.setdefault(kind, dict(n=0, distinct=set()))
        slot["n"] += 1
        text = source.replace(name, "KERNEL") if name else source
        slot["distinct"].add(hashlib.sha1(text.encode()).hexdigest())
    return {kind: dict(n=v["n"], distinct=len(v["distinct"])) for kind, v in out.items()}


def launch_summary(launches: list[tuple[str, float]]) -> dict:
    """Per @triton.jit kernel launched from Python: launches, the first one's seconds (its JIT compile, or its
    load from Triton's cache, plus the launch), the slowest and the total."""
    out: dict = {}
    for name, s in launches:
        k = out.setdefault(name, dict(n=0, first_s=s, max_s=0.0, total_s=0.0))
        k["n"] += 1
        k["max_s"] = max(k["max_s"], s)
        k["total_s"] += s
    return out


# -- the one door to private APIs -------------------------------------------------------------------------------
def private(path: str, default=None):
    """The object at a dotted path in torch's or triton's internals, or `default` where this build lacks it.
    Every private name this script reads or wraps goes through here."""
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return default
        return obj
    return default


def wrap(path: str, make) -> bool:
    """Replace the function at `path` by make(original); False where it does not exist."""
    owner_path, _, attr = path.rpartition(".")
    owner = private(owner_path)
    original = getattr(owner, attr, None) if owner is not None else None
    if original is None:
        return False
    setattr(owner, attr, make(original))
    return True


# -- the child: one first call, measured --------------------------------------------------------------------------
class Probes:
    """What this process compiles, recorded by small wrappers around torch's and triton's functions."""

    def __init__(self):
        self.top: dict = defaultdict(list)  # outermost calls of a wrapped function: seconds
        self.nested: dict = defaultdict(list)  # calls inside another call of the same function
        self.depth: dict = defaultdict(int)
        self.lowerings: list[tuple[str, str]] = []  # (class, graph name) of every GraphLowering built
        self.triton: list[dict] = []  # Triton compiles in this process
        self.worker_infos: list[tuple[str, float | None]] = []  # Inductor's per-kernel compile records
        self.launches: list[tuple[str, float]] = []  # (kernel, seconds) of each @triton.jit launch from Python
        self.kernels: list[tuple[str, str, str]] = []  # (kind, name, source) Inductor handed to AsyncCompile
        self.local = threading.local()
        self.installed: dict[str, bool] = {}

    def timer(self, key):
        def make(original):
            @functools.wraps(original)
            def timed(*args, **kwargs):
                depth = self.depth[key]
                self.depth[key] = depth + 1
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.depth[key] = depth
                    (self.top if depth == 0 else self.nested)[key].append(time.perf_counter() - start)
            return timed
        return make

    def install(self):
        inst = self.installed
        inst["compile_fx"] = wrap("torch._inductor.compile_fx.compile_fx", self.timer("compile_fx"))
        inst["cudagraphify_impl"] = wrap("torch._inductor.compile_fx.cudagraphify_impl",
                                         self.timer("cudagraphify_impl"))
        inst["GraphLowering.run"] = wrap("torch._inductor.graph.GraphLowering.run", self.timer("GraphLowering.run"))
        probes = self

        def make_init(original):
            @functools.wraps(original)
            def __init__(self, *args, **kwargs):
                original(self, *args, **kwargs)
                probes.lowerings.append((type(self).__name__, str(getattr(self, "name", None))))
            return __init__
        inst["GraphLowering.__init__"] = wrap("torch._inductor.graph.GraphLowering.__init__", make_init)

        def make_info(original):
            @functools.wraps(original)
            def add_info(kernel_name, info, *args, **kwargs):
                us = info.get("compile_time_us") if isinstance(info, dict) else None
                probes.worker_infos.append((str(kernel_name), us / 1e6 if isinstance(us, (int, float)) else None))
                return original(kernel_name, info, *args, **kwargs)
            return add_info
        inst["_add_triton_kernel_info"] = wrap("torch._inductor.async_compile._add_triton_kernel_info", make_info)

        def make_source(kind, with_name):  # triton(kernel_name, source_code, ...), cpp_pybinding(argtypes, source_code)
            def make(original):
                @functools.wraps(original)
                def compile(self, first, source_code, *args, **kwargs):
                    probes.kernels.append((kind, str(first) if with_name else "", str(source_code)))
                    return original(self, first, source_code, *args, **kwargs)
                return compile
            return make
        inst["AsyncCompile.triton"] = wrap("torch._inductor.async_compile.AsyncCompile.triton",
                                           make_source("triton", True))
        inst["AsyncCompile.cpp_pybinding"] = wrap("torch._inductor.async_compile.AsyncCompile.cpp_pybinding",
                                                  make_source("cpp", False))
        self._install_triton()

    def _install_triton(self):
        triton = private("triton")
        if triton is None:
            self.installed["triton.compile"] = False
            return
        probes = self
        wrapped: dict[int, object] = {}

        def make(original):
            if id(original) in wrapped:
                return wrapped[id(original)]

            @functools.wraps(original)
            def compile(src, *args, **kwargs):
                slot = probes.local.slot = {}
                start = time.perf_counter()
                try:
                    return original(src, *args, **kwargs)
                finally:
                    probes.local.slot = None
                    name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", None)
                    probes.triton.append(dict(name=str(name or src)[:120], s=time.perf_counter() - start,
                                              cache_hit=slot.get("cache_hit"),
                                              thread=threading.current_thread().name))
            wrapped[id(original)] = compile
            return compile
        done = [wrap(path, make) for path in ("triton.compiler.compiler.compile", "triton.compiler.compile",
                                              "triton.compile")]
        self.installed["triton.compile"] = any(done)
        knobs = private("triton.knobs.compilation")
        if knobs is not None and hasattr(knobs, "listener"):
            previous = knobs.listener

            def listener(*args, **kwargs):
                slot = getattr(probes.local, "slot", None)
                if slot is not None:
                    slot["cache_hit"] = kwargs.get("cache_hit")
                if previous is not None:
                    previous(*args, **kwargs)
            knobs.listener = listener
        self.installed["triton.knobs.compilation.listener"] = knobs is not None and hasattr(knobs, "listener")

        def make_run(original):  # launches of @triton.jit kernels (the project's; Inductor's go through its own)
            @functools.wraps(original)
            def run(self, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return original(self, *args, **kwargs)
                finally:
                    name = getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "?")
                    probes.launches.append((str(name), time.perf_counter() - start))
            return run
        self.installed["JITFunction.run"] = wrap("triton.runtime.jit.JITFunction.run", make_run)

    def mark(self) -> dict:
        return dict(top={k: len(v) for k, v in self.top.items()}, nested={k: len(v) for k, v in self.nested.items()},
                    lowerings=len(self.lowerings), triton=len(self.triton), worker_infos=len(self.worker_infos),
                    launches=len(self.launches), kernels=len(self.kernels))

    def since(self, mark: dict) -> dict:
        def span(records, start):
            return {k: dict(n=len(v) - start.get(k, 0), s=sum(v[start.get(k, 0):]))
                    for k, v in records.items() if len(v) > start.get(k, 0)}
        lowerings = self.lowerings[mark["lowerings"]:]
        names: dict = defaultdict(int)
        for cls, name in lowerings:
            names[f"{cls}:{name}"] += 1
        return dict(
            wrapped_outer=span(self.top, mark["top"]), wrapped_nested=span(self.nested, mark["nested"]),
            inductor_graphs=dict(total=len(lowerings), subgraphs=sum(1 for c, _ in lowerings if c != "GraphLowering"),
                                 by_name=dict(names)),
            triton=triton_summary(self.triton[mark["triton"]:], self.worker_infos[mark["worker_infos"]:]),
            jit_launches=launch_summary(self.launches[mark["launches"]:]),
            kernel_sources=kernel_sources_summary(self.kernels[mark["kernels"]:]),
        )


def _counters() -> dict:
    counters = private("torch._dynamo.utils.counters", {})
    return {k: {str(kk)[:200]: vv for kk, vv in v.items()} for k, v in counters.items()}


def _counters_delta(before: dict, after: dict) -> dict:
    out = {}
    for cat, values in after.items():
        delta = {k: v - before.get(cat, {}).get(k, 0) for k, v in values.items()
                 if isinstance(v, (int, float)) and v != before.get(cat, {}).get(k, 0)}
        if delta:
            out[cat] = delta
    return out


def _time_metrics() -> dict:
    return {k: list(v) for k, v in private("torch._dynamo.utils.compilation_time_metrics", {}).items()}


def _compilation_metrics(start: int) -> dict:
    """torch's CompilationMetrics records made since `start`: their scalar fields, and the numeric ones summed."""
    import dataclasses

    get = private("torch._dynamo.utils.get_compilation_metrics")
    if get is None:
        return dict(records=None, sums=None, per_record=None)
    try:
        records = list(get())[start:]
    except Exception as e:
        return dict(records=None, error=f"{type(e).__name__}: {e}"[:200])
    keep_strings = ("compile_id", "co_name", "co_firstlineno", "fail_type", "fail_reason", "recompile_reason",
                    "cudagraph_skip_reason", "triton_kernel_compile_times_us")
    per_record, sums = [], defaultdict(float)
    for r in records:
        fields = [f.name for f in dataclasses.fields(r)] if dataclasses.is_dataclass(r) else list(vars(r))
        row = {}
        for name in fields:
            value = getattr(r, name, None)
            if isinstance(value, bool) or value is None:
                if name in keep_strings or isinstance(value, bool):
                    row[name] = value
            elif isinstance(value, (int, float)):
                row[name] = value
                if not name.endswith(("start_time", "start_time_us", "end_time_us", "co_firstlineno")):
                    sums[name] += value
            elif name in keep_strings:
                row[name] = str(value)[:600]
        per_record.append(row)
    return dict(records=len(records), sums=dict(sums), per_record=per_record)


def _apply_config(settings: dict) -> dict:
    """Inductor config knobs, set globally before the first call; an unknown key is an error."""
    import torch._inductor.config as config

    for key, value in settings.items():
        owner = config
        *path, last = key.split(".")
        for part in path:
            owner = getattr(owner, part)
        if not hasattr(owner, last):
            raise SystemExit(f"torch._inductor.config has no {key!r}")
        setattr(owner, last, value)
    return {key: repr(value) for key, value in settings.items()}


def _environment(device: str) -> dict:
    import platform

    import torch

    env = dict(torch=torch.__version__, python=platform.python_version(), cpu_count=os.cpu_count(),
               triton=getattr(private("triton"), "__version__", None),
               compile_threads=getattr(private("torch._inductor.config"), "compile_threads", None),
               worker_start_method=getattr(private("torch._inductor.config"), "worker_start_method", None))
    try:
        from _common import _commit
        env["commit"] = _commit()
    except Exception:
        env["commit"] = None
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _step_of_inputs(model, fb, k_pool, v_pool):
    """The (e) step with the model and pools as inputs: what aot_compile saves (a closure over a module or a
    tensor would be pickled into the file)."""
    return model(fb, k_pool, v_pool)


def _precompile(out: dict, spec: dict, model, fb, k_pool, v_pool, max_context_len: int) -> None:
    import compile_pass.cache

    start = time.perf_counter()
    try:
        aot = compile_pass.cache.aot_compile(_step_of_inputs, (model, fb, k_pool, v_pool),
                                             max_context_len=max_context_len, cudagraphs=True,
                                             **spec.get("options", {}))
        saved = aot.save_compiled_function(spec["save_precompiled"])
        out["precompiled_saved"] = dict(s=time.perf_counter() - start, bytes=os.path.getsize(spec["save_precompiled"]),
                                        triton=getattr(saved, "triton", None))
    except Exception as e:  # noqa: BLE001  (recorded: the precompiled run is then skipped)
        out["precompiled_saved"] = dict(error=f"{type(e).__name__}: {e}"[:400])


def child(spec: dict) -> dict:
    out: dict = dict(spec=spec)
    start = time.perf_counter()
    import torch

    import compile_pass
    import decode_loop
    from compile_pass._compat import CudagraphSkips

    probes = Probes()
    probes.install()  # imports Inductor here, before the first call, for every variant alike
    knob = parse_knob(spec["knob"])
    out["knob_config"] = _apply_config(knob["config"])
    out["probes_installed"] = probes.installed
    out["import_s"] = time.perf_counter() - start
    out["import_s_since_process_start"] = time.perf_counter() - _START
    if knob["prewarm_pool"]:  # what maybe_warm_pool() does, which some torch builds skip without an env flag
        pool = private("torch._inductor.async_compile.AsyncCompile")
        out["prewarm_pool"] = all(hasattr(pool, m) for m in ("warm_pool", "wakeup"))
        if out["prewarm_pool"]:
            pool.warm_pool()
            pool.wakeup()
    out["env"] = _environment(spec["device"])

    device = spec["device"]
    args = argparse.Namespace(layers=spec["layers"], steps=spec["steps"], regional=spec["regional"])
    start = time.perf_counter()
    config = decode_loop.model_config(args, spec["batch"], [spec["context"]])
    if spec["shape"] == "tiny":
        import dataclasses

        config = dataclasses.replace(config, **TINY)
    model = decode_loop.TinyLlama(config, device=device)
    k_pool, v_pool = decode_loop.new_pools(model, device, stacked=bool(knob.get("stacked_kv")))
    if device == "cuda":
        loop = decode_loop.Loop(config, spec["batch"])
        loop.set_context(spec["context"])
        fb = loop.fb
        sync = torch.cuda.synchronize
    else:
        fb = decode_loop.make_batch(config, [spec["context"]] * spec["batch"], device=device)
        sync = lambda: None  # noqa: E731
    options = {**spec.get("options", {}), **(knob.get("options") or {})}
    if options and spec["dl_variant"] == "e":  # decode_loop's (e) with backend options of the knob
        fn = compile_pass.compile(lambda fb: model(fb, k_pool, v_pool), max_context_len=config.max_context_len,
                                  cudagraphs=True, fullgraph=True, **options)
    else:
        page_buffer = decode_loop.new_page_buffer(config, spec["batch"], device) if spec["dl_variant"] == "f" else None
        fn = decode_loop.make_variant(spec["dl_variant"], model, k_pool, v_pool, config, page_buffer)
    sync()
    out["model_build_s"] = time.perf_counter() - start
    if spec.get("load_precompiled"):  # a precompiled start: the saved step, the normal compile as its fallback
        import compile_pass.cache

        fallbacks = []
        normal = fn
        start = time.perf_counter()
        loaded = compile_pass.cache.load_compiled(
            spec["load_precompiled"], fallback=lambda model, fb, k, v: fallbacks.append(1) or normal(fb))
        out["precompiled_load"] = dict(s=time.perf_counter() - start, loaded=loaded.compiled is not None,
                                       triton=getattr(getattr(loaded, "info", None), "triton", None),
                                       fallback_calls=fallbacks)
        fn = lambda fb: loaded(model, fb, k_pool, v_pool)  # noqa: E731
    if spec.get("load_artifacts"):  # a shipped-cache start: the artifacts first, as a server's start-up does
        import warnings

        import compile_pass.cache

        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", compile_pass.cache.ArtifactsMismatch)
            info = compile_pass.cache.load_artifacts(spec["load_artifacts"])
        out["cache_load"] = dict(s=time.perf_counter() - start, loaded=info.loaded, reason=info.reason,
                                 counts=info.counts, triton=getattr(info, "triton", None),
                                 warnings=[str(w.message)[:300] for w in caught])

    metrics_start = len(list((private("torch._dynamo.utils.get_compilation_metrics") or (lambda: []))()))
    times0, counters0, mark0 = _time_metrics(), _counters(), probes.mark()
    cudagraphs0 = decode_loop.cudagraph_counters()
    profiler = None
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
    with CudagraphSkips() as log:
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        fn(fb)
        sync()
        if profiler is not None:
            profiler.disable()
        out["first_call_s"] = time.perf_counter() - start
    if profiler is not None:
        os.makedirs(spec["profile"], exist_ok=True)
        out["profile"] = os.path.join(spec["profile"], safe_name(spec["name"]) + ".pstats")
        profiler.dump_stats(out["profile"])
    times1, counters1, mark1 = _time_metrics(), _counters(), probes.mark()
    out["cudagraphs"] = dict(partitions=log.partitions(), first_call_counters=decode_loop.counters_since(cudagraphs0))
    for which in ("second_call_s", "third_call_s"):  # CUDA-graph trees: warm-up at the first, recording at the second
        start = time.perf_counter()
        fn(fb)
        sync()
        out[which] = time.perf_counter() - start
    times2, counters2 = _time_metrics(), _counters()

    first = timed_delta(times0, times1)
    later = timed_delta(times1, times2)
    out["phases_first_call"] = phases_of(first)
    out["derived_first_call"] = derived_of(out["phases_first_call"], out["first_call_s"])
    out["phases_later_calls"] = {k: v for k, v in phases_of(later).items() if v is not None}
    out["raw_first_call"] = {k: dict(n=len(v), s=sum(v)) for k, v in first.items()}
    out["raw_later_calls"] = {k: dict(n=len(v), s=sum(v)) for k, v in later.items()}
    out["compilation_metrics"] = _compilation_metrics(metrics_start)
    counters = _counters_delta(counters0, counters1)
    out["counters_first_call"] = counters
    out["counters_later_calls"] = _counters_delta(counters1, counters2)
    out["probes_first_call"] = probes.since(mark0)
    out["probes_later_calls"] = probes.since(mark1)
    records = out["compilation_metrics"].get("per_record") or []
    out["counts"] = dict(
        frames_total=counters.get("frames", {}).get("total"),  # counters["frames"]: older torch only
        frames_ok=counters.get("frames", {}).get("ok"),
        frames_compiled=sum(1 for r in records if not r.get("is_runtime")) if records else None,
        dynamo_graphs=counters.get("stats", {}).get("unique_graphs"),
        calls_captured=counters.get("stats", {}).get("calls_captured"),
        graph_breaks=sum(counters.get("graph_break", {}).values()),
        graph_break_reasons=list(counters.get("graph_break", {}))[:10],
        recompiles=sum(1 for r in records if r.get("recompile_reason")) if records else None,
        compilation_metrics_records=len(records) if records else None,
        compile_fx_calls=out["probes_first_call"]["wrapped_outer"].get("compile_fx", {}).get("n", 0)
        if probes.installed.get("compile_fx") else None,
        inductor_graphs=out["probes_first_call"]["inductor_graphs"]["total"]
        if probes.installed.get("GraphLowering.__init__") else None,
        inductor_subgraphs=out["probes_first_call"]["inductor_graphs"]["subgraphs"]
        if probes.installed.get("GraphLowering.__init__") else None,
        fx_graph_cache={k.replace("fxgraph_cache_", ""): v for k, v in counters.get("inductor", {}).items()
                        if k.startswith("fxgraph_cache")},
        aot_autograd_cache={k: v for k, v in counters.get("aot_autograd", {}).items() if "cache" in k},
        async_compile={k: v for k, v in counters.get("inductor", {}).items() if k.startswith("async_compile")},
    )
    try:
        out["compile_times_table"] = private("torch._dynamo.utils.compile_times")(repr="str", aggregate=True)
    except Exception as e:
        out["compile_times_table"] = f"unavailable: {type(e).__name__}"
    if spec["dl_variant"] == "e":  # a precompiled step's compile (and report) happened in its cold run
        reports = compile_pass.reports(fn) if hasattr(fn, "_syncfree_reports") else compile_pass.reports()
        merged = compile_pass.SyncReport.merge(reports) if reports else None
        out["syncfree"] = None if merged is None else dict(
            graphs=len(reports), pass_s=merged.pass_seconds, backend_s=merged.backend_seconds,
            rewritten=len(merged.rewritten), kept=len(merged.kept), syncs_remaining=merged.syncs_remaining,
            notes=merged.notes[:5])
    if spec.get("save_artifacts"):  # for the shipped-cache run of this variant (after every record above is taken)
        import compile_pass.cache

        start = time.perf_counter()
        try:
            info = compile_pass.cache.save_artifacts(spec["save_artifacts"])
            out["artifacts_saved"] = dict(s=time.perf_counter() - start, counts=info.counts,
                                          triton=getattr(info, "triton", None),
                                          bytes=os.path.getsize(spec["save_artifacts"]))
        except Exception as e:  # noqa: BLE001  (recorded: the shipped run is then skipped)
            out["artifacts_saved"] = dict(error=f"{type(e).__name__}: {e}"[:300])
    if spec.get("save_precompiled") and spec["dl_variant"] == "e":
        _precompile(out, spec, model, fb, k_pool, v_pool, config.max_context_len)
    return out


# -- the parent: fresh processes, caches, the budget ------------------------------------------------------------
def spec_of(args, run: dict, save_artifacts: str | None = None, load_artifacts: str | None = None,
            save_precompiled: str | None = None, load_precompiled: str | None = None) -> dict:
    dl_variant, regional = VARIANTS[run["variant"]]
    return dict(name=run["name"], variant=run["variant"], knob=run["knob"], cache=run["cache"],
                dl_variant=dl_variant, regional=regional, layers=args.layers, batch=args.batch,
                context=args.context, steps=args.steps, device=args.device, shape=args.shape,
                save_artifacts=save_artifacts, load_artifacts=load_artifacts, save_precompiled=save_precompiled,
                load_precompiled=load_precompiled, options=VARIANT_OPTIONS.get(run["variant"], {}),
                profile=os.path.abspath(args.profile) if getattr(args, "profile", None) else None)


def safe_name(name: str) -> str:
    """A run's name as a file name: letters, digits, '-' and '.' kept, anything else '_'."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def count_files(root: str, suffix: str) -> int:
    return sum(1 for _ in Path(root).rglob(f"*{suffix}")) if os.path.isdir(root) else 0


def cache_env(cache_root: str, triton_root: str | None = None) -> dict:
    """A run's cache directories: Inductor's, TMPDIR and Triton's under cache_root, Triton's under triton_root
    where given (a kept-triton start reads its cold run's)."""
    return dict(TORCHINDUCTOR_CACHE_DIR=f"{cache_root}/inductor", TMPDIR=f"{cache_root}/tmp",
                TRITON_CACHE_DIR=f"{triton_root or cache_root}/triton")


def run_child(args, run: dict, cache_root: str, timeout: float, artifacts: dict | None = None,
              triton_root: str | None = None) -> dict:
    """One fresh process on the caches under cache_root (its TRITON_CACHE_DIR under triton_root where given: a
    kept-triton start on its cold run's Triton cache)."""
    env = dict(os.environ)
    env.update(cache_env(cache_root, triton_root), PYTHONUNBUFFERED="1")
    os.makedirs(env["TMPDIR"], exist_ok=True)
    env.update(parse_knob(run["knob"])["env"])
    if args.trace:
        env["TORCH_TRACE"] = os.path.join(os.path.abspath(args.trace), safe_name(run["name"]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec_of(args, run, **(artifacts or {})))]
    cubins_before = count_files(env["TRITON_CACHE_DIR"], ".cubin")
    start = time.perf_counter()
    # Its own process group: a timeout (or this process ending) takes its compile workers down with it.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as e:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        return dict(run=run, error=f"timed out after {timeout:.0f} s", process_wall_s=time.perf_counter() - start,
                    stderr_tail=(stderr or "")[-1500:])
    wall = time.perf_counter() - start
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return dict(run=run, error=f"exit {proc.returncode}", process_wall_s=wall,
                    stderr_tail=(stderr or stdout)[-3000:])
    result = json.loads(lines[-1][len("RESULT "):])
    cubins = count_files(env["TRITON_CACHE_DIR"], ".cubin")
    result.update(run=run, process_wall_s=wall, triton_cache_binaries=cubins,
                  triton_cache_binaries_added=cubins - cubins_before)
    return result


def triton_written(t: dict | None) -> str:
    """What a load did with the project's Triton binaries, in words ("-" where the file had none)."""
    if not t:
        return "-"
    return (f"{t.get('kernels', 0)} kernels: {t.get('written', 0)} written, {t.get('present', 0)} present, "
            f"{t.get('conflicts', 0)} conflicts, {t.get('failed', 0)} failed")


def load_seconds(r: dict) -> float | None:
    """Seconds a start spent loading before its first call: the shipped artifacts, or the precompiled step."""
    for key in ("cache_load", "precompiled_load"):
        if r.get(key):
            return r[key]["s"]
    return None


def project_jit_seconds(r: dict, key: str = "project_kernels_jit_s") -> float | None:
    """Seconds of the first call in Triton compiles (or cache loads) of the project's own kernels, in any thread;
    key "project_kernels_jit_in_call_s": those in the calling thread (not compile_pass.kernel_warmup's)."""
    return ((r.get("probes_first_call") or {}).get("triton") or {}).get(key)


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _parts(*items) -> str:
    """"label value" pairs joined by commas; an item is (label, seconds) or (label, seconds, format)."""
    return ", ".join(f"{item[0]} {_f(item[1], *item[2:])}" for item in items)


def summary_lines(r: dict) -> list[str]:
    """The breakdown of one run, as printed (seconds; "-" where torch made no record of it)."""
    name = r["run"]["name"]
    if "error" in r:
        return [f"{name}: ERROR {r['error']}", *(r.get("stderr_tail") or "").strip().splitlines()[-6:]]
    p, d, c = r["phases_first_call"], r["derived_first_call"], r["counts"]
    t = r["probes_first_call"]["triton"]
    fine = "{:.2f}"
    lines = [f"{name}: first call {r['first_call_s']:.1f} s; "
             + _parts(("second", r["second_call_s"], fine), ("third", r["third_call_s"], fine),
                      ("model build", r["model_build_s"]), ("imports", r["import_s"]),
                      ("process", r["process_wall_s"]))]
    lines.append("- dynamo " + _f(p["dynamo_compile"]) + ": " + _parts(
        ("own", d["dynamo_own"]), ("bytecode tracing", p["dynamo_bytecode_tracing"]),
        ("guards", p["dynamo_build_guards"], fine), ("backend call", p["backend_call"]))
        + "; outside any compile " + _f(d[OUTSIDE[0]]))
    lines.append("- backend: " + _parts(
        ("outside aot", d["backend_outside_aot"]), ("aot", p["aot_autograd"]),
        ("inductor fw compiler", p["inductor_fw_compiler"]), ("compile_fx_inner", p["inductor_compile_fx_inner"]),
        ("pre-grad", p["inductor_pre_grad_passes"], fine), ("joint", p["inductor_joint_graph_passes"], fine),
        ("post-grad", p["inductor_post_grad_passes"], fine), ("lowering", p["inductor_lowering"]),
        ("code_gen", p["inductor_code_gen"])))
    lines.append("- code_gen: " + _parts(
        ("scheduler", p["inductor_scheduler_init"]), ("kernel codegen", p["inductor_scheduler_codegen"]),
        ("wrapper", p["inductor_wrapper_codegen"], fine), ("async compile wait", p["triton_async_wait"]),
        ("in-process triton", p["triton_in_process_precompile"]), ("module load", p["inductor_load_module"]),
        ("c++ compiles summed over threads", p["cpp_compile"])))
    here = ", ".join(f"{kind} {v['n']} ({v['s']:.1f} s, {v['misses']} built)"
                     for kind, v in t["compiles_in_this_process"].items()) or "none"
    lines.append(f"- triton: {t['inductor_kernels']} Inductor kernels, " + _parts(
        ("compile summed over workers", t["inductor_kernel_compile_s_sum"]),
        ("slowest", t["inductor_kernel_compile_s_max"], fine)) + f"; compiles in this process: {here}; "
        + _parts(("project kernels JIT", t["project_kernels_jit_s"], fine),
                 ("of which in the call", t.get("project_kernels_jit_in_call_s"), fine),
                 ("runtime autotune", p["triton_runtime_autotune"], fine))
        + f"; binaries added to the cache {r.get('triton_cache_binaries_added')}")
    jit = r["probes_first_call"].get("jit_launches") or {}
    if jit:
        lines.append("- first launches of @triton.jit kernels: "
                     + _parts(*((f"{n} x{v['n']}", v["first_s"], fine) for n, v in jit.items())))
    later = r.get("phases_later_calls") or {}
    plain = [r[k]["wrapped_outer"].get("cudagraphify_impl", {}).get("s")
             for k in ("probes_first_call", "probes_later_calls")]
    lines.append("- cudagraphs: " + _parts(("trees record (later calls)", later.get("cudagraph_record"), fine),
                                           ("plain cudagraphify first call", plain[0], fine),
                                           ("later", plain[1], fine))
                 + f"; partitions {r['cudagraphs']['partitions']}")
    lines.append(f"- counts: frames compiled {c['frames_compiled']}, dynamo graphs {c['dynamo_graphs']}, graph breaks "
                 f"{c['graph_breaks']}, recompiles {c['recompiles']}, compile_fx {c['compile_fx_calls']}, inductor "
                 f"graphs {c['inductor_graphs']} (subgraphs {c['inductor_subgraphs']}), fx cache {c['fx_graph_cache']}, "
                 f"aot autograd cache {c['aot_autograd_cache']}")
    sources = r["probes_first_call"].get("kernel_sources") or {}
    lines.append("- kernels the graphs asked AsyncCompile for (built, or loaded from the caches): " + (", ".join(f"{k} {v['n']} ({v['distinct']} distinct)"
                                                         for k, v in sources.items()) or "none"))
    if r.get("cache_load"):
        cl = r["cache_load"]
        lines.append(f"- shipped artifacts: loaded {cl['loaded']} in {cl['s']:.2f} s {cl['counts']}"
                     + (f" ({cl['reason']})" if cl["reason"] else "")
                     + (f"; project Triton binaries {triton_written(cl.get('triton'))}" if cl.get("triton") else ""))
    for key in ("artifacts_saved", "precompiled_saved", "precompiled_load"):
        if r.get(key):
            lines.append(f"- {key.replace('_', ' ')}: {r[key]}")
    if r.get("syncfree"):
        s = r["syncfree"]
        lines.append(f"- syncfree: pass {s['pass_s']:.2f} s, backend {s['backend_s']:.1f} s, graphs {s['graphs']}, "
                     f"rewritten {s['rewritten']}, kept {s['kept']}")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--knobs", nargs="*", default=[],
                        help=f"cold runs of --knob-variant with one knob each: {', '.join(KNOBS)}, cfg:KEY=VALUE, "
                             "env:NAME=VALUE")
    parser.add_argument("--knob-variant", nargs="+", default=["syncfree-regional"], choices=list(VARIANTS),
                        help="the variants the knobs' cold runs are of (each knob for each)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="cold runs of each variant and knob, each a fresh process on new empty caches, in "
                             "rounds of every variant and knob (the medians are printed at the end); only the first "
                             "round's runs save artifacts and get warm, shipped and precompiled reruns")
    parser.add_argument("--no-warm", dest="warm", action="store_false", help="no warm-cache reruns")
    parser.add_argument("--no-shipped", dest="shipped", action="store_false",
                        help="no shipped-cache or precompiled starts (cold runs then save no artifacts)")
    parser.add_argument("--no-precompiled", dest="precompiled", action="store_false",
                        help="no precompiled starts (the cold syncfree runs then do not AOT-compile the step again)")
    parser.add_argument("--no-kept-triton", dest="kept_triton", action="store_false",
                        help="no precompiled starts on the cold run's Triton cache (precompiled-kept-triton)")
    parser.add_argument("--smoke", action="store_true",
                        help="the CPU smoke run: " + ", ".join(f"--{k} {v if isinstance(v, str) else ' '.join(v)}"
                                                              for k, v in SMOKE.items()) + ", --shape tiny")
    parser.add_argument("--layers", type=int, default=None, help="default: 32 (the 8B shape), 2 with --shape tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=None, help="default 4096 (64 with --shape tiny)")
    parser.add_argument("--steps", type=int, default=128, help="sizes max_context_len as decode_loop.py does")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=("8b", "tiny"), default=None, help="default: 8b on cuda, tiny on cpu")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per fresh process")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all runs: a run is not started when less is left than it is expected "
                             "to take")
    parser.add_argument("--profile", help="cProfile every first call: one <run name>.pstats per run in this "
                                          "directory (the profiler slows Python down: its timings are not the "
                                          "tables')")
    parser.add_argument("--trace", help="TORCH_TRACE directory root (one subdirectory per run, for tlparse)")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    if args.smoke:
        args.variants, args.knobs, args.device = SMOKE["variants"], SMOKE["knobs"], SMOKE["device"]
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    for knob in args.knobs:
        parse_knob(knob)  # fail now, naming it
    args.shape = args.shape or ("8b" if args.device == "cuda" else "tiny")
    args.layers = args.layers or (32 if args.shape == "8b" else 2)
    args.context = args.context or (4096 if args.shape == "8b" else 64)
    return args


def write(path, data):
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        print("RESULT " + json.dumps(child(json.loads(args.child)), default=str), flush=True)
        return
    # A stage's time limit sends SIGTERM: end as an exception does, so that the running child is killed and the
    # cache directories are removed; the JSON already holds every finished run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs = [r for r in plan_runs(args.variants, args.knobs, args.knob_variant, args.warm, args.shipped,
                                 kept_triton=args.kept_triton, repeat=args.repeat)
            if args.precompiled or not r["cache"].startswith("precompiled")]
    data = dict(args={k: v for k, v in vars(args).items() if k != "child"}, command=" ".join(sys.argv),
                legend=dict(phases=PHASES, derived={k: v[0] for k, v in DERIVED.items()}, outside_compile=OUTSIDE[1]),
                runs=[], skipped=[])
    roots: dict[str, str] = {}
    failed: set[str] = set()  # caches whose cold run failed: no warm rerun on them
    # (variant, cache) -> process wall of its first default run: what its later runs are expected to take
    walls: dict[tuple[str, str], float] = {}
    start = time.perf_counter()
    try:
        for run in runs:
            expected = expected_wall(walls, run)
            left = None if args.budget is None else args.budget - (time.perf_counter() - start)
            why = None
            if run["cache"] == "warm" and run["caches"] in failed:
                why = "its cold run failed"
            elif run["cache"] in SAVED and not os.path.exists(
                    os.path.join(roots.get(run["artifacts"], "-"), SAVED[run["cache"]][0])):
                why = "its cold run saved no " + ("artifacts" if run["cache"] == "shipped" else "precompiled step")
            elif left is not None and left < max(expected * 1.1, 10.0):
                why = f"{max(left, 0):.0f} s of the budget left, the run is expected to take {expected:.0f} s"
            if why:
                data["skipped"].append(dict(run=run["name"], why=why))
                print(f"{run['name']}: skipped ({why})", flush=True)
                continue
            root = roots.setdefault(run["caches"], tempfile.mkdtemp(prefix="compile-time-"))
            timeout = args.timeout if left is None else min(args.timeout, left)
            print(f"{run['name']} in a fresh process ...", flush=True)
            artifacts = None
            if run["cache"] == "cold" and run["knob"] == "default" and args.shipped and "round" not in run:
                artifacts = dict(save_artifacts=os.path.join(root, ARTIFACTS))
                if args.precompiled:
                    artifacts["save_precompiled"] = os.path.join(root, PRECOMPILED)
            elif run["cache"] in SAVED:
                file, key = SAVED[run["cache"]]
                artifacts = {key: os.path.join(roots[run["artifacts"]], file)}
            result = run_child(args, run, root, timeout, artifacts,
                               triton_root=roots[run["triton_from"]] if run.get("triton_from") else None)
            if "error" in result:
                failed.add(run["caches"])
            elif run["knob"] == "default":
                walls.setdefault((run["variant"], run["cache"]), result["process_wall_s"])
            data["runs"].append(result)
            data["env"] = data.get("env") or result.get("env")
            for line in summary_lines(result):
                print(line, flush=True)
            write(args.json, data)
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    data["table"] = [dict(run=r["run"]["name"], first_call_s=r.get("first_call_s"),
                          backend_s=(r.get("phases_first_call") or {}).get("backend_call"),
                          cache_load_s=load_seconds(r), project_kernels_jit_s=project_jit_seconds(r),
                          project_kernels_jit_in_call_s=project_jit_seconds(r, "project_kernels_jit_in_call_s"),
                          error=r.get("error")) for r in data["runs"]]
    print("\nrun | first call s | dynamo own s | backend s | inductor s | async compile wait s | outside compile s"
          " | project kernels JIT s (in the call) | cache load s | fx cache")
    for r in data["runs"]:
        if "error" in r:
            print(f"{r['run']['name']} | error: {r['error']}")
            continue
        p, d = r["phases_first_call"], r["derived_first_call"]
        print(" | ".join([r["run"]["name"], _f(r["first_call_s"]), _f(d["dynamo_own"]), _f(p["backend_call"]),
                          _f(p["inductor_compile_fx_inner"]), _f(p["triton_async_wait"]), _f(d[OUTSIDE[0]]),
                          _f(project_jit_seconds(r), "{:.2f}")
                          + f" ({_f(project_jit_seconds(r, 'project_kernels_jit_in_call_s'), '{:.2f}')})",
                          _f(load_seconds(r), "{:.2f}"),
                          str(r["counts"]["fx_graph_cache"])]))
    data["cold_medians"] = cold_medians(data["runs"])
    if args.repeat > 1:
        print("\nvariant (knob) | cold runs | median first call s | range s | failed")
        for variant, m in data["cold_medians"].items():
            print(f"{variant} | {m['runs']} | {_f(m['median_s'], '{:.2f}')} | {_f(m['min_s'])}-{_f(m['max_s'])} | "
                  f"{m['failed']}")
    write(args.json, data)


if __name__ == "__main__":
    main()

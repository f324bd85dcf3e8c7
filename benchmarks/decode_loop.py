"""Benchmark: a generation loop at a real model's shape (Llama-3-8B: 32 layers, hidden 4096, Hq 32, Hkv 8, D 128,
SwiGLU 14336, vocab 128256, bf16 random weights, ~16 GB), against the bandwidth bound.

    python benchmarks/decode_loop.py [--batches 1 8 64] [--contexts 4096 32768] [--steps 128]
                                     [--variants a b e f] [--regional] [--outline-repeats] [--stacked-kv]
                                     [--cold-compile [--warm-compile]] [--profile] [--json out.json]

Every request starts from a prompt context of the given length (its KV already in the pool, random) and
generates --steps tokens greedily; lengths grow by one every step, and between steps the loop updates the
batch on the device as an engine's scheduler does (next input ids from the logits' argmax, seq_lens and
positions + 1, the new KV slots from req_to_token). Variants:
  (a) eager, the metadata step with seq_lens.max().item()      (b) stock torch.compile of the same step
  (e) backend="syncfree" with CUDA graphs                      (f) hand-written: a static page table filled on
      the device, stock torch.compile, one CUDA graph captured by hand and replayed.
Per (B, context): median step time (CUDA events between consecutive steps, the batch update included), tokens/s
(B x steps over the loop's wall time), and the bandwidth bound: the bytes a step must read (every weight but the
embedding table, plus the live K and V of every layer, averaged over the loop) over the device copy bandwidth
measured in the same run; each variant's share of it. With --cold-compile, the first call of (e) and of (b)
(B=1, first context) each run in a fresh process with empty Inductor and Triton caches: their time is the cold
compile, and for (e) the report says how much of it the pass itself took (SyncReport.pass_seconds).
With --warm-compile, each cold process is followed by a second fresh process on the same cache directories: its
first call is the warm-cache start (Dynamo traces again; AOT, Inductor and Triton artifacts come from the caches).
With --regional the model is built with TinyLlamaConfig(regional=True): each layer runs as two
torch.compiler.nested_compile_region calls (the KV write between them), so Dynamo traces one layer body and
stamps it out; every variant runs that same model ((a) in eager, where the regions are plain calls, (b) stock
torch.compile, (e) the backend, (f) stock with the static table), and the cold processes get the flag too.
With --outline-repeats, (e) gets the backend option outline_repeats=True (the whole model's repeated stretches
compiled once, compile_pass.outline_repeats). The KV pool is a tensor per layer, as SGLang keeps it (--stacked-kv:
one stacked pool, the views k_pool[i] per layer).
Per compiled variant the JSON records Inductor's "Created N graph partitions" lines (TORCH_LOGS=cudagraphs; logged
when Inductor compiles, not on an FX-graph-cache hit) and the cudagraph-skip counters of its first call.
A (B, context) whose KV pool does not fit the GPU next to the weights is skipped, with the bytes it needed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import compile_pass
from _common import apply_tuning, copy_bandwidth_tbs, environment, require_cuda, write_json
from compile_pass._compat import CudagraphSkips
from compile_pass.examples import TinyLlama, TinyLlamaConfig, make_batch

LLAMA3_8B = dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336)
PAGE_SIZE = 16


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def model_config(args, batch: int, contexts: list[int]) -> TinyLlamaConfig:
    shape = dict(LLAMA3_8B, layers=args.layers)
    max_len = round_up(max(contexts) + args.steps, PAGE_SIZE)
    return TinyLlamaConfig(**shape, page_size=PAGE_SIZE, max_context_len=max_len,
                           num_pages=batch * max_len // PAGE_SIZE, max_requests=batch, attention="paged_decode",
                           metadata="item", dtype=torch.bfloat16, regional=args.regional)


def new_pools(model: TinyLlama, device="cuda", stacked: bool = False):
    """The step's KV pools: a tensor per layer (as SGLang keeps a buffer per layer; the views k_pool[i] of one
    stacked pool differ in storage offset, so a compiled region's body, the user's or the backend's outline_repeats,
    is traced and lowered once per layer: see TinyLlama.new_kv_pool), unless `stacked`. The whole-model rows used
    the stacked pool before 2026-12-02's eighth session; the regional rows from fdf9cec on."""
    return model.new_kv_pool(device, per_layer=not stacked)


def new_page_buffer(config: TinyLlamaConfig, batch: int, device="cuda") -> torch.Tensor:
    """The hand-written engine's (f) static-width page table: max_context_len / page_size pages per request."""
    return torch.zeros(batch, config.max_context_len // config.page_size, dtype=torch.int32, device=device)


def pool_tensors(pool) -> list[torch.Tensor]:
    """A pool's tensors: the stacked tensor, or the per-layer list."""
    return [pool] if isinstance(pool, torch.Tensor) else list(pool)


def kv_pool_bytes(config: TinyLlamaConfig) -> int:
    return 2 * config.layers * config.num_pages * config.page_size * config.kv_heads * config.head_dim * 2


def weight_bytes_per_step(model: TinyLlama) -> int:
    """Bytes of weights a decode step reads: all but the embedding table (one row per token is read)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name != "embed")


def kv_bytes_per_step(config: TinyLlamaConfig, batch: int, ctx: int, steps: int) -> float:
    """K and V bytes of the live keys of every layer, averaged over the loop: step i reads ctx + i keys per row
    (the first step's ctx include its own new token)."""
    mean_len = ctx + (steps - 1) / 2
    return 2 * config.layers * batch * mean_len * config.kv_heads * config.head_dim * 2


class Loop:
    """The batch of one B and the engine-side update between steps, all on the device. One set of tensors
    serves every context (set_context copies new lengths into them), so that compiled variants see the same
    persistent buffers, as an engine's are."""

    def __init__(self, config, batch):
        self.config, self.batch = config, batch
        self.fb = make_batch(config, [1] * batch, device="cuda")

    def set_context(self, ctx):
        fresh = make_batch(self.config, [ctx] * self.batch)  # same seed: the same req_to_token
        self.start = {name: getattr(fresh, name).cuda() for name in
                      ("input_ids", "positions", "out_cache_loc", "seq_lens")}
        self.start_cpu = fresh.seq_lens_cpu.clone()
        self.reset()

    def reset(self):
        for name, value in self.start.items():
            getattr(self.fb, name).copy_(value)
        self.fb.seq_lens_cpu.copy_(self.start_cpu)

    def advance(self, logits):
        fb = self.fb
        fb.input_ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
        fb.seq_lens.add_(1)
        fb.positions.add_(1)
        fb.out_cache_loc.copy_(fb.req_to_token[fb.req_pool_indices[:, None], fb.positions].to(torch.int64))
        fb.seq_lens_cpu.add_(1)  # the host mirror an engine keeps (costs no device sync)


def run_loop(loop: Loop, step, steps: int, warmup: int = 3) -> dict:
    """Warm up, reset the batch, then generate `steps` tokens: per-step times and the loop's wall time."""
    loop.reset()
    for _ in range(warmup):
        loop.advance(step())
    loop.reset()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    start = time.perf_counter()
    events[0].record()
    for i in range(steps):
        loop.advance(step())
        events[i + 1].record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    per_step = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(steps)]
    return dict(step_us=statistics.median(per_step), wall_s=wall)


def cold_compile(args) -> dict:
    """The first call of one variant in this (fresh) process: its compile time, and the pass's share."""
    config = model_config(args, 1, args.contexts)
    model = TinyLlama(config, device="cuda")
    k_pool, v_pool = new_pools(model, stacked=args.stacked_kv)
    loop = Loop(config, 1)
    loop.set_context(args.contexts[0])
    fn = make_variant(args.cold_compile, model, k_pool, v_pool, config, outline_repeats=args.outline_repeats)
    before = cudagraph_counters()
    with CudagraphSkips() as log:
        start = time.perf_counter()
        fn(loop.fb)
        torch.cuda.synchronize()
        first_call = time.perf_counter() - start
    start = time.perf_counter()
    fn(loop.fb)
    torch.cuda.synchronize()
    result = dict(variant=args.cold_compile, regional=args.regional, first_call_s=first_call,
                  second_call_s=time.perf_counter() - start, partitions=log.partitions(),
                  cudagraph_counters=counters_since(before))
    if args.cold_compile == "e":
        report = compile_pass.reports(fn)
        merged = compile_pass.SyncReport.merge(report) if report else None
        if merged is not None:
            result.update(pass_s=merged.pass_seconds, backend_s=merged.backend_seconds,
                          rewritten=len(merged.rewritten), kept=len(merged.kept))
    return result


# Matched in order. Inductor's fused kernels come first: their names carry the ops they fused
# (triton_poi_fused_..._paged_decode_...), which are not the ops' own kernels.
KERNEL_KINDS = (("Inductor Triton (norms, RoPE, SwiGLU, residuals)", ("triton_",)),
                ("matmul (cuBLAS)", ("gemv", "gemm", "cutlass", "nvjet", "xmma", "cublas")),
                ("paged_decode", ("paged_decode",)), ("page_table", ("page_table",)),
                ("store_kv (index_copy)", ("index_copy",)),
                ("torch ops (argmax, batch update)", ("argmax", "reduce", "index", "elementwise", "copy", "add")))


def kernel_time_by_kind(step, steps: int = 5) -> dict:
    """Device time per step by kind of kernel (torch.profiler, kernels inside CUDA-graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name for m in marks)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us / steps
        kernels[name[:90]] = kernels.get(name[:90], 0.0) + us / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return dict(us_per_step_by_kind=kinds, top_kernels_us_per_step=dict(top),
                kernel_launches_per_step=sum(1 for e in prof.events()
                                             if e.device_type == torch.autograd.DeviceType.CUDA) / steps)


def cudagraph_counters() -> dict:
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}


def counters_since(before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in cudagraph_counters().items() if v - before.get(k, 0)}


def make_variant(name, model, k_pool, v_pool, config, page_buffer=None, outline_repeats: bool = False):
    """One variant's step; `outline_repeats` is the backend option of (e) (the repeated layers compiled once)."""
    def step(fb):
        return model(fb, k_pool, v_pool)

    if name == "a":
        return step
    if name == "b":
        return torch.compile(lambda fb: step(fb))
    if name == "e":
        return compile_pass.compile(lambda fb: step(fb), max_context_len=config.max_context_len, cudagraphs=True,
                                    fullgraph=True, outline_repeats=outline_repeats)
    if name == "f":
        return torch.compile(lambda fb: model(fb, k_pool, v_pool, page_buffer=page_buffer), fullgraph=True)
    raise ValueError(f"unknown variant {name!r}")


def measure_cold_compiles(args) -> dict:
    """(e) and (b) cold, each in its own process with empty caches (run before this process takes the GPU); with
    --warm-compile, then once more in a second fresh process on the same (now filled) caches."""
    out = {}
    for variant in ("e", "b"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}
            cmd = cold_command(args, variant)
            out[variant] = run_first_call(cmd, env, args.cold_timeout, f"cold compile of ({variant})")
            if args.warm_compile and "error" not in out[variant]:
                out[variant]["warm"] = run_first_call(cmd, env, args.cold_timeout,
                                                      f"warm-cache start of ({variant})")
    return out


def cold_command(args, variant: str) -> list[str]:
    """The command line of one variant's first call in a fresh process (this run's shape and flags)."""
    cmd = [sys.executable, __file__, "--cold-compile-variant", variant, "--layers", str(args.layers),
           "--steps", str(args.steps), "--contexts", str(args.contexts[0])]
    if args.regional:
        cmd.append("--regional")
    if args.stacked_kv:
        cmd.append("--stacked-kv")
    if args.outline_repeats:
        cmd.append("--outline-repeats")
    if args.tuning:
        cmd += ["--tuning", args.tuning]
    return cmd


def run_first_call(cmd, env, timeout, what) -> dict:
    """One fresh process running one variant's first call (its COLD line), or the error it ended with."""
    print(f"{what} in a fresh process ...", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        result = dict(error=f"timed out after {timeout} s")
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("COLD ")]
        if proc.returncode != 0 or not lines:
            result = dict(error=(proc.stderr or proc.stdout)[-1500:])
        else:
            result = json.loads(lines[-1][5:])
    print(f"  {what}: {result}", flush=True)
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--plan", nargs="+", metavar="B:CTX,CTX",
                        help="contexts per batch size, e.g. 1:4096,32768 64:2048,4096 (instead of --batches x "
                             "--contexts)")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--layers", type=int, default=LLAMA3_8B["layers"])
    parser.add_argument("--variants", nargs="+", default=list("abef"), choices=list("abef"))
    parser.add_argument("--cold-compile", action="store_true", help="measure (e)'s and (b)'s cold compile first")
    parser.add_argument("--warm-compile", action="store_true",
                        help="with --cold-compile: also each variant's first call in a second fresh process on the "
                             "same caches (the warm-cache start)")
    parser.add_argument("--regional", action="store_true",
                        help="build the model with TinyLlamaConfig(regional=True): two nested_compile_region calls "
                             "per layer, one traced layer body stamped out; the KV pool a tensor per layer")
    parser.add_argument("--stacked-kv", action="store_true",
                        help="one stacked KV pool (views k_pool[i]) instead of a tensor per layer; a region body "
                             "is then lowered per layer (the loop's layout before 2026-12-02)")
    parser.add_argument("--outline-repeats", action="store_true",
                        help="(e) with the backend option outline_repeats=True: the whole model's repeated layers "
                             "compiled once, as one compiled region called per layer")
    parser.add_argument("--cold-timeout", type=int, default=300)
    parser.add_argument("--profile", action="store_true",
                        help="where (e)'s and (f)'s step time goes, by kind of kernel, at each batch's first context")
    parser.add_argument("--cold-compile-variant", dest="cold_compile", help=argparse.SUPPRESS)
    parser.add_argument("--json")
    parser.add_argument("--tuning", help="paged_decode launch values (JSON) to use instead of the committed TUNING")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    apply_tuning(args.tuning)
    plan = parse_plan(args.plan) if args.plan else {b: list(args.contexts) for b in args.batches}
    require_cuda()
    if args.cold_compile in ("e", "b"):
        print("COLD " + json.dumps(cold_compile(args)), flush=True)
        return
    if args.warm_compile and not args.cold_compile:
        raise SystemExit("--warm-compile goes with --cold-compile")
    result = dict(env=environment(), steps=args.steps, layers=args.layers, regional=args.regional, rows=[])
    if args.cold_compile:
        result["cold_compile"] = measure_cold_compiles(args)
        write_json(args.json, result)
    copy = result["copy_tbs"] = copy_bandwidth_tbs()
    config0 = model_config(args, 1, args.contexts)
    start = time.perf_counter()
    model = TinyLlama(config0, device="cuda")
    result["model_init_s"] = time.perf_counter() - start
    weights = result["weight_bytes_per_step"] = weight_bytes_per_step(model)
    print(f"device copy {copy:.2f} TB/s; weights read per step {weights / 1e9:.2f} GB; "
          f"model built in {result['model_init_s']:.1f} s", flush=True)
    print(f"{'B':>3} {'ctx':>6} {'bound':>8} | " + " | ".join(f"{'(' + v + ') us  tok/s  %bound':>24}"
                                                             for v in args.variants), flush=True)
    for batch, wanted in plan.items():
        free = torch.cuda.mem_get_info()[0]
        contexts = []
        for ctx in wanted:
            need = kv_pool_bytes(model_config(args, batch, [ctx]))
            if need > free - (6 << 30):
                row = dict(B=batch, ctx=ctx, skipped=f"the KV pool needs {need / 2**30:.0f} GiB; "
                                                    f"{free / 2**30:.0f} GiB free next to the weights")
                result["rows"].append(row)
                print(f"{batch:>3} {ctx:>6} skipped: {row['skipped']}", flush=True)
            else:
                contexts.append(ctx)
        if not contexts:
            continue
        config = model_config(args, batch, contexts)
        model.config = config  # the pool and the static width follow this batch's contexts
        k_pool, v_pool = new_pools(model, stacked=args.stacked_kv)
        for pool in pool_tensors(k_pool) + pool_tensors(v_pool):
            pool.normal_()
            compile_pass._compat.mark_static_address(pool)
        page_buffer = new_page_buffer(config, batch)
        torch._dynamo.reset()
        variants = {v: make_variant(v, model, k_pool, v_pool, config, page_buffer, args.outline_repeats)
                    for v in args.variants}
        loop = Loop(config, batch)
        compile_pass._compat.mark_static_address(loop.fb.req_to_token)
        hand_graph = None
        for ctx in contexts:
            loop.set_context(ctx)
            bound_bytes = weights + kv_bytes_per_step(config, batch, ctx, args.steps)
            bound_us = bound_bytes / (copy * 1e12) * 1e6
            row = dict(B=batch, ctx=ctx, bound_bytes=bound_bytes, bound_us=bound_us,
                       bound_tokens_per_s=batch / (bound_us * 1e-6))
            loop.reset()
            reference = variants["a"](loop.fb).float() if "a" in variants else None
            for name, fn in variants.items():
                skips, before = CudagraphSkips(), cudagraph_counters()
                try:
                    start = time.perf_counter()
                    if name != "f":
                        step = (lambda f=fn: f(loop.fb))
                        if name == "e":
                            step = with_step_marker(step)
                    loop.reset()
                    with skips:
                        if name == "f":
                            hand_graph = hand_graph or capture_by_hand(fn, loop)  # the buffers stay: one capture
                            step = hand_graph
                        first = step()
                    if reference is not None:
                        row[f"{name}_max_abs_err"] = (first.float() - reference).abs().max().item()
                    row[f"{name}_first_call_s"] = time.perf_counter() - start
                    if name != "a":
                        if skips.partitions():
                            row[f"{name}_partitions"] = skips.partitions()
                        row[f"{name}_cudagraph_counters"] = counters_since(before)
                    timing = run_loop(loop, step, args.steps)
                    row[f"{name}_us"] = timing["step_us"]
                    row[f"{name}_tokens_per_s"] = batch * args.steps / timing["wall_s"]
                    row[f"{name}_share_of_bound"] = bound_us / timing["step_us"]
                    if args.profile and name in ("e", "f") and ctx == contexts[0]:
                        loop.reset()
                        row[f"{name}_profile"] = kernel_time_by_kind(lambda: loop.advance(step()))
                except Exception as e:  # recorded, and the other variants still run
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            result["rows"].append(row)
            cells = []
            for name in args.variants:
                if f"{name}_us" in row:
                    cells.append(f"{row[name + '_us']:8.0f} {row[name + '_tokens_per_s']:7.0f} "
                                 f"{100 * row[name + '_share_of_bound']:6.1f}%")
                else:
                    cells.append(f"{'error':>24}")
            print(f"{batch:>3} {ctx:>6} {bound_us:8.0f} | " + " | ".join(cells), flush=True)
            write_json(args.json, result)
        del variants, k_pool, v_pool, page_buffer, loop, hand_graph
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    write_json(args.json, result)


def parse_plan(items) -> dict[int, list[int]]:
    plan = {}
    for item in items:
        try:
            batch, contexts = item.split(":")
            plan[int(batch)] = [int(c) for c in contexts.split(",")]
        except ValueError:
            raise SystemExit(f"--plan takes B:CTX,CTX items, got {item!r}") from None
    return plan


def with_step_marker(step):
    """Tell Inductor's CUDA-graph trees that a new generation step begins (the last step's output is dead)."""
    def marked():
        torch.compiler.cudagraph_mark_step_begin()
        return step()
    return marked


def capture_by_hand(compiled, loop: Loop):
    """(f): compile the static-table step, warm it up on a side stream, capture one CUDA graph of it; the loop
    updates the batch tensors in place and replays the graph."""
    compiled(loop.fb)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            compiled(loop.fb)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(loop.fb)

    def replay():
        graph.replay()
        return out
    replay.graph = graph
    return replay


if __name__ == "__main__":
    main()

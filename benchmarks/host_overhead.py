"""Benchmark: host time of one call of the compiled decode step (issue 43), ours against stock's and the floor.

    python benchmarks/host_overhead.py [--device cuda|cpu] [--layers 1 4 32] [--batches 1 8] [--rounds R]
                                       [--calls N] [--context N] [--profile N] [--profile-stock] [--threads N]
                                       [--out result.json]

The built-in TinyLlama (examples/tiny_llama.py; on CUDA at hidden 512, 8 heads of 64, page 16, max_context_len
4096, bf16, every request at --context tokens), one decode step per call, the inputs unchanged between calls.
Variants, per (layers, batch), each compiled fresh (torch._dynamo.reset() between configurations):

  on CUDA   ours     compile_pass.compile(step, max_context_len=..., cudagraphs=True, fullgraph=True) of the step
                     that sizes its page table with seq_lens.max().item() (the pass rewrites it)
            stock    torch.compile(mode="reduce-overhead", fullgraph=True) of the hand-written sync-free step (a
                     static page table filled on the device: decode_loop.py's variant f)
            replay   one torch.cuda.CUDAGraph of the hand-written step (stock torch.compile, default mode),
                     captured by hand: replay() per call, the floor
  on CPU    ours     the same compile_pass.compile, cudagraphs off (Inductor on CPU)
  (--device stock    torch.compile(fullgraph=True) of the hand-written step
   cpu)     eager    the hand-written step in eager
  both      ours_dynamo  the torch.compile'd function inside `ours` called directly (run._syncfree_compiled): Dynamo,
                     the per-call input guard and the graph without compile_pass.compile's call wrapper; ours minus
                     this is what the wrapper costs per call

Before every call of ours and stock on CUDA, torch.compiler.cudagraph_mark_step_begin() (a new generation step, as
an engine marks it): counted in their time. Timing: --rounds rounds; in each, every variant (in an order shuffled
every round) makes one untimed call, then --calls calls back to back after a synchronize (on a loaded CPU,
many rounds of one call each are the steadiest: the CPU default, 801 x 1; CUDA: 7 x 200): host_us is the time
until the last call returns, per call (the host's cost while the CPU runs ahead), wall_us the time until a
synchronize after it returns, per call (the step's cost: the larger of host and GPU time), thread_us the CPU
time the calling thread used, per call (time.thread_time: what other processes on a shared machine take is not in
it). Medians over rounds. On CPU host and wall are the same (everything runs on the host, one intra-op thread by
default) and thread_us is the steadiest on a loaded machine: the host path of each wrapper, with the same graph
compute in ours and stock except the page-table op (ours fills its table with syncfree.page_table, stock with
page_table_).

--profile N: cProfile over N warm calls of ours (and of stock with --profile-stock) at every configuration; prints
the top functions by cumulative and by self time (per call; cProfile slows every Python call, so the absolute
numbers are inflated: read the shares) and writes them to the JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import _commit, write_json  # noqa: E402

VARIANTS = {"cuda": ("ours", "stock", "replay", "ours_dynamo"), "cpu": ("ours", "stock", "eager", "ours_dynamo")}


def config_for(device: str, layers: int, batch: int):
    from compile_pass.examples import TinyLlamaConfig

    if device == "cuda":
        max_len, page = 4096, 16
        return TinyLlamaConfig(vocab=4096, hidden=512, layers=layers, heads=8, kv_heads=8, head_dim=64,
                               intermediate=1536, page_size=page, max_context_len=max_len,
                               num_pages=batch * max_len // page, max_requests=batch, dtype=torch.bfloat16)
    max_len, page = 128, 4
    return TinyLlamaConfig(layers=layers, page_size=page, max_context_len=max_len, num_pages=batch * max_len // page,
                           max_requests=batch, dtype=torch.float32)


def environment(device: str) -> dict:
    env = {"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__,
           "python": platform.python_version(), "command": " ".join(sys.argv), "commit": _commit(),
           "cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


class Setup:
    """One configuration: the model, its KV pools, one batch and the hand-written step's static page table."""

    def __init__(self, device: str, layers: int, batch: int, context: int):
        from compile_pass import _compat
        from compile_pass.examples import TinyLlama, make_batch

        self.device, self.layers, self.batch = device, layers, batch
        self.config = c = config_for(device, layers, batch)
        self.model = TinyLlama(c, device=device)
        self.k_pool, self.v_pool = self.model.new_kv_pool(device, per_layer=True)
        for pool in self.k_pool + self.v_pool:
            pool.normal_()
        self.fb = make_batch(c, [min(context, c.max_context_len)] * batch, device=device)
        self.page_buffer = torch.zeros(batch, c.max_context_len // c.page_size, dtype=torch.int32, device=device)
        if device == "cuda":  # persistent engine buffers: static inputs of the CUDA graphs, for every variant alike
            for t in self.k_pool + self.v_pool + [self.fb.req_to_token, self.page_buffer]:
                _compat.mark_static_address(t)

    def item_step(self):
        """The engine's step with the host max (what compile_pass.compile rewrites)."""
        model, k_pool, v_pool = self.model, self.k_pool, self.v_pool
        return lambda fb: model(fb, k_pool, v_pool)

    def static_step(self):
        """The hand-written sync-free step: a static-width table filled on the device."""
        model, k_pool, v_pool, page_buffer = self.model, self.k_pool, self.v_pool, self.page_buffer
        return lambda fb: model(fb, k_pool, v_pool, page_buffer=page_buffer)


def build_variants(setup: Setup) -> tuple[dict, dict]:
    """The variants' zero-argument calls (each after its first, compiling, call and warm-up) and what their first
    calls said (seconds, the report's counts)."""
    import compile_pass

    fb, cuda = setup.fb, setup.device == "cuda"
    info: dict = {}
    ours = compile_pass.compile(setup.item_step(), max_context_len=setup.config.max_context_len, cudagraphs=cuda,
                                fullgraph=True)
    if cuda:
        stock = torch.compile(setup.static_step(), mode="reduce-overhead", fullgraph=True)
    else:
        stock = torch.compile(setup.static_step(), fullgraph=True)
    calls = {}
    for name, fn in (("ours", ours), ("stock", stock)):
        start = time.perf_counter()
        fn(fb)
        sync(setup.device)
        info[f"{name}_first_call_s"] = time.perf_counter() - start
        calls[name] = marked(fn, fb) if cuda else (lambda f=fn: f(fb))
    merged = compile_pass.SyncReport.merge(compile_pass.reports(ours))
    info["ours_report"] = dict(rewritten=len(merged.rewritten), kept=len(merged.kept),
                               syncs_remaining=merged.syncs_remaining, notes=len(merged.notes))
    inner = ours._syncfree_compiled
    calls["ours_dynamo"] = marked(inner, fb) if cuda else (lambda: inner(fb))
    if cuda:
        calls["replay"] = capture_by_hand(torch.compile(setup.static_step(), fullgraph=True), fb)
    else:
        eager = setup.static_step()
        calls["eager"] = lambda: eager(fb)
    for _ in range(5):  # CUDA-graph trees: warm-up, then recording, then replays
        for call in calls.values():
            call()
    sync(setup.device)
    return calls, info


def marked(fn, fb):
    """A call as an engine makes it under CUDA-graph trees: a new generation step, then the step."""
    mark = torch.compiler.cudagraph_mark_step_begin

    def call():
        mark()
        return fn(fb)
    return call


def capture_by_hand(compiled, fb):
    """The floor: compile the hand-written step, warm it up on a side stream, capture one CUDA graph of it; each
    call replays it."""
    compiled(fb)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            compiled(fb)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(fb)
    return graph.replay


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_rounds(calls: dict, device: str, rounds: int, n: int) -> dict:
    """Interleaved rounds: per variant the host, wall and thread-CPU microseconds per call of each round. Each
    variant's block starts with one call that is not timed: what the variant before it left in the caches is not
    counted (on CPU that alone is ~100 us of a ~1 ms step, depending on which variant ran before)."""
    names = list(calls)
    out = {name: {"host_us": [], "wall_us": [], "thread_us": []} for name in names}
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        order = list(names)
        shuffle(order)  # a new order every round: no variant always runs after the same one
        for name in order:
            call = calls[name]
            call()
            sync(device)
            cpu = time.thread_time()
            start = time.perf_counter()
            for _ in range(n):
                call()
            host = time.perf_counter() - start
            cpu = time.thread_time() - cpu
            sync(device)
            wall = time.perf_counter() - start
            out[name]["host_us"].append(host / n * 1e6)
            out[name]["wall_us"].append(wall / n * 1e6)
            out[name]["thread_us"].append(cpu / n * 1e6)
    return out


def summarize(samples: dict) -> dict:
    result = {}
    for name, s in samples.items():
        result[name] = {key: statistics.median(values) for key, values in s.items()}
        result[name].update({f"rounds_{key}": [round(x, 2) for x in values] for key, values in s.items()})
    return result


# The layers one call goes through, outermost first: (label, file, function; None: the function of that file with the
# largest cumulative time). A layer's own share is its cumulative time less the next layer found below it.
LAYERS = (
    ("ours: compile_pass.compile's call wrapper (run)", "compile_pass/backend.py", "run"),
    ("ours: tracing.call_traced", "compile_pass/tracing.py", "call_traced"),
    ("ours: tracing.call_retracing", "compile_pass/tracing.py", "call_retracing"),
    ("Dynamo: torch.compile's wrapper (eval frame, the frame's guards, the cache lookup)",
     "torch/_dynamo/eval_frame.py", "compile_wrapper"),
    ("ours: the per-call input guard (input_guard.guarded)", "compile_pass/input_guard.py", "guarded"),
    ("AOT autograd's runtime wrappers", "torch/_functorch/aot_autograd.py", "forward"),
    ("Inductor's compiled graph wrapper (output_code)", "torch/_inductor/output_code.py", "__call__"),
    ("CUDA-graph trees (inputs copied, replay)", "torch/_inductor/cudagraph_trees.py", None),
)


def layers_of(rows: list) -> list:
    """Each LAYERS entry found in a profile: its cumulative microseconds per call and its own share (to the next
    layer found inside it; the last one's own share is its whole cumulative time)."""
    found = []
    for label, path, func in LAYERS:
        matches = [r for r in rows if r["file"].endswith(path) and (func is None or r["func"] == func)]
        if matches:
            best = max(matches, key=lambda r: r["cumulative_us"])
            found.append(dict(layer=label, function=best["function"], cumulative_us=best["cumulative_us"]))
    for outer, inner in zip(found, found[1:] + [None]):
        outer["own_us"] = outer["cumulative_us"] - (inner["cumulative_us"] if inner else 0.0)
    return found


def profile_calls(call, n: int, top: int = 25) -> dict:
    """cProfile over n warm calls: the top functions by cumulative and by self time and the layers of one call,
    microseconds per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        call()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, func), (cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append(dict(function=f"{short_path(filename)}:{line}({func})", file=short_path(filename), func=func,
                         ncalls_per_call=nc / n, self_us=tt / n * 1e6, cumulative_us=ct / n * 1e6))
    layers = layers_of(rows)
    ours = sorted((r for r in rows if r["file"].startswith("compile_pass/")  # the wrappers, not the kernels' ops
                   and not r["file"].startswith("compile_pass/kernels/")), key=lambda r: -r["self_us"])
    for r in rows:
        del r["file"], r["func"]
    return dict(calls=n, total_us=sum(r["self_us"] for r in rows), layers=layers, compile_pass_functions=ours[:top],
                top_cumulative=sorted(rows, key=lambda r: -r["cumulative_us"])[:top],
                top_self=sorted(rows, key=lambda r: -r["self_us"])[:top])


def short_path(filename: str) -> str:
    """A profile's file name from the package root on: torch/_dynamo/eval_frame.py, compile_pass/backend.py."""
    for marker in ("site-packages/", "/compile_pass/", "/kernels/", "/examples/", "/benchmarks/"):
        if marker in filename:
            head = "" if marker == "site-packages/" else marker.strip("/") + "/"
            return head + filename.split(marker, 1)[1]
    return filename.rsplit("/", 1)[-1] if "/" in filename else filename


def print_profile(title: str, prof: dict, top: int) -> None:
    print(f"-- {title}: cProfile over {prof['calls']} warm calls, us per call (inflated by the profiler), "
          f"total {prof['total_us']:.1f}", flush=True)
    print("   layers of one call, outermost first:")
    print(f"   {'cum us':>9} {'own us':>9}  layer")
    for layer in prof["layers"]:
        print(f"   {layer['cumulative_us']:9.1f} {layer['own_us']:9.1f}  {layer['layer']}")
    for key, label in (("compile_pass_functions", "self time, compile_pass's functions"),
                       ("top_cumulative", "cumulative time"), ("top_self", "self time")):
        print(f"   by {label}:")
        print(f"   {'cum us':>9} {'self us':>9} {'calls':>6}  function")
        for r in prof[key][:top]:
            print(f"   {r['cumulative_us']:9.1f} {r['self_us']:9.1f} {r['ncalls_per_call']:6.1f}  {r['function']}")
    sys.stdout.flush()


def measure(args, layers: int, batch: int) -> dict:
    torch._dynamo.reset()
    setup = Setup(args.device, layers, batch, args.context)
    row: dict = dict(layers=layers, batch=batch, context=min(args.context, setup.config.max_context_len))
    try:
        calls, info = build_variants(setup)
    except Exception as e:  # recorded; the other configurations still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
        print(f"L={layers} B={batch}: {row['error']}", flush=True)
        return row
    row.update(info)
    row["variants"] = summarize(time_rounds(calls, args.device, args.rounds, args.calls))
    v = row["variants"]
    floor = "replay" if args.device == "cuda" else "eager"
    for key in ("host_us", "thread_us"):
        row[f"ours_minus_stock_{key}"] = v["ours"][key] - v["stock"][key]
        row[f"ours_wrapper_{key}"] = v["ours"][key] - v["ours_dynamo"][key]
        row[f"ours_minus_floor_{key}"] = v["ours"][key] - v[floor][key]
    print(f"L={layers:>2} B={batch:>2} | " + " | ".join(
        f"{name} {v[name]['host_us']:7.1f} host {v[name]['wall_us']:7.1f} wall {v[name]['thread_us']:7.1f} cpu"
        for name in v), flush=True)
    if args.profile:
        row["profile"] = {}
        for name in ("ours", "stock") if args.profile_stock else ("ours",):
            prof = row["profile"][name] = profile_calls(calls[name], args.profile, args.profile_top)
            print_profile(f"{name} L={layers} B={batch}", prof, args.profile_top)
    del calls
    return row


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=None, help="default 7 on CUDA, 801 on CPU")
    parser.add_argument("--calls", type=int, default=None,
                        help="timed calls per variant per round (default 200 on CUDA, 1 on CPU)")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens per request (default 1024 on CUDA, 17 on CPU; capped at max_context_len)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="cProfile over N warm calls of ours at each configuration")
    parser.add_argument("--profile-stock", action="store_true", help="with --profile: stock's calls too")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default 1 on CPU: the host path, not intra-op threading)")
    parser.add_argument("--out", "--json", dest="out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (use --device cpu)")
    cuda = args.device == "cuda"
    if args.context is None:
        args.context = 1024 if cuda else 17
    if args.rounds is None:
        args.rounds = 7 if cuda else 801
    if args.calls is None:
        args.calls = 200 if cuda else 1
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = dict(env=environment(args.device), rounds=args.rounds, calls=args.calls,
                      variants=list(VARIANTS[args.device]), rows=[])
        print(f"host time per call (us), medians of {args.rounds} rounds of {args.calls} calls, device "
              f"{args.device}", flush=True)
        for layers in args.layers:
            for batch in args.batches:
                result["rows"].append(measure(args, layers, batch))
                write_json(args.out, result)
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()

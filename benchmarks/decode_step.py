"""Benchmark: what removing the decode step's host sync is worth, on the reference decoder (H200).

    python benchmarks/decode_step.py [--batches 1 8 64] [--contexts 4096 32768] [--page-size 16]
                                     [--attention paged_decode|fa4] [--metadata item|sglang] [--json out.json]

One table: per (B, context) the median step time (CUDA events, >= 200 steps after warm-up), host syncs per
step (torch.cuda.set_sync_debug_mode("warn") around steps) and notes, for
  (a) eager with .max().item()          (b) stock torch.compile (graph break at .item())
  (c) stock + capture_scalar_outputs + mode="reduce-overhead" (whatever happens, recorded)
  (d) backend="syncfree"                (e) backend="syncfree" with CUDA graphs
  (f) hand-written: static page table on device, stock compile, one CUDA graph captured by hand.
The compiled variants are built once per batch size; contexts change only the lengths (max_context_len 32K).
"""

from __future__ import annotations

import argparse
import statistics
import traceback
import warnings

import torch

import compile_pass
from _common import apply_tuning, environment, require_cuda, write_json
from compile_pass._compat import CudagraphSkips
from compile_pass.examples import TinyLlama, TinyLlamaConfig, make_batch

MAX_CTX = 32768


def step_times(fn, steps=200, warmup=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)


def syncs_per_step(fn, steps=10):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught) / steps


def cudagraph_counters():
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--attention", default="paged_decode", choices=["paged_decode", "fa4"])
    parser.add_argument("--metadata", default="item", choices=["item", "sglang"],
                        help="the metadata step: .max().item() with a strided slice, or SGLang's FA-backend "
                             "spelling (seq_lens_cpu mirror, strided column index)")
    parser.add_argument("--json")
    parser.add_argument("--tuning", help="paged_decode launch values (JSON) to use instead of the committed TUNING")
    args = parser.parse_args()
    apply_tuning(args.tuning)
    require_cuda()
    rows = []
    print(f"{'B':>3} {'ctx':>6} | " + " | ".join(f"{v:>16}" for v in "abcdef"))
    for batch in args.batches:
        config = TinyLlamaConfig(vocab=32000, hidden=4096, layers=args.layers, heads=32, kv_heads=8, head_dim=128,
                                 intermediate=8192, page_size=args.page_size, max_context_len=MAX_CTX,
                                 num_pages=batch * MAX_CTX // args.page_size, max_requests=batch,
                                 attention=args.attention, metadata=args.metadata, dtype=torch.bfloat16)
        model = TinyLlama(config, device="cuda")
        k_pool, v_pool = model.new_kv_pool("cuda")
        k_pool.normal_()
        v_pool.normal_()
        # Persistent engine buffers: CUDA graphs keep their addresses (and may write the KV pool in place).
        compile_pass._compat.mark_static_address(k_pool)
        compile_pass._compat.mark_static_address(v_pool)
        page_buffer = torch.zeros(batch, MAX_CTX // args.page_size, dtype=torch.int32, device="cuda")

        def step(fb):
            return model(fb, k_pool, v_pool)

        def hand_step(fb):
            return model(fb, k_pool, v_pool, page_buffer=page_buffer)

        torch._dynamo.reset()
        # One function object per variant: Dynamo caches compiled frames per code object.
        variants = {
            "a": step,
            "b": torch.compile(lambda fb: step(fb)),
            "c": torch.compile(lambda fb: step(fb), mode="reduce-overhead", fullgraph=True),
            "d": compile_pass.compile(lambda fb: step(fb), max_context_len=MAX_CTX, fullgraph=True),
            "e": compile_pass.compile(lambda fb: step(fb), max_context_len=MAX_CTX, cudagraphs=True,
                                      fullgraph=True),
        }
        hand_compiled = torch.compile(hand_step, fullgraph=True)
        for ctx in args.contexts:
            fb = make_batch(config, [ctx] * batch, device="cuda")
            compile_pass._compat.mark_static_address(fb.req_to_token)
            row = dict(B=batch, ctx=ctx, page_size=args.page_size, attention=args.attention, metadata=args.metadata)
            ref = step(fb).float()
            row["ref_checksum"] = ref.sum().item()
            for name, fn in variants.items():
                call = (lambda f=fn: f(fb))
                skips = CudagraphSkips()
                try:
                    if name == "c":
                        with compile_pass._compat.capture_scalar_outputs(), skips:
                            before = cudagraph_counters()
                            out = call()
                            row["c_max_abs_err"] = (out.float() - ref).abs().max().item()
                        with compile_pass._compat.capture_scalar_outputs():
                            row["c_cudagraph_counters"] = {k: v - before.get(k, 0)
                                                           for k, v in cudagraph_counters().items()}
                            row["c_us"] = step_times(call)
                            row["c_syncs"] = syncs_per_step(call)
                    else:
                        before = cudagraph_counters()
                        with skips:
                            out = call()
                        # Compare now: a CUDA-graph output is overwritten by the next replay.
                        row[f"{name}_max_abs_err"] = (out.float() - ref).abs().max().item()
                        row[f"{name}_checksum"] = out.float().sum().item()
                        row[f"{name}_us"] = step_times(call)
                        row[f"{name}_syncs"] = syncs_per_step(call)
                        if name == "e":
                            row["e_cudagraph_counters"] = {k: v - before.get(k, 0)
                                                           for k, v in cudagraph_counters().items()}
                    if skips.messages:
                        row[f"{name}_cudagraph_log"] = skips.messages[-5:]
                except Exception as e:
                    if skips.messages:
                        row[f"{name}_cudagraph_log"] = skips.messages[-5:]
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                    row[f"{name}_trace"] = traceback.format_exc()[-1500:]
            # (f): compile the sync-free step, then capture it in one CUDA graph by hand.
            static_fb = fb
            hand_compiled(static_fb)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    hand_compiled(static_fb)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = hand_compiled(static_fb)
            row["f_us"] = step_times(graph.replay)
            row["f_syncs"] = syncs_per_step(graph.replay)
            graph.replay()
            row["f_max_abs_err"] = (static_out.float() - ref).abs().max().item()
            rows.append(row)
            cells = []
            for v in "abcdef":
                if f"{v}_us" in row:
                    cells.append(f"{row[v + '_us']:9.1f}us {row[v + '_syncs']:4.1f}s")
                else:
                    cells.append(f"{'error':>16}")
            print(f"{batch:>3} {ctx:>6} | " + " | ".join(cells), flush=True)
            write_json(args.json, dict(env=environment(), rows=rows))
            del graph, static_out
        del model, k_pool, v_pool, variants, hand_compiled
        torch.cuda.empty_cache()
    write_json(args.json, dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()

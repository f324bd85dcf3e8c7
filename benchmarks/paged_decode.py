"""Benchmark: syncfree.paged_decode against FA4 (when importable) and a torch gather + SDPA baseline (H200).

    python benchmarks/paged_decode.py [--json out.json] [--no-fa4]
    python benchmarks/paged_decode.py --compare [--sweep-short] [--json out.json]

--compare (issue 22, the short path): checks the short path on the GPU first (against a float32 torch reference
and the split path, ragged and poisoned-free random rows, Sq 1 and 4, page sizes 1, 3 and 16, and CUDA-graph
replays with new lengths each time: the ticket counters must be back at 0 after every call), then with
--sweep-short times the short path's launch values at B=1 4K/8K and B=4 8K, then the table: B=1 4K/8K/32K,
B=4 8K, B=64 4K/32K at page sizes 16 and 1, each through the split path (today's code: split + combine, or
direct), the short path (forced, committed SHORT_TUNING), the short path with the sweep's best values, and the
path `auto` picks (what ships), all cold-L2 CUDA-graph medians as below.

bf16, Hq=32, Hkv=8, D=128, Sq=1, full-length rows; B 1 and 4 at contexts 4K, 8K, 32K and 128K, B 8 and 64 at
4K and 32K; page_size 1 and 16. The floor is the K and V bytes of the live keys, read once, over the device
copy bandwidth measured in the same run. Times are CUDA-graph replays (device time) with the inputs cold in L2
(the calls rotate through copies of their inputs, as a decode step's weights flush L2 between two layers'
attention) for paged_decode and FA4 (eager latency where FA4's launch cannot be captured: the JSON's
fa4_timing says which); paged_decode's eager latency (Python dispatch included) and a gather + SDPA baseline
(small shapes only: it copies the keys densely) are given too.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import compile_pass  # noqa: F401
from _common import (apply_tuning, copy_bandwidth_tbs, environment, graph_us, median_us, require_cuda,
                     rotating_graph_us, write_json)

HQ, HKV, D = 32, 8, 128


def fa4():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


def case(batch, ctx, ps):
    pages_per_row = ctx // ps
    num_pages = batch * pages_per_row
    q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_pages, ps, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(num_pages, ps, HKV, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_pages, device="cuda", dtype=torch.int32).view(batch, pages_per_row)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, k, v, table, lens


def kv_bytes(batch, ctx):
    """The K and V bytes of the live keys (bf16), read once: what the bandwidth floor counts."""
    return 2 * batch * ctx * HKV * D * 2


def sdpa_baseline(q, k, v, table, lens, ctx):
    batch, ps = q.shape[0], k.shape[1]
    t = torch.arange(ctx, device="cuda")
    pages = table[:, t // ps].long()
    kk = k[pages, t % ps]  # [B, T, Hkv, D]
    vv = v[pages, t % ps]
    return F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                          enable_gqa=True).transpose(1, 2)


SHAPES = ([(b, ctx) for b in (1, 4) for ctx in (4096, 8192, 32768, 131072)]
          + [(b, ctx) for b in (8, 64) for ctx in (4096, 32768)])


COMPARE_SHAPES = [(1, 4096), (1, 8192), (1, 32768), (4, 8192), (64, 4096), (64, 32768)]
SWEEP_SHAPES = [(1, 4096), (1, 8192), (4, 8192)]
SHORT_KNOBS = ("block_n", "min_blocks_per_split", "programs_per_sm", "num_warps", "num_stages")
SHORT_GRID = [dict(zip(SHORT_KNOBS, values)) for values in
              [(n, m, p, w, s) for n in (32, 64, 128) for m in (1, 2) for p in (4, 8) for w in (4, 8) for s in (2,)]
              + [(64, 2, 8, 4, 1), (128, 1, 4, 8, 1), (64, 1, 8, 4, 3), (128, 1, 2, 8, 2), (16, 2, 8, 4, 2)]]


def with_path(path, tuning=None):
    """A context: SHORT_TUNING's path (and launch values) set for the calls inside."""
    import contextlib

    from compile_pass.kernels import paged_decode as pd

    @contextlib.contextmanager
    def ctx():
        saved = dict(pd.SHORT_TUNING)
        pd.SHORT_TUNING.update(tuning or {})
        pd.SHORT_TUNING["path"] = path
        try:
            yield
        finally:
            pd.SHORT_TUNING.clear()
            pd.SHORT_TUNING.update(saved)
    return ctx()


def ragged_case(batch, sq, ps, lengths, width, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_pages = batch * width + 3
    q = torch.randn(batch, sq, HQ, D, generator=gen).to(dtype).cuda()
    k = torch.randn(num_pages, ps, HKV, D, generator=gen).to(dtype).cuda()
    v = torch.randn(num_pages, ps, HKV, D, generator=gen).to(dtype).cuda()
    table = torch.randperm(num_pages, generator=gen)[: batch * width].view(batch, width).to(torch.int32).cuda()
    return q, k, v, table, torch.tensor(lengths, dtype=torch.int32, device="cuda")


def check_short_path():
    """The short path on the GPU: against a float32 torch reference and the split path, then CUDA-graph replays
    with new lengths (the counters reset). Returns the rows; raises on a mismatch (the table is not worth
    reading then)."""
    from compile_pass.kernels import paged_decode as pd

    rows = []
    for batch, sq, ps, dtype in [(1, 1, 16, torch.bfloat16), (4, 1, 1, torch.bfloat16), (3, 4, 3, torch.bfloat16),
                                 (2, 4, 16, torch.float32), (8, 1, 16, torch.float16)]:
        width = -(-9000 // ps)
        lengths = [(4099 * (b + 1) + 17 * b) % 9000 for b in range(batch)]
        lengths[0] = 8192 if batch > 1 else 8191
        if batch > 2:
            lengths[1] = 0
        q, k, v, table, lens = ragged_case(batch, sq, ps, lengths, width, dtype, seed=batch * 10 + sq)
        ref = pd._attend_torch(q.float(), k.float(), v.float(), table, lens, 1 / D ** 0.5)
        with with_path("split"):
            split = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
        with with_path("short"):
            short = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
        splits = pd.short_splits_for(batch, HKV, width * ps, pd.sm_count(q))
        err = (short.float() - ref).abs().max().item()
        row = dict(B=batch, sq=sq, ps=ps, dtype=str(dtype), splits=splits, short_vs_ref=err,
                   split_vs_ref=(split.float() - ref).abs().max().item(),
                   short_vs_split=(short.float() - split.float()).abs().max().item())
        rows.append(row)
        print("check", row, flush=True)
        tol = 1e-4 if dtype == torch.float32 else (3e-3 if dtype == torch.float16 else 2e-2)
        assert torch.isfinite(short).all() and err <= tol, row
    # CUDA-graph replays: the counters go back to 0 after each replay, whatever the lengths.
    q, k, v, table, lens = ragged_case(4, 1, 16, [8192, 5000, 1, 0], 512, seed=3)
    with with_path("short"):
        torch.ops.syncfree.paged_decode(q, k, v, table, lens)  # warm up: compile, counters made outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
        for i, new in enumerate([[8192, 5000, 1, 0], [17, 8000, 0, 4096], [1, 2, 3, 8192]] * 2):
            lens.copy_(torch.tensor(new, dtype=torch.int32))
            graph.replay()
            ref = pd._attend_torch(q.float(), k.float(), v.float(), table, lens, 1 / D ** 0.5)
            err = (out.float() - ref).abs().max().item()
            assert err <= 2e-2, (i, new, err)
        assert (pd._COUNTERS[q.device] == 0).all(), "ticket counters not reset"
    rows.append(dict(graph_replays=6, ok=True))
    print("check: CUDA-graph replays with new lengths match, counters back at 0", flush=True)
    return rows


def path_us(batch, ctx, ps, path, tuning=None, rep=100):
    nbytes = kv_bytes(batch, ctx)
    cases = {}

    def make(i):
        cases[i] = case(batch, ctx, ps)
        return lambda: torch.ops.syncfree.paged_decode(*cases[i])
    try:
        with with_path(path, tuning):
            return rotating_graph_us(make, nbytes, rep=rep)
    except Exception as e:  # e.g. out of shared memory for a swept shape
        print("failed", batch, ctx, ps, path, tuning, type(e).__name__, str(e)[:160], flush=True)
        torch.cuda.synchronize()
        return float("inf")
    finally:
        cases.clear()
        torch.cuda.empty_cache()


def sweep_short(copy, results):
    import math

    for batch, ctx in SWEEP_SHAPES:
        for ps in (1, 16):
            floor = kv_bytes(batch, ctx) / (copy * 1e12) * 1e6
            for config in SHORT_GRID:
                us = path_us(batch, ctx, ps, "short", config, rep=20)  # 20 ms of replays, as tune.py
                results.append(dict(B=batch, ctx=ctx, page_size=ps, **config, us=us, share_of_floor=floor / us))
            best = sorted((r for r in results if (r["B"], r["ctx"], r["page_size"]) == (batch, ctx, ps)),
                          key=lambda r: r["us"])[:3]
            print("sweep", batch, ctx, ps, "floor", round(floor, 2), "best",
                  [(tuple(r[k] for k in SHORT_KNOBS), round(r["us"], 2)) for r in best], flush=True)
    best_of = {}
    for r in results:
        key = (r["B"], r["ctx"], r["page_size"])
        best_of[key] = min(best_of.get(key, float("inf")), r["us"])
    score = {}
    for r in results:
        key = tuple(r[k] for k in SHORT_KNOBS)
        score.setdefault(key, []).append(math.log(r["us"] / best_of[(r["B"], r["ctx"], r["page_size"])]))
    ranked = sorted(score, key=lambda key: sum(score[key]) / len(score[key]))
    top = [dict(zip(SHORT_KNOBS, key), mean_slowdown=math.exp(sum(score[key]) / len(score[key])))
           for key in ranked[:6]]
    print("ranked", top, flush=True)
    return dict(zip(SHORT_KNOBS, ranked[0])), top


def device_sms():
    from compile_pass.kernels import paged_decode as pd

    return pd.sm_count(torch.empty(0, device="cuda"))


def compare(args, copy):
    from compile_pass.kernels import paged_decode as pd

    out = dict(env=environment(), copy_tbs=copy, short_tuning=dict(pd.SHORT_TUNING))
    out["check"] = check_short_path()
    write_json(args.json, out)
    best = None
    if args.sweep_short:
        out["sweep"] = []
        best, out["ranked"] = sweep_short(copy, out["sweep"])
        out["sweep_best"] = best
        write_json(args.json, out)
    cols = [("split", "split", None), ("short", "short", None)] + ([("short_best", "short", best)] if best else []) \
        + [("auto", "auto", None)]
    print(f"{'B':>3} {'ctx':>6} {'ps':>3} | {'floor':>6} | " + " | ".join(f"{n:>10} {'%fl':>4}" for n, _, _ in cols)
          + " | auto takes | auto/split")
    out["rows"] = []
    for batch, ctx in COMPARE_SHAPES:
        for ps in (16, 1):
            floor = kv_bytes(batch, ctx) / (copy * 1e12) * 1e6
            row = dict(B=batch, ctx=ctx, page_size=ps, kv_bytes=kv_bytes(batch, ctx), floor_us=floor)
            for name, path, tuning in cols:
                row[f"{name}_us"] = path_us(batch, ctx, ps, path, tuning)
                row[f"{name}_share_of_floor"] = floor / row[f"{name}_us"]
            row["auto_takes"] = "short" if pd.use_short_path(batch, HKV, ctx, device_sms()) else "split"
            out["rows"].append(row)
            print(f"{batch:>3} {ctx:>6} {ps:>3} | {floor:6.2f} | "
                  + " | ".join(f"{row[f'{n}_us']:10.2f} {100 * floor / row[f'{n}_us']:3.0f}%" for n, _, _ in cols)
                  + f" | {row['auto_takes']:>10} | {row['auto_us'] / row['split_us']:.3f}", flush=True)
            write_json(args.json, out)
    print("JSON", json.dumps(out["rows"] + ([dict(sweep_best=best)] if best else [])))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--no-fa4", action="store_true", help="leave FA4 out even where it is importable")
    parser.add_argument("--tuning", help="paged_decode launch values (JSON) to use instead of the committed TUNING")
    parser.add_argument("--compare", action="store_true", help="the short path against the split path (issue 22)")
    parser.add_argument("--sweep-short", action="store_true", help="with --compare: sweep the short path's values")
    args = parser.parse_args()
    apply_tuning(args.tuning)
    require_cuda()
    copy = copy_bandwidth_tbs()
    if args.compare:
        print(f"device copy: {copy:.2f} TB/s")
        return compare(args, copy)
    fa = None if args.no_fa4 else fa4()
    print(f"device copy: {copy:.2f} TB/s; FA4: {'yes' if fa else 'no'}")
    print(f"{'B':>3} {'ctx':>6} {'ps':>3} | {'floor':>6} {'ours us':>8} {'%floor':>6} {'eager':>7} | {'FA4 us':>8} | "
          f"{'SDPA us':>8} | err")
    rows = []
    for batch, ctx in SHAPES:
        for ps in (1, 16):
            nbytes = kv_bytes(batch, ctx)
            floor = nbytes / (copy * 1e12) * 1e6
            cases = {}

            def make(i, fn):
                cases.setdefault(i, case(batch, ctx, ps))
                return lambda: fn(*cases[i])

            def ours_call(q, k, v, table, lens):
                return torch.ops.syncfree.paged_decode(q, k, v, table, lens)

            ours = rotating_graph_us(lambda i: make(i, ours_call), nbytes)
            q, k, v, table, lens = cases[0]
            ours_eager = median_us(lambda: ours_call(q, k, v, table, lens))
            out = ours_call(q, k, v, table, lens)
            row = dict(B=batch, ctx=ctx, page_size=ps, kv_bytes=nbytes, floor_us=floor, ours_us=ours,
                       ours_tbs=nbytes / ours / 1e6, ours_share_of_floor=floor / ours, ours_eager_us=ours_eager)
            ref = None
            if fa is not None:
                def fa_call(q, k, v, table, lens):
                    return fa(q, k, v, seqused_k=lens, page_table=table, causal=True)
                try:  # device time when FA4's launch can be graph-captured, else eager latency
                    row["fa4_us"] = rotating_graph_us(lambda i: make(i, fa_call), nbytes)
                    row["fa4_timing"] = "cuda graph"
                except Exception as e:
                    torch.cuda.synchronize()
                    row["fa4_us"] = median_us(lambda: fa_call(q, k, v, table, lens))
                    row["fa4_timing"] = f"eager ({type(e).__name__})"
                row["fa4_tbs"] = nbytes / row["fa4_us"] / 1e6
                ref = fa_call(q, k, v, table, lens)
                ref = ref[0] if isinstance(ref, tuple) else ref
            if batch * ctx <= 8 * 32768:
                row["sdpa_us"] = graph_us(lambda: sdpa_baseline(q, k, v, table, lens, ctx), rep=50)
                if ref is None:
                    ref = sdpa_baseline(q, k, v, table, lens, ctx)
            if ref is not None:
                row["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
            rows.append(row)
            print(f"{batch:>3} {ctx:>6} {ps:>3} | {floor:6.1f} {ours:8.1f} {100 * floor / ours:5.0f}% {ours_eager:7.1f} | "
                  f"{row.get('fa4_us', float('nan')):8.1f} | {row.get('sdpa_us', float('nan')):8.1f} | "
                  f"{row.get('max_abs_err', float('nan')):.1e}", flush=True)
            del q, k, v, table, lens, out, ref
            cases.clear()
            torch.cuda.empty_cache()
            write_json(args.json, dict(env=environment(), copy_tbs=copy, fa4=fa is not None, rows=rows))


if __name__ == "__main__":
    main()

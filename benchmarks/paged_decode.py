"""Benchmark: syncfree.paged_decode against FA4 (when importable) and a torch gather + SDPA baseline (H200).

    python benchmarks/paged_decode.py [--json out.json] [--no-fa4]
    python benchmarks/paged_decode.py --compare [--sweep-short [--sweep-seconds S]] [--json out.json]
    python benchmarks/paged_decode.py --compare --dry      # the sweep's launches and checks, no GPU needed

--compare (issue 22, the short path: one program per (row, group of KV heads, split), then the combine kernel)
checks the short path on the GPU first (against a float32 torch reference and the split path: ragged rows with a
zero one, Sq 1 and 4, page sizes 1, 3 and 16, bf16, fp16 and fp32, the committed SHORT_TUNING and a few other
launch settings, then CUDA-graph replays with new lengths each time), then with --sweep-short times the
SHORT_GRID launch settings (heads per program, block_n, programs per SM, warps, stages and the split rule's other
knobs; at most S seconds, whole settings left out past that) at B=1 4K/8K and B=4 8K, page sizes 1 and 16,
ranking them by their mean slowdown against each shape's best; then the table: B=1 4K/8K/32K, B=4 8K,
B=64 4K/32K at page sizes 16 and 1, each through the split path (today's code: split + combine, or direct), the
short path (forced, committed SHORT_TUNING), the short path with the sweep's best values, and the path `auto`
picks (what ships), all cold-L2 CUDA-graph medians as below. The whole run is meant to take under 4 minutes on
an H200 (`run_h200.sh short`): the sweep's time budget (default 120 s) keeps it there.

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
from compile_pass.kernels._triton import cdiv
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
# The short path's launch knobs (SHORT_TUNING); a sweep entry sets some of them over the committed values.
SHORT_KNOBS = ("block_n", "heads_per_program", "programs_per_sm", "num_warps", "num_stages", "min_keys_per_split",
               "max_splits", "combine_block_s")


def _grid():
    """26 launch settings of the short kernel, by heads per program (all 8 KV heads: one program reads a page's
    keys for every head; fewer heads: more programs, smaller tiles), each fitting an H200's shared memory in bf16
    at D 128 (short_heads_and_block leaves them as they are); then the split rule's other knobs around the
    8-head, 16-key setting."""
    head_settings = {  # heads: (block_n, programs_per_sm, num_warps, num_stages)
        8: [(16, 1, 8, 2), (16, 2, 8, 2), (16, 1, 8, 3), (16, 2, 8, 3), (32, 1, 8, 2), (32, 2, 8, 2), (16, 1, 4, 2)],
        4: [(16, 1, 4, 2), (16, 2, 4, 2), (16, 4, 4, 2), (32, 1, 4, 2), (32, 2, 4, 2), (32, 2, 8, 2), (16, 2, 4, 3)],
        2: [(32, 2, 4, 2), (32, 4, 4, 2), (64, 2, 4, 2), (64, 4, 4, 2), (16, 4, 4, 2)],
        1: [(64, 4, 4, 2), (64, 8, 4, 2), (32, 8, 4, 2)],  # the split kernel's shape, K and V requested together
    }
    grid = [dict(block_n=n, heads_per_program=h, programs_per_sm=p, num_warps=w, num_stages=st)
            for h, settings in head_settings.items() for n, p, w, st in settings]
    base = dict(block_n=16, heads_per_program=8, programs_per_sm=2, num_warps=8, num_stages=2)
    grid += [dict(base, min_keys_per_split=16), dict(base, min_keys_per_split=64), dict(base, max_splits=64),
             dict(base, combine_block_s=128)]
    return grid


SHORT_GRID = _grid()


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


def knobs(tuning=None) -> dict:
    """Every short-path knob: the committed values with `tuning` over them."""
    from compile_pass.kernels import paged_decode as pd

    return {k: (tuning or {}).get(k, pd.SHORT_TUNING[k]) for k in SHORT_KNOBS}


def short_launch(batch, ctx, ps, tuning=None, sms=132, itemsize=2, sq=1):
    """What the short path launches for a full-length bf16 batch (no GPU needed): heads per program, block_n,
    splits, programs, keys per split, shared memory of one program."""
    from compile_pass.kernels import paged_decode as pd

    block_m = max(pd.MIN_BLOCK_M, pd._next_pow2(sq * HQ // HKV))
    with with_path("short", tuning):
        heads, block_n = pd.short_heads_and_block(HKV, block_m, D, itemsize, pd.SHORT_SMEM_BYTES)
        splits = pd.short_splits_for(batch, HKV, ctx, sms, heads)
    chunk = cdiv(cdiv(ctx, splits), block_n) * block_n  # the kernel's split of a full row
    return dict(heads=heads, block_n=block_n, splits=splits, programs=batch * cdiv(HKV, heads) * splits,
                keys_per_split=chunk, splits_with_keys=cdiv(ctx, chunk),
                smem=pd._next_pow2(heads) * (2 * block_n + block_m) * D * itemsize)


def ragged_case(batch, sq, ps, lengths, width, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_pages = batch * width + 3
    q = torch.randn(batch, sq, HQ, D, generator=gen).to(dtype).cuda()
    k = torch.randn(num_pages, ps, HKV, D, generator=gen).to(dtype).cuda()
    v = torch.randn(num_pages, ps, HKV, D, generator=gen).to(dtype).cuda()
    table = torch.randperm(num_pages, generator=gen)[: batch * width].view(batch, width).to(torch.int32).cuda()
    return q, k, v, table, torch.tensor(lengths, dtype=torch.int32, device="cuda")


# Launch settings the GPU check runs besides the committed one: 1 head per program, 2 heads with 32-key tiles,
# and one split (the kernel writes the output itself, no combine).
CHECK_TUNINGS = [dict(heads_per_program=1, block_n=64, num_warps=4), dict(heads_per_program=2, block_n=32,
                 num_warps=4, programs_per_sm=4), dict(programs_per_sm=0.001)]


def check_short_path():
    """The short path on the GPU: against a float32 torch reference and the split path (ragged rows with a zero
    one, Sq 1 and 4, page sizes 1, 3 and 16, bf16, fp16 and fp32, the committed launch values and CHECK_TUNINGS),
    then CUDA-graph replays with new lengths each time. Returns the rows; raises on a mismatch (the table is not
    worth reading then)."""
    from compile_pass.kernels import paged_decode as pd

    rows = []
    cases = [(1, 1, 16, torch.bfloat16), (4, 1, 1, torch.bfloat16), (3, 4, 3, torch.bfloat16),
             (2, 4, 16, torch.float32), (8, 1, 16, torch.float16)]
    runs = [(c, None) for c in cases] + [(c, t) for t in CHECK_TUNINGS for c in (cases[0], cases[2])]
    for (batch, sq, ps, dtype), tuning in runs:
        width = -(-9000 // ps)
        lengths = [(4099 * (b + 1) + 17 * b) % 9000 for b in range(batch)]
        lengths[0] = 8192 if batch > 1 else 8191
        if batch > 2:
            lengths[1] = 0
        q, k, v, table, lens = ragged_case(batch, sq, ps, lengths, width, dtype, seed=batch * 10 + sq)
        ref = pd._attend_torch(q.float(), k.float(), v.float(), table, lens, 1 / D ** 0.5)
        with with_path("split"):
            split = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
        with with_path("short", tuning):
            short = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
            block_m = max(pd.MIN_BLOCK_M, pd._next_pow2(sq * HQ // HKV))
            heads, block_n = pd.short_heads_and_block(HKV, block_m, D, q.element_size(), pd._smem_bytes(q))
            splits = pd.short_splits_for(batch, HKV, width * ps, pd.sm_count(q), heads)
        err = (short.float() - ref).abs().max().item()
        row = dict(B=batch, sq=sq, ps=ps, dtype=str(dtype), tuning=tuning or "committed", heads=heads,
                   block_n=block_n, splits=splits, short_vs_ref=err,
                   split_vs_ref=(split.float() - ref).abs().max().item(),
                   short_vs_split=(short.float() - split.float()).abs().max().item())
        rows.append(row)
        print("check", row, flush=True)
        tol = 1e-4 if dtype == torch.float32 else (3e-3 if dtype == torch.float16 else 2e-2)
        assert torch.isfinite(short).all() and err <= tol, row
    # CUDA-graph replays (several splits, and one): new lengths each time, the partials of one replay never leak
    # into the next.
    for tuning in (None, CHECK_TUNINGS[-1]):
        q, k, v, table, lens = ragged_case(4, 1, 16, [8192, 5000, 1, 0], 512, seed=3)
        with with_path("short", tuning):
            torch.ops.syncfree.paged_decode(q, k, v, table, lens)  # warm up: compile outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
            for i, new in enumerate([[8192, 5000, 1, 0], [17, 8000, 0, 4096], [1, 2, 3, 8192]] * 2):
                lens.copy_(torch.tensor(new, dtype=torch.int32))
                graph.replay()
                ref = pd._attend_torch(q.float(), k.float(), v.float(), table, lens, 1 / D ** 0.5)
                err = (out.float() - ref).abs().max().item()
                assert err <= 2e-2, (tuning, i, new, err)
        rows.append(dict(graph_replays=6, tuning=tuning or "committed", ok=True))
    print("check: CUDA-graph replays with new lengths match", flush=True)
    return rows


class Inputs:
    """Rotating copies of one shape's inputs, made once and shared by every path and launch setting timed on it."""

    def __init__(self):
        self.cases = {}

    def make(self, batch, ctx, ps):
        def call(i):
            key = (batch, ctx, ps, i)
            if key not in self.cases:
                self.cases[key] = case(batch, ctx, ps)
            c = self.cases[key]
            return lambda: torch.ops.syncfree.paged_decode(*c)
        return call

    def clear(self):
        self.cases.clear()
        torch.cuda.empty_cache()


def path_us(inputs, batch, ctx, ps, path, tuning=None, rep=100):
    try:
        with with_path(path, tuning):
            return rotating_graph_us(inputs.make(batch, ctx, ps), kv_bytes(batch, ctx), rep=rep)
    except Exception as e:  # e.g. out of shared memory for a swept shape
        print("failed", batch, ctx, ps, path, tuning, type(e).__name__, str(e)[:160], flush=True)
        torch.cuda.synchronize()
        return float("inf")


def rank(results):
    """Launch settings by their geometric-mean slowdown against the best of each shape, over the settings timed at
    every shape (a sweep cut short by its time budget leaves some out)."""
    import math

    shapes = {(r["B"], r["ctx"], r["page_size"]) for r in results}
    best_of = {}
    for r in results:
        key = (r["B"], r["ctx"], r["page_size"])
        best_of[key] = min(best_of.get(key, float("inf")), r["us"])
    score = {}
    for r in results:
        score.setdefault(tuple(r[k] for k in SHORT_KNOBS), []).append(
            math.log(r["us"] / best_of[(r["B"], r["ctx"], r["page_size"])]))
    complete = [key for key in score if len(score[key]) == len(shapes)]
    ranked = sorted(complete, key=lambda key: sum(score[key]) / len(score[key]))
    return [dict(zip(SHORT_KNOBS, key), mean_slowdown=math.exp(sum(score[key]) / len(score[key])))
            for key in ranked]


def sweep_short(copy, results, seconds):
    """Every SHORT_GRID setting at every sweep shape (settings in the outer loop, so that a sweep cut short by
    `seconds` leaves out whole settings, not shapes); returns the best-ranked setting and the top 6."""
    import time

    t0 = time.monotonic()
    inputs = Inputs()
    floors = {(b, c): kv_bytes(b, c) / (copy * 1e12) * 1e6 for b, c in SWEEP_SHAPES}
    for n, config in enumerate(SHORT_GRID):
        if time.monotonic() - t0 > seconds:
            print(f"sweep: time budget ({seconds} s) spent, {len(SHORT_GRID) - n} settings left out", flush=True)
            break
        line = []
        for batch, ctx in SWEEP_SHAPES:
            for ps in (1, 16):
                us = path_us(inputs, batch, ctx, ps, "short", config, rep=20)  # 20 ms of replays, as tune.py
                floor = floors[(batch, ctx)]
                results.append(dict(B=batch, ctx=ctx, page_size=ps, **knobs(config), us=us,
                                    share_of_floor=floor / us))
                line.append(f"{us:6.2f}")
        print(f"sweep {n:2d} {config} us [B1 4K ps1/16, B1 8K, B4 8K]: {' '.join(line)}", flush=True)
    inputs.clear()
    for batch, ctx in SWEEP_SHAPES:
        for ps in (1, 16):
            best = sorted((r for r in results if (r["B"], r["ctx"], r["page_size"]) == (batch, ctx, ps)),
                          key=lambda r: r["us"])[:3]
            print("sweep best", batch, ctx, ps, "floor", round(floors[(batch, ctx)], 2),
                  [({k: r[k] for k in SHORT_KNOBS[:5]}, round(r["us"], 2)) for r in best], flush=True)
    top = rank(results)[:6]
    print("ranked", top, flush=True)
    best = {k: top[0][k] for k in SHORT_KNOBS} if top else None
    return best, top


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
        best, out["ranked"] = sweep_short(copy, out["sweep"], args.sweep_seconds)
        out["sweep_best"] = best
        write_json(args.json, out)
    cols = [("split", "split", None), ("short", "short", None)] + ([("short_best", "short", best)] if best else []) \
        + [("auto", "auto", None)]
    print(f"{'B':>3} {'ctx':>6} {'ps':>3} | {'floor':>6} | " + " | ".join(f"{n:>10} {'%fl':>4}" for n, _, _ in cols)
          + " | auto takes | auto/split")
    out["rows"] = []
    inputs = Inputs()
    for batch, ctx in COMPARE_SHAPES:
        for ps in (16, 1):
            floor = kv_bytes(batch, ctx) / (copy * 1e12) * 1e6
            row = dict(B=batch, ctx=ctx, page_size=ps, kv_bytes=kv_bytes(batch, ctx), floor_us=floor)
            for name, path, tuning in cols:
                row[f"{name}_us"] = path_us(inputs, batch, ctx, ps, path, tuning)
                row[f"{name}_share_of_floor"] = floor / row[f"{name}_us"]
            inputs.clear()
            row["auto_takes"] = "short" if pd.use_short_path(batch, HKV, ctx, device_sms()) else "split"
            out["rows"].append(row)
            print(f"{batch:>3} {ctx:>6} {ps:>3} | {floor:6.2f} | "
                  + " | ".join(f"{row[f'{n}_us']:10.2f} {100 * floor / row[f'{n}_us']:3.0f}%" for n, _, _ in cols)
                  + f" | {row['auto_takes']:>10} | {row['auto_us'] / row['split_us']:.3f}", flush=True)
            write_json(args.json, out)
    print("JSON", json.dumps(out["rows"] + ([dict(sweep_best=best)] if best else [])))


def dry_run():
    """What --compare --sweep-short would launch, without a GPU: each sweep setting's grid at the sweep shapes on an
    H200 (132 SMs), checked to fit its shared memory unchanged, and the ranking on made-up times."""
    from compile_pass.kernels import paged_decode as pd

    assert len(SHORT_GRID) <= 30 and len({tuple(knobs(c).values()) for c in SHORT_GRID}) == len(SHORT_GRID)
    for n, config in enumerate([None] + SHORT_GRID):
        launches = [short_launch(b, c, 16, config) for b, c in SWEEP_SHAPES]
        for launch in launches:
            assert launch["smem"] <= pd.SHORT_SMEM_BYTES - (16 << 10), (config, launch)
        want = knobs(config)
        assert all((l["block_n"], l["heads"]) == (want["block_n"], min(want["heads_per_program"], HKV))
                   for l in launches), (config, launches)
        print(f"{'committed' if config is None else n:>9} {config or ''}: " + "; ".join(
            f"B{b} {c // 1024}K {l['programs']} programs, {l['splits']} splits ({l['splits_with_keys']} with keys) "
            f"of {l['keys_per_split']} keys, {l['smem'] >> 10} KB" for (b, c), l in zip(SWEEP_SHAPES, launches)))
    fake = [dict(B=b, ctx=c, page_size=ps, **knobs(config), us=10.0 + n + (b + c / 4096) * (n % 3))
            for n, config in enumerate(SHORT_GRID) for b, c in SWEEP_SHAPES for ps in (1, 16)]
    top = rank(fake)
    assert len(top) == len(SHORT_GRID) and top[0]["mean_slowdown"] == 1.0, top[:2]
    assert rank(fake[:-1])[-1]["mean_slowdown"] >= 1.0 and len(rank(fake[:-1])) == len(SHORT_GRID) - 1
    print(f"dry run: {len(SHORT_GRID)} settings x {len(SWEEP_SHAPES) * 2} shapes; ranking ok")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--no-fa4", action="store_true", help="leave FA4 out even where it is importable")
    parser.add_argument("--tuning", help="paged_decode launch values (JSON) to use instead of the committed TUNING")
    parser.add_argument("--compare", action="store_true", help="the short path against the split path (issue 22)")
    parser.add_argument("--sweep-short", action="store_true", help="with --compare: sweep the short path's values")
    parser.add_argument("--sweep-seconds", type=float, default=120,
                        help="with --sweep-short: start no new launch setting after this many seconds of sweeping")
    parser.add_argument("--dry", action="store_true",
                        help="with --compare: print the short path's launches for the sweep (no GPU needed)")
    args = parser.parse_args()
    apply_tuning(args.tuning)
    if args.compare and args.dry:
        return dry_run()
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

"""Sweep the kernels' launch configurations on a GPU (CUDA-graph replays, so Python launch overhead is out).

    python benchmarks/tune.py [--json out.json] [--only page_table|paged_decode] [--old-kernel FILE]
                              [--write-best FILE]

page_table: BLOCK x programs per SM x warps at three shapes. paged_decode: the split-KV launch (BLOCK_N,
pipeline stages, warps, programs per SM that the split count aims for, key blocks per split at least) at
small batch (B 1 and 4, contexts 8K-128K, page sizes 1 and 16), inputs cold in L2 (rotating copies); then
the best configurations, today's TUNING and (with --old-kernel, the kernel file of an earlier commit) the
earlier kernel, over every small-batch shape and the large-batch shapes whose numbers must hold.
The chosen values go into the kernels' TUNING dicts by hand; BENCHMARKS.md records the sweep.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math

import torch

import compile_pass  # noqa: F401
from compile_pass.kernels import paged_decode as pd
from compile_pass.kernels import page_table as pt
from _common import environment, graph_us, require_cuda, rotating_graph_us, write_json
from paged_decode import case as decode_case, kv_bytes
from page_table import inputs as table_inputs

SWEEP_SHAPES = [(1, 8192, 16), (1, 32768, 1), (1, 32768, 16), (1, 131072, 16), (4, 8192, 1), (4, 32768, 16),
                (4, 131072, 1)]
SMALL_SHAPES = [(b, ctx, ps) for b in (1, 4) for ctx in (8192, 16384, 32768, 65536, 131072) for ps in (1, 16)]
LARGE_SHAPES = [(8, 32768, 16), (64, 4096, 1), (64, 4096, 16), (64, 32768, 1), (64, 32768, 16)]
KNOBS = ("block_n", "num_stages", "num_warps", "programs_per_sm", "min_blocks_per_split", "max_splits")


def load_old_kernel(path):
    spec = importlib.util.spec_from_file_location("old_paged_decode_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def old_launch(module, q, k, v, table, lens):
    """The launch of the kernel as it was before the per-row combine (commit 0d72b29): partials of all
    BLOCK_M rows, combine grid (B, Hkv), always two kernels."""
    batch, sq, hq, dim = q.shape
    ps, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    width = table.shape[1]
    block_m = max(16, pd._next_pow2(sq * group))
    # The split count as it was: aim at 8 programs per SM unless B x Hkv x 4 fills them, >= 4 blocks per split.
    programs = 8 * torch.cuda.get_device_properties(q.device).multi_processor_count
    rows = batch * hkv
    splits = 1 if rows * 4 >= programs else max(1, min(pd.cdiv(programs, rows), pd.cdiv(width * ps, 64 * 4), 64))
    acc = torch.empty((batch, hkv, splits, block_m, dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((batch, hkv, splits, 2, block_m), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(dim)

    def run():
        module.paged_decode_split_kernel[(batch, hkv, splits)](
            q, k, v, table, lens, acc, ml, q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            table.stride(0), table.stride(1), width, ps, scale, sq, splits,
            GROUP=group, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=dim, IEEE=False,
            num_warps=4, num_stages=2)
        module.paged_decode_combine_kernel[(batch, hkv)](
            acc, ml, out, out.stride(0), out.stride(1), out.stride(2), sq, splits,
            GROUP=group, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_D=dim, BLOCK_S=16, num_warps=4)
    return run


def decode_us(shape, tuning=None, old=None):
    """Cold-L2 device time of paged_decode at `shape` under `tuning` (or the old kernel)."""
    batch, ctx, ps = shape
    cases = {}

    def make(i):
        cases[i] = decode_case(batch, ctx, ps)
        if old is not None:
            return old_launch(old, *cases[i])
        return lambda: torch.ops.syncfree.paged_decode(*cases[i])

    saved = dict(pd.TUNING)
    pd.TUNING.update(tuning or {})
    try:
        return rotating_graph_us(make, kv_bytes(batch, ctx), rep=20)
    except Exception as e:  # e.g. out of shared memory
        print("config failed", shape, tuning, type(e).__name__, str(e)[:120], flush=True)
        return float("inf")
    finally:
        pd.TUNING.clear()
        pd.TUNING.update(saved)
        cases.clear()
        torch.cuda.empty_cache()


def sweep_page_table(results):
    default = dict(pt.TUNING)
    for batch, ctx, ps in ((256, 131072, 1), (1, 32768, 1), (64, 32768, 16)):
        r2t, rpi, lens = table_inputs(batch, ctx)
        for block, per_sm, warps in itertools.product((1024, 2048, 4096), (4, 16, 64), (4, 8)):
            pt.TUNING.update(block=block, programs_per_sm=per_sm, num_warps=warps)
            t = graph_us(lambda: torch.ops.syncfree.page_table(r2t, rpi, lens, ps, ctx // ps))
            results.append(dict(B=batch, ctx=ctx, ps=ps, block=block, per_sm=per_sm, warps=warps, us=t))
        best = min((r for r in results if (r["B"], r["ctx"], r["ps"]) == (batch, ctx, ps)), key=lambda r: r["us"])
        print("page_table", batch, ctx, ps, "best", best, flush=True)
        del r2t, rpi, lens
    pt.TUNING.clear()
    pt.TUNING.update(default)


def sweep_paged_decode(results, old_kernel, write_best=None, json_path=None):
    # max_splits is lifted so that programs_per_sm alone sets the split count; fractional values place the
    # grid against how many programs an SM holds at once (a partial second wave costs).
    grid = [dict(block_n=n, num_stages=s, num_warps=4, programs_per_sm=p, min_blocks_per_split=m, max_splits=512)
            for n in (64, 128) for s in (2, 3) for p in (2, 2.5, 3, 4, 6, 8) for m in (1, 2)]
    sweep = results["sweep"]
    for shape in SWEEP_SHAPES:
        for config in grid:
            sweep.append(dict(B=shape[0], ctx=shape[1], ps=shape[2], **config, us=decode_us(shape, config)))
        best = sorted((r for r in sweep if (r["B"], r["ctx"], r["ps"]) == shape), key=lambda r: r["us"])[:3]
        print("paged_decode sweep", shape, "best", best, flush=True)
    # Rank configurations by their geometric-mean slowdown against each shape's best.
    best_of = {shape: min(r["us"] for r in sweep if (r["B"], r["ctx"], r["ps"]) == shape) for shape in SWEEP_SHAPES}
    score = {}
    for r in sweep:
        key = tuple(r[k] for k in KNOBS)
        score.setdefault(key, []).append(math.log(r["us"] / best_of[(r["B"], r["ctx"], r["ps"])]))
    ranked = sorted(score, key=lambda key: sum(score[key]) / len(score[key]))
    results["ranked"] = [dict(zip(KNOBS, key), mean_slowdown=math.exp(sum(score[key]) / len(score[key])))
                         for key in ranked[:8]]
    print("ranked", results["ranked"][:4], flush=True)
    if write_best:  # now, so that a later stage can use it even if the comparison below runs out of time
        write_json(write_best, dict(zip(KNOBS, ranked[0])))
    write_json(json_path, dict(env=environment(), paged_decode=results))
    candidates = {}
    for i, key in enumerate(ranked[:3]):
        candidates[f"rank{i + 1}"] = dict(zip(KNOBS, key))
    old_tuning = {"block_n": 64, "programs_per_sm": 8, "max_splits": 64, "min_blocks_per_split": 4,
                  "split_below_rows_per_sm": 2, "num_warps": 4, "num_stages": 2}  # the split counts of before
    for shape in SMALL_SHAPES + LARGE_SHAPES:
        row = dict(B=shape[0], ctx=shape[1], ps=shape[2], kv_bytes=kv_bytes(shape[0], shape[1]))
        if old_kernel is not None:
            row["old_kernel_us"] = decode_us(shape, old_tuning, old=old_kernel)
        row["new_kernel_old_tuning_us"] = decode_us(shape, old_tuning)
        for name, config in candidates.items():
            row[f"{name}_us"] = decode_us(shape, config)
        results["compare"].append(row)
        print("compare", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        write_json(json_path, dict(env=environment(), paged_decode=results))
    results["candidates"] = candidates


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--only", choices=["page_table", "paged_decode"])
    parser.add_argument("--old-kernel", help="the paged_decode kernel file of an earlier commit, to compare")
    parser.add_argument("--write-best", help="write the best-ranked paged_decode configuration here (JSON), for "
                                             "the benchmarks' --tuning before it is committed into TUNING")
    args = parser.parse_args()
    require_cuda()
    results = {"page_table": [], "paged_decode": {"sweep": [], "compare": []}}
    if args.only in (None, "page_table"):
        sweep_page_table(results["page_table"])
        write_json(args.json, dict(env=environment(), page_table=results["page_table"]))
    if args.only in (None, "paged_decode"):
        old = load_old_kernel(args.old_kernel) if args.old_kernel else None
        sweep_paged_decode(results["paged_decode"], old, args.write_best, args.json)
    write_json(args.json, dict(env=environment(), **results))


if __name__ == "__main__":
    main()

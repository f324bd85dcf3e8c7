"""Sweep the kernels' launch configurations on a GPU (CUDA-graph replay time, so Python launch overhead is out).

    python benchmarks/tune.py [--json out.json]

Prints, per benchmark case, each configuration's median microseconds; the best ones go into the kernels'
TUNING dicts by hand (BENCHMARKS.md records the sweep).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

import compile_pass  # noqa: F401
from compile_pass.kernels import paged_decode as pd
from compile_pass.kernels import page_table as pt
from _common import environment, require_cuda, write_json
from paged_decode import case as decode_case
from page_table import inputs as table_inputs


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    require_cuda()
    results = {"page_table": [], "paged_decode": []}
    default = dict(pt.TUNING)
    for batch, ctx, ps in ((256, 131072, 1), (1, 32768, 1), (64, 32768, 16)):
        r2t, rpi, lens = table_inputs(batch, ctx)
        for block, per_sm, warps in itertools.product((1024, 2048, 4096), (4, 16, 64), (4, 8)):
            pt.TUNING.update(block=block, programs_per_sm=per_sm, num_warps=warps)
            t = graph_us(lambda: torch.ops.syncfree.page_table(r2t, rpi, lens, ps, ctx // ps))
            results["page_table"].append(dict(B=batch, ctx=ctx, ps=ps, block=block, per_sm=per_sm, warps=warps, us=t))
        best = min((r for r in results["page_table"] if r["B"] == batch and r["ps"] == ps and r["ctx"] == ctx),
                   key=lambda r: r["us"])
        print("page_table", batch, ctx, ps, "best", best, flush=True)
        del r2t, rpi, lens
    pt.TUNING.update(default)
    default = dict(pd.TUNING)
    for batch, ctx, ps in ((1, 32768, 1), (1, 32768, 16), (8, 32768, 16), (64, 32768, 16), (64, 4096, 1)):
        q, k, v, table, lens = decode_case(batch, ctx, ps)
        grid = itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (4, 8))
        for block_n, per_sm, stages, warps in grid:
            if batch >= 64 and per_sm > 2:
                continue
            pd.TUNING.update(block_n=block_n, programs_per_sm=per_sm, num_stages=stages, num_warps=warps,
                             max_splits=128)
            try:
                t = graph_us(lambda: torch.ops.syncfree.paged_decode(q, k, v, table, lens))
            except Exception as e:  # e.g. out of shared memory
                t = float("inf")
                print("config failed", block_n, per_sm, stages, warps, type(e).__name__)
            results["paged_decode"].append(dict(B=batch, ctx=ctx, ps=ps, block_n=block_n, per_sm=per_sm,
                                                stages=stages, warps=warps, us=t))
        best = sorted((r for r in results["paged_decode"] if (r["B"], r["ctx"], r["ps"]) == (batch, ctx, ps)),
                      key=lambda r: r["us"])[:3]
        print("paged_decode", batch, ctx, ps, "best", best, flush=True)
        del q, k, v, table, lens
        torch.cuda.empty_cache()
    pd.TUNING.update(default)
    write_json(args.json, dict(env=environment(), **results))


if __name__ == "__main__":
    main()

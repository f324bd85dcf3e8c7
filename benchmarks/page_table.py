"""Benchmark: syncfree.page_table against the torch gather it replaces (H200).

    python benchmarks/page_table.py [--json out.json]

Rows: B in {1, 8, 64, 256}, context 32K and 128K, page_size 1 and 16, full-length rows, int32 req_to_token.
Columns: the op (static width = context/page_size pages) as device time (CUDA-graph replay, what it costs
inside a captured decode step) and as eager latency (Python dispatch included), `req_to_token[rpi, :m:ps] // ps`
with m known on the host (CUDA-graph replay too), and the same with m = seq_lens.max().item() (eager: a host
sync cannot be graph-captured).
Bandwidth counts the bytes that must move: one read of req_to_token and one int32 write per live page.
Then the flat line: fixed lengths, growing static width.
"""

from __future__ import annotations

import argparse

import torch

import compile_pass  # noqa: F401
from _common import copy_bandwidth_tbs, environment, graph_us, median_us, require_cuda, write_json


def inputs(batch, ctx, lengths=None):
    reqs = batch + 1
    r2t = torch.randint(0, 1 << 30, (reqs, ctx), dtype=torch.int32, device="cuda")
    rpi = torch.randperm(reqs, device="cuda")[:batch]
    lens = torch.full((batch,), lengths or ctx, dtype=torch.int64, device="cuda")
    return r2t, rpi, lens


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    require_cuda()
    copy = copy_bandwidth_tbs()
    rows = []
    print(f"device copy: {copy:.2f} TB/s")
    print(f"{'B':>4} {'ctx':>7} {'ps':>3} | {'op us':>8} {'TB/s':>5} {'%copy':>5} {'eager us':>8} | {'gather us':>9} | "
          f"{'gather+item us':>14}")
    for batch in (1, 8, 64, 256):
        for ctx in (32768, 131072):
            for ps in (1, 16):
                r2t, rpi, lens = inputs(batch, ctx)
                pages = ctx // ps
                op = graph_us(lambda: torch.ops.syncfree.page_table(r2t, rpi, lens, ps, pages))
                op_eager = median_us(lambda: torch.ops.syncfree.page_table(r2t, rpi, lens, ps, pages))
                m = ctx
                gather = graph_us(lambda: r2t[rpi, :m:ps] // ps)
                gather_item = median_us(lambda: r2t[rpi, : lens.max().item() : ps] // ps)
                nbytes = batch * pages * (4 + 4)
                tbs = nbytes / (op * 1e-6) / 1e12
                ref = r2t[rpi, :m:ps] // ps
                got = torch.ops.syncfree.page_table(r2t, rpi, lens, ps, pages)
                assert torch.equal(got, ref.int()), "page_table differs from the torch gather"
                rows.append(dict(B=batch, ctx=ctx, page_size=ps, op_us=op, op_tbs=tbs, pct_copy=100 * tbs / copy,
                                 op_eager_us=op_eager, gather_us=gather, gather_item_us=gather_item))
                print(f"{batch:>4} {ctx:>7} {ps:>3} | {op:8.1f} {tbs:5.2f} {100 * tbs / copy:5.0f} {op_eager:8.1f} | "
                      f"{gather:9.1f} | {gather_item:14.1f}")
                del r2t, rpi, lens
    flat = []
    print("flat line: B=8, lengths 4096, page_size 1, growing static width")
    r2t, rpi, lens = inputs(8, 1 << 20, lengths=4096)
    for width_tokens in (4096, 16384, 65536, 262144, 1 << 20):
        t = graph_us(lambda: torch.ops.syncfree.page_table(r2t, rpi, lens, 1, width_tokens))
        flat.append(dict(max_pages=width_tokens, op_us=t))
        print(f"  max_pages {width_tokens:>8}: {t:7.1f} us")
    write_json(args.json, dict(env=environment(), copy_tbs=copy, rows=rows, flat=flat))


if __name__ == "__main__":
    main()

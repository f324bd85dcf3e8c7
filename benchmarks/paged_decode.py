"""Benchmark: syncfree.paged_decode against FA4 (when importable) and a torch gather + SDPA baseline (H200).

    python benchmarks/paged_decode.py [--json out.json] [--no-fa4]

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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--no-fa4", action="store_true", help="leave FA4 out even where it is importable")
    parser.add_argument("--tuning", help="paged_decode launch values (JSON) to use instead of the committed TUNING")
    args = parser.parse_args()
    apply_tuning(args.tuning)
    require_cuda()
    copy = copy_bandwidth_tbs()
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

"""Benchmark: syncfree.paged_decode against FA4 (when importable) and a torch gather + SDPA baseline (H200).

    python benchmarks/paged_decode.py [--json out.json]

bf16, Hq=32, Hkv=8, D=128, Sq=1, full-length rows; B in {1, 8, 64}, context 4K and 32K, page_size 1 and 16.
KV bandwidth counts the K and V bytes of the live keys, read once. Times are CUDA-graph replays (device time)
for paged_decode, the SDPA baseline and FA4 (eager latency where FA4's launch cannot be captured: the JSON's
fa4_timing says which); paged_decode's eager latency is given too.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import compile_pass  # noqa: F401
from _common import copy_bandwidth_tbs, environment, graph_us, median_us, require_cuda, write_json

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


def sdpa_baseline(q, k, v, table, lens, ctx):
    batch, ps = q.shape[0], k.shape[1]
    t = torch.arange(ctx, device="cuda")
    pages = table[:, t // ps].long()
    kk = k[pages, t % ps]  # [B, T, Hkv, D]
    vv = v[pages, t % ps]
    return F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                          enable_gqa=True).transpose(1, 2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    require_cuda()
    copy = copy_bandwidth_tbs()
    fa = fa4()
    print(f"device copy: {copy:.2f} TB/s; FA4: {'yes' if fa else 'not importable'}")
    print(f"{'B':>3} {'ctx':>6} {'ps':>3} | {'ours us':>8} {'TB/s':>5} {'eager':>7} | {'FA4 us':>8} {'TB/s':>5} | "
          f"{'SDPA us':>8} | err")
    rows = []
    for batch in (1, 8, 64):
        for ctx in (4096, 32768):
            for ps in (1, 16):
                q, k, v, table, lens = case(batch, ctx, ps)
                nbytes = 2 * batch * ctx * HKV * D * 2
                ours = graph_us(lambda: torch.ops.syncfree.paged_decode(q, k, v, table, lens))
                ours_eager = median_us(lambda: torch.ops.syncfree.paged_decode(q, k, v, table, lens))
                out = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
                row = dict(B=batch, ctx=ctx, page_size=ps, ours_us=ours, ours_tbs=nbytes / ours / 1e6,
                           ours_eager_us=ours_eager)
                if fa is not None:
                    call = lambda: fa(q, k, v, seqused_k=lens, page_table=table, causal=True)  # noqa: E731
                    try:  # device time when FA4's launch can be graph-captured, else eager latency
                        row["fa4_us"] = graph_us(call)
                        row["fa4_timing"] = "cuda graph"
                    except Exception as e:
                        torch.cuda.synchronize()
                        row["fa4_us"] = median_us(call)
                        row["fa4_timing"] = f"eager ({type(e).__name__})"
                    row["fa4_tbs"] = nbytes / row["fa4_us"] / 1e6
                    ref = call()
                    ref = ref[0] if isinstance(ref, tuple) else ref
                else:
                    ref = sdpa_baseline(q, k, v, table, lens, ctx) if batch * ctx <= 8 * 32768 else None
                if batch * ctx <= 8 * 32768:
                    row["sdpa_us"] = graph_us(lambda: sdpa_baseline(q, k, v, table, lens, ctx), rep=50)
                if ref is not None:
                    row["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
                rows.append(row)
                print(f"{batch:>3} {ctx:>6} {ps:>3} | {ours:8.1f} {row['ours_tbs']:5.2f} {ours_eager:7.1f} | "
                      f"{row.get('fa4_us', float('nan')):8.1f} {row.get('fa4_tbs', float('nan')):5.2f} | "
                      f"{row.get('sdpa_us', float('nan')):8.1f} | {row.get('max_abs_err', float('nan')):.1e}")
                del q, k, v, table, lens, out
                torch.cuda.empty_cache()
    write_json(args.json, dict(env=environment(), copy_tbs=copy, fa4=fa is not None, rows=rows))


if __name__ == "__main__":
    main()

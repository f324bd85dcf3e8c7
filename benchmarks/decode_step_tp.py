"""Benchmark: the decode step under tensor parallelism, one process per GPU (torchrun).

    cd benchmarks && NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 decode_step_tp.py [--batches 1 8 64]
        [--contexts 4096 32768] [--json out.json]
    (--nproc-per-node 1 gives the TP=1 baseline with the same model)

The reference decoder at engine sizes (2 layers, hidden 4096, Hq 32, Hkv 8, D 128, SwiGLU 8192, bf16, page 16),
sharded Megatron-style (compile_pass.examples.TinyLlama with tp_size = world size), attention through
`paged_decode`, all-reduces as functional collectives inside the graph. Per rank, median step time (CUDA events,
200 steps after warm-up), host syncs per step and CUDA-graph partitions, for
  (b) stock torch.compile (graph break at .item())  (d) backend="syncfree"  (e) syncfree + CUDA graphs
  (f) hand-written: static page table on the device, stock compile, one CUDA graph captured by hand
and, measured apart, one all-reduce of the step's activation ([B, 1, hidden] bf16) and the 4 a step makes.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

import compile_pass
from _common import environment, write_json
from compile_pass._compat import CudagraphSkips, mark_static_address
from compile_pass.examples import TinyLlama, TinyLlamaConfig, make_batch
from compile_pass.examples.tp_decode import shutdown
from decode_step import step_times, syncs_per_step

MAX_CTX = 32768


def capture_by_hand(fn):
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--json")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    try:
        for batch in args.batches:
            config = TinyLlamaConfig(vocab=32000, hidden=4096, layers=2, heads=32, kv_heads=8, head_dim=128,
                                     intermediate=8192, page_size=16, max_context_len=MAX_CTX,
                                     num_pages=batch * MAX_CTX // 16, max_requests=batch, dtype=torch.bfloat16)
            model = TinyLlama(config, device="cuda", tp_rank=rank, tp_size=world)
            k_pool, v_pool = model.new_kv_pool("cuda")
            k_pool.normal_()
            v_pool.normal_()
            mark_static_address(k_pool)
            mark_static_address(v_pool)
            page_buffer = torch.zeros(batch, MAX_CTX // 16, dtype=torch.int32, device="cuda")
            torch._dynamo.reset()
            variants = {
                "b": torch.compile(lambda fb: model(fb, k_pool, v_pool)),
                "d": compile_pass.compile(lambda fb: model(fb, k_pool, v_pool), max_context_len=MAX_CTX,
                                          fullgraph=True),
                "e": compile_pass.compile(lambda fb: model(fb, k_pool, v_pool), max_context_len=MAX_CTX,
                                          cudagraphs=True, fullgraph=True),
            }
            hand = torch.compile(lambda fb: model(fb, k_pool, v_pool, page_buffer=page_buffer), fullgraph=True)
            for ctx in args.contexts:
                fb = make_batch(config, [ctx] * batch, device="cuda")
                mark_static_address(fb.req_to_token)
                row = dict(B=batch, ctx=ctx, tp=world, rank=rank)
                ref = model(fb, k_pool, v_pool).float()
                for name, fn in variants.items():
                    call = (lambda f=fn: f(fb))
                    with CudagraphSkips() as log:
                        out = call()
                    # Start every timing together: a rank that starts late makes the others wait in the
                    # step's all-reduces, and that wait is not the step's cost.
                    torch.cuda.synchronize()
                    dist.barrier()
                    row[f"{name}_max_abs_err"] = (out.float() - ref).abs().max().item()
                    row[f"{name}_us"] = step_times(call)
                    row[f"{name}_syncs"] = syncs_per_step(call)
                    if name == "e":
                        row["e_partitions"] = (log.partitions() or ["no partition log"])[-1]
                graph, static_out = capture_by_hand(lambda: hand(fb))
                torch.cuda.synchronize()
                dist.barrier()
                row["f_us"] = step_times(graph.replay)
                row["f_syncs"] = syncs_per_step(graph.replay)
                graph.replay()
                row["f_max_abs_err"] = (static_out.float() - ref).abs().max().item()
                act = torch.randn(batch, 1, config.hidden, device="cuda", dtype=torch.bfloat16)
                one = (lambda: funcol.all_reduce(act, "sum", dist.group.WORLD).wait()) if world > 1 else (lambda: act)
                row["all_reduce_us"] = step_times(one)
                ar_graph, _ = capture_by_hand(one) if world > 1 else (None, None)
                row["all_reduce_graph_us"] = step_times(ar_graph.replay) if ar_graph is not None else 0.0
                row["all_reduces_per_step"] = 2 * config.layers if world > 1 else 0
                gathered = [None] * world
                dist.all_gather_object(gathered, row)
                rows.extend(gathered)
                if rank == 0:
                    slowest = {v: max(r[f"{v}_us"] for r in gathered) for v in "bdef"}
                    print(f"TP={world} B={batch:>3} ctx={ctx:>6} | " + " | ".join(
                        f"({v}) {slowest[v]:8.1f}us {row[v + '_syncs']:.1f}s" for v in "bdef")
                        + f" | all_reduce {row['all_reduce_graph_us']:.1f}us x{row['all_reduces_per_step']}"
                        + f" | (e) {row['e_partitions']}", flush=True)
                write_json(args.json if rank == 0 else None, dict(env=environment(), rows=rows))
                # A CUDA graph that captured NCCL work must be destroyed before the process group, or
                # destroy_process_group() hangs (pytorch/pytorch#115388).
                graph.reset()
                if ar_graph is not None:
                    ar_graph.reset()
                del graph, static_out, ar_graph
            del model, k_pool, v_pool, variants, hand
            torch.cuda.empty_cache()
    finally:
        shutdown("cuda")
    if rank == 0:
        write_json(args.json, dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()

"""Tensor-parallel decode through the syncfree backend, one process per rank:

    torchrun --nproc-per-node 2 -m compile_pass.examples.tp_decode --device cuda --cudagraphs
    torchrun --nproc-per-node 2 -m compile_pass.examples.tp_decode --device cpu --check     # gloo, on a laptop

Each rank holds its shard of the reference decoder (compile_pass.examples.TinyLlama with tp_size = world size)
and its own KV pool; the all-reduces are functional collectives, traced into the compiled graph, so each rank's
step is one graph (one CUDA graph with --cudagraphs) with its collectives inside. Every rank compiles the same
step with the same options (checked first: ranks that disagree stop with an error naming the options), runs a
decode loop with growing lengths and reports. With --check every rank also runs the world-size-1 model and
compares. The process group is torn down cleanly at the end, also after an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import compile_pass
from compile_pass._compat import CudagraphSkips, mark_static_address, run_and_get_code
from compile_pass.examples.tiny_llama import TinyLlama, TinyLlamaConfig, make_batch
from compile_pass.testing import host_reads_in_code, replay_without_sync


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tp_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=4, help="decode steps (every request grows by one token a step)")
    p.add_argument("--lengths", type=int, nargs="+", default=[5, 17, 9], help="each request's starting length")
    p.add_argument("--cudagraphs", action="store_true", help="compile with CUDA graphs (one per rank)")
    p.add_argument("--check", action="store_true", help="compare every step with the world-size-1 model")
    p.add_argument("--json", help="write this rank's result to PATH (a {rank} in PATH is replaced)")
    p.add_argument("--config", default="tiny", choices=["tiny", "engine"],
                   help="tiny: the test model; engine: hidden 4096, Hq 32, Hkv 8, D 128 (2 layers)")
    return p


def config_for(name: str, device: str) -> TinyLlamaConfig:
    if name == "tiny":
        return TinyLlamaConfig()
    return TinyLlamaConfig(vocab=32000, hidden=4096, layers=2, heads=32, kv_heads=8, head_dim=128, intermediate=8192,
                           page_size=16, max_context_len=4096, num_pages=8 * 4096 // 16, max_requests=8,
                           dtype=torch.bfloat16 if device == "cuda" else torch.float32)


def check_options_agree(options: dict) -> None:
    """Every rank must compile with the same options, or their graphs (and collectives) would differ."""
    mine = json.dumps(options, sort_keys=True, default=repr)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if len(set(everyone)) > 1:
        first = json.loads(everyone[0])
        diffs = sorted({k for text in everyone for k, v in json.loads(text).items() if first.get(k) != v})
        raise ValueError(f"ranks disagree on the syncfree options {diffs}: "
                         + "; ".join(f"rank {r}: {text}" for r, text in enumerate(everyone)))


def shutdown(device: str) -> None:
    """Tear down without hanging. A CUDA graph that captured NCCL work must be destroyed before the process group,
    or destroy_process_group() hangs (pytorch/pytorch#115388): finish the device's work, drop Inductor's CUDA-graph
    trees and the compiled code that holds them, collect, then barrier and destroy."""
    if not dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.synchronize()
        import torch._inductor.cudagraph_trees as cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    torch._dynamo.reset()
    import gc

    gc.collect()
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    config = config_for(args.config, device)
    options = {"max_context_len": config.max_context_len, "cudagraphs": args.cudagraphs}
    check_options_agree(options)
    model = TinyLlama(config, device=device, tp_rank=rank, tp_size=world)
    k_pool, v_pool = model.new_kv_pool(device)
    if device == "cuda":
        mark_static_address(k_pool)
        mark_static_address(v_pool)
    step = compile_pass.compile(lambda fb: model(fb, k_pool, v_pool), fullgraph=True, **options)
    reference = TinyLlama(config, device=device) if args.check else None
    ref_pools = reference.new_kv_pool(device) if reference is not None else None
    result = {"rank": rank, "world_size": world, "device": device, "steps": args.steps, "max_abs_err": 0.0}
    codes: list[str] = []
    start = time.perf_counter()
    log = CudagraphSkips()
    log.__enter__()
    for s in range(args.steps):
        fb = make_batch(config, [n + s for n in args.lengths], device=device)
        if s == 0:
            out, codes = run_and_get_code(step, fb)
        else:
            out = step(fb)
        if reference is not None:
            want = reference(fb, *ref_pools)
            result["max_abs_err"] = max(result["max_abs_err"], (out.float() - want.float()).abs().max().item())
    log.__exit__(None, None, None)
    if device == "cuda":
        torch.cuda.synchronize()
        result["sync_free_replays"] = replay_without_sync(step, fb)[2] is None
    result["seconds"] = time.perf_counter() - start
    result["partitions"] = log.partitions()
    report = compile_pass.SyncReport.merge(compile_pass.reports(step))
    result["report"] = report.to_dict()
    result["host_reads_in_code"] = host_reads_in_code(codes)
    result["collectives_in_code"] = sum(c.count("all_reduce") for c in codes)
    # Every rank must have rewritten the same way.
    reports = [None] * world
    dist.all_gather_object(reports, json.dumps({"rewritten": result["report"]["rewritten"],
                                                "kept": result["report"]["kept"]}, sort_keys=True))
    result["reports_identical"] = len(set(reports)) == 1
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("tp_decode: run it under torchrun, e.g. torchrun --nproc-per-node 2 -m compile_pass.examples.tp_decode",
              file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        result = run(args)
    finally:
        shutdown(args.device)
    if args.json:
        with open(args.json.replace("{rank}", str(result["rank"])), "w") as f:
            json.dump(result, f, indent=2, default=str)
    ok = result["reports_identical"] and result["host_reads_in_code"] == 0 and result.get("sync_free_replays", True)
    print(f"[rank {result['rank']}/{result['world_size']}] {args.steps} steps in {result['seconds']:.2f}s, "
          f"rewritten {len(result['report']['rewritten'])}, kept {len(result['report']['kept'])}, "
          f"host reads in code {result['host_reads_in_code']}, all_reduce in code {result['collectives_in_code']}, "
          f"reports identical across ranks: {result['reports_identical']}"
          + (f", max abs err vs world size 1: {result['max_abs_err']:.2e}" if args.check else "")
          + (f", replays without a sync: {result['sync_free_replays']}, {result['partitions'][-1:]}"
             if "sync_free_replays" in result else ""), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

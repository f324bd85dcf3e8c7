"""SGLang 0.5.23's own FA3 decode path, compiled through the syncfree backend, on a GPU (issue 19).

What runs: tests/sglang/harness.py's Engine on CUDA: SGLang's FlashAttentionBackend (unmodified, from the
wheel) over SGLang's ReqToTokenPool / MHATokenToKVPool, `step = init_forward_metadata(fb)` + 2 layers of
`forward_decode` (KV write included), with SGLang's defaults (the seq_lens_cpu mirror published, scheduler
metadata precomputed). The native kernels are the stand-ins of tests/sglang/standins/sgl_kernel; on CUDA their
ops run standins/sgl_kernel/cuda_ops.py: `sgl_kernel::fwd` computes the paged decode with
`torch.ops.syncfree.paged_decode` (this project's Triton kernel) and `get_scheduler_metadata` computes its
metadata on the device; neither reads the host (their value-dependent contract checks are device-side asserts).

The step is compiled with `compile_pass.compile(step, max_context_len=256, cudagraphs=True, static_escapes=True)`
and shown sync-free:
  1. outputs equal the same step run eagerly, over several length vectors of one batch size and of a second one;
  2. replays pass under torch.cuda.set_sync_debug_mode("error") (compile_pass.testing.replay_without_sync);
  3. one CUDA-graph partition per compiled graph (Inductor's "Created 1 graph partition" lines, no
     "skipping cudagraphs", counters["inductor"]["cudagraph_skips"] == 0);
  4. compile_pass.reports(step) says rewritten (nothing kept);
  5. no _local_scalar_dense / _assert_scalar / unbacked symbol in the post-grad graph and no .item() in
     Inductor's code; and, all at once on a fresh compile, compile_pass.testing.assert_sync_free.

  python benchmarks/sglang_fa3_gpu.py [--device cuda|cpu] [--json PATH]

Needs sglang 0.5.23 and its small dependencies importable (benchmarks/run_h200.sh's `sglang-fa3` stage installs
them from .whl-sglang/) and tests/sglang on sys.path (added here). `--device cpu` is a dry run of the same path
on the CPU: the stand-in ops take cuda_ops.py's implementations there too (SGL_KERNEL_STANDIN_CPU=paged_decode),
and the CUDA-only proofs (2, 3) are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SGL_TESTS = ROOT / "tests" / "sglang"


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--batches", default="3,5", help="two batch sizes (at most harness.MAX_REQUESTS = 6)")
    p.add_argument("--vectors", type=int, default=3, help="length vectors per batch size")
    p.add_argument("--replays", type=int, default=3)
    p.add_argument("--skip-assert-sync-free", action="store_true")
    p.add_argument("--static-shapes", action="store_true",
                   help="one static graph per batch size (torch._dynamo.config.automatic_dynamic_shapes=False); "
                        "default: Dynamo's automatic dynamic shapes (the second batch size compiles a dynamic graph)")
    return p.parse_args()


def length_vectors(H, batches, count, seed=0):
    import random

    rng = random.Random(seed)
    out = []
    for b in batches:
        for n in range(count):
            v = [rng.randint(1, H.MAX_CONTEXT) for _ in range(b)]
            if n == 0:
                v[0] = H.MAX_CONTEXT  # a row at the bound
            out.append(v)
    return out


def main():
    args = parse()
    cuda = args.device == "cuda"
    if not cuda:
        os.environ["SGL_KERNEL_STANDIN_CPU"] = "paged_decode"  # the CUDA implementations, on the CPU
    if str(SGL_TESTS) not in sys.path:
        sys.path.insert(0, str(SGL_TESTS))
    import torch

    if cuda and not torch.cuda.is_available():
        sys.exit("sglang_fa3_gpu: no CUDA device (use --device cpu for the dry run)")
    import compile_pass
    from compile_pass import _compat
    from compile_pass.testing import SyncCheckFailed, assert_sync_free, host_reads_in_code, replay_without_sync
    from torch._dynamo.utils import counters

    import harness as H

    t0 = time.time()
    if args.static_shapes:
        torch._dynamo.config.automatic_dynamic_shapes = False
    H.setup(args.device)
    import importlib.metadata as md
    import sgl_kernel

    if not hasattr(sgl_kernel, "flash_ops") or "stand-in" not in sgl_kernel.__version__:
        sys.exit(f"sgl_kernel is {sgl_kernel.__file__}, not the stand-in")
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "python": sys.version.split()[0], "sglang": md.version("sglang"),
            "transformers": md.version("transformers"), "pydantic": md.version("pydantic"),
            "compile_pass": getattr(compile_pass, "__file__", "?"),
            "commit": os.environ.get("SYNCFREE_COMMIT", "unknown")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    path = H.Path("fa3_decode_static_escapes", "decode")  # SGLang's defaults: mirror published, precompute on
    engine = H.Engine(path, seed=0, device=args.device)
    # The KV pool is written in place every step: mark it static, as engines do (README "Use"), so that a CUDA
    # graph may mutate it (else Inductor skips CUDA graphs for "mutated inputs").
    pool = engine.runner.token_to_kv_pool
    for buffer in list(getattr(pool, "k_buffer", [])) + list(getattr(pool, "v_buffer", [])):
        _compat.mark_static_address(buffer)
    batches = [int(b) for b in args.batches.split(",")]
    vectors = length_vectors(H, batches, args.vectors)
    options = dict(max_context_len=H.MAX_CONTEXT, cudagraphs=True, static_escapes=True)
    problems: list[str] = []
    results = {"info": info, "options": {**options, "fullgraph": True, "fx_graph_cache": False,
                                         "static_shapes": args.static_shapes},
               "page_size": path.page_size, "layers": H.LAYERS, "vectors": []}

    # -- eager: does SGLang's own step read the host here? (information, not a criterion)
    if cuda:
        fb, hidden = engine.make_batch(vectors[0], seed=0)
        _, done, failure = replay_without_sync(engine.step, fb, hidden, replays=1)
        results["eager_step_syncs"] = failure
    # -- the compiled step, over the length vectors
    counters.clear()
    step = compile_pass.compile(engine.step, fullgraph=True, fx_graph_cache=False, **options)
    codes: list[str] = []
    with _compat.CudagraphSkips() as skips:
        for n, lengths in enumerate(vectors):
            fb, hidden = engine.make_batch(lengths, seed=n)
            want = engine.step(fb, hidden)
            fb, hidden = engine.make_batch(lengths, seed=n)
            got, new = _compat.run_and_get_code(step, fb, hidden)  # compiles on a new batch size
            codes += new
            row = {"batch": len(lengths), "lengths": lengths, "compiled_here": bool(new)}
            if cuda:
                for _ in range(2):  # CUDA-graph warm-up and recording may synchronise; replays may not
                    got = step(fb, hidden)
                replayed, done, failure = replay_without_sync(step, fb, hidden, replays=args.replays)
                row.update(replays=done, replay_failure=failure)
                if failure:
                    problems.append(f"{lengths}: {failure}")
                    print(f"B={len(lengths)} lengths={lengths}: replay {done + 1} under sync debug 'error': {failure}")
                got = replayed if replayed is not None else got
            err = float((got.float() - want.float()).abs().max())
            ok = torch.allclose(got.float(), want.float(), atol=1e-4, rtol=1e-4)
            row.update(max_abs_err=err, equal=ok)
            if not ok:
                problems.append(f"{lengths}: compiled differs from eager by {err:.3g}")
            results["vectors"].append(row)
            print(f"B={len(lengths)} lengths={lengths}: max|compiled-eager|={err:.2e}"
                  + (f", {row['replays']} replays under sync debug 'error'"
                     + (f" FAILED: {row['replay_failure']}" if row["replay_failure"] else " ok") if cuda else ""))
        partitions = skips.partitions()
        log = list(skips.messages)
    reports = list(compile_pass.reports(step))
    merged = compile_pass.SyncReport.merge(reports)
    status, reasons = H.classify(reports)
    graphs = counters["stats"]["unique_graphs"]
    cg_skips = counters["inductor"]["cudagraph_skips"]
    reads = host_reads_in_code(codes)
    pg = merged.post_grad
    results.update(status=status, reasons=reasons, graphs_compiled=graphs, report=merged.to_dict(),
                   report_text=[str(r) for r in reports], host_reads_in_code=reads, inductor_codes=len(codes),
                   partitions=partitions, cudagraph_skips=cg_skips,
                   cudagraph_log=[m for m in log if "skipping" in m or "partition" in m][:20])
    if status != "rewritten" or merged.syncs_remaining:
        problems.append(f"report: {status} {reasons}")
    if pg is None:
        problems.append("no post-grad check ran")
    elif pg["local_scalar_dense"] or pg["assert_scalar"] or pg["unbacked_symbols"]:
        problems.append(f"post-grad graph reads the host: {pg}")
    if not codes:
        problems.append("no Inductor code was captured (compiled from a cache?)")
    if reads:
        problems.append(f"Inductor's code holds {reads} host read(s)")
    if cuda:
        one = partitions and all(p.startswith("Created 1 graph partition") and "1 cudagraphable" in p
                                 and "0 non-cudagraphable" in p for p in partitions)
        if not one or cg_skips or any("skipping cudagraphs" in m for m in log):
            problems.append(f"not one CUDA-graph partition per graph: {partitions} skips={cg_skips} "
                            f"{[m for m in log if 'skipping' in m][:3]}")
    # -- the public helper, all proofs at once, on a fresh compile of the first vector
    if not args.skip_assert_sync_free:
        torch._dynamo.reset()
        fb, hidden = engine.make_batch(vectors[0], seed=0)
        try:
            check = assert_sync_free(engine.step, fb, hidden, replays=args.replays, fx_graph_cache=False, **options)
            results["assert_sync_free"] = {"ok": True, **check.to_dict()}
        except SyncCheckFailed as e:
            results["assert_sync_free"] = {"ok": False, "error": str(e)[:4000]}
            problems.append("assert_sync_free: " + str(e).splitlines()[1 if len(str(e).splitlines()) > 1 else 0])
    results["problems"] = problems
    results["passed"] = not problems
    results["seconds"] = round(time.time() - t0, 1)

    rewritten = [f"{i.kind} at {i.location}: {i.reason}" for i in merged.rewritten]
    print(f"\nSGLang {info['sglang']} FA3 decode (FlashAttentionBackend, {H.LAYERS} layers, page size "
          f"{path.page_size}, mirror + scheduler precompute, static_escapes) on {info['device']}, torch "
          f"{info['torch']}:")
    print(f"  equal to eager: {sum(r['equal'] for r in results['vectors'])}/{len(results['vectors'])} vectors "
          f"(batch sizes {batches}), max err {max(r['max_abs_err'] for r in results['vectors']):.2e}")
    if cuda:
        print(f"  replays under sync debug 'error': "
              f"{sum(1 for r in results['vectors'] if not r['replay_failure'])}/{len(results['vectors'])} vectors ok")
        print(f"  CUDA-graph partitions: {partitions} (cudagraph_skips={cg_skips})")
    else:
        print("  (CPU dry run: sync debug mode and CUDA-graph partitions not checked)")
    print(f"  report: {status}, graphs compiled {graphs}, syncs remaining {merged.syncs_remaining}")
    for line in rewritten:
        print(f"    rewritten {line}")
    print(f"  post-grad: {pg}; host reads in Inductor code: {reads} (in {len(codes)} code modules)")
    if "assert_sync_free" in results:
        a = results["assert_sync_free"]
        print(f"  assert_sync_free: {'ok' if a['ok'] else 'FAILED'}"
              + (f", replays checked {a.get('replays_checked')}" if a["ok"] else ""))
    print(("PASSED" if not problems else "FAILED:\n  - " + "\n  - ".join(problems)) + f" ({results['seconds']} s)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())

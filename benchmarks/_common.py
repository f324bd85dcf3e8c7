"""Shared helpers for the GPU benchmarks: medians from triton.testing.do_bench, a device-copy ceiling."""

from __future__ import annotations

import functools
import json
import platform
import sys
import time

import torch


def require_cuda():
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")


def median_us(fn, warmup=25, rep=100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def graph_us(fn, rep=100) -> float:
    """Median microseconds of CUDA-graph replays: device time, with no Python launch overhead."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 60 << 20)


def rotating_graph_us(make_call, nbytes: int, rep=100) -> float:
    """Median device time of one call whose inputs are cold in L2, as in a decode step where the model's
    weights pass through L2 between two attention calls: the calls cycle through enough copies of their
    inputs (make_call(i) -> a zero-argument callable on copy i) to exceed three times the L2 cache, all in
    one CUDA graph; returns the time per call."""
    copies = max(1, min(16, -(-3 * l2_bytes() // max(1, nbytes))))
    calls = [make_call(i) for i in range(copies)]
    return graph_us(lambda: [c() for c in calls], rep=rep) / copies


def copy_bandwidth_tbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randint(0, 100, (nbytes // 4,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    t = median_us(lambda: dst.copy_(src))
    return 2 * nbytes / (t * 1e-6) / 1e12


@functools.cache  # written into every JSON a benchmark saves (after each row): ask git once
def _commit() -> str:
    """The commit measured: $SYNCFREE_COMMIT (set by run_h200.sh, where no .git travels) or git's HEAD."""
    import os
    import subprocess

    if os.environ.get("SYNCFREE_COMMIT"):
        return os.environ["SYNCFREE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _tuning() -> dict:
    from compile_pass.kernels import paged_decode

    return dict(paged_decode.TUNING)


def environment() -> dict:
    import triton

    return {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "commit": _commit(),
        "paged_decode_tuning": _tuning(),
    }


def apply_tuning(path) -> dict:
    """Launch values for paged_decode from a JSON file (tune.py --write-best), for a run made before they are
    committed into the kernel's TUNING; returns the TUNING in force, which the results record."""
    from compile_pass.kernels import paged_decode

    if path:
        with open(path) as f:
            paged_decode.TUNING.update(json.load(f))
    return dict(paged_decode.TUNING)


def write_json(path, data) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)


"""Shared helpers for the GPU benchmarks: medians from triton.testing.do_bench, a device-copy ceiling."""

from __future__ import annotations

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


def copy_bandwidth_tbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randint(0, 100, (nbytes // 4,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    t = median_us(lambda: dst.copy_(src))
    return 2 * nbytes / (t * 1e-6) / 1e12


def environment() -> dict:
    import triton

    return {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
    }


def write_json(path, data) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)


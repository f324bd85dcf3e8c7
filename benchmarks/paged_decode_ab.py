"""A/B of paged_decode's split kernel: the committed kernel against kernel files of the same role (an earlier
commit's, `git show C:kernels/paged_decode_kernel.py > F`), each launched by today's launcher, at the decode
loop's attention shapes (bf16, Hq=32, Hkv=8, D=128, Sq=1, full-length rows; B=1 at 4K and 32K, B=4 at 32K, page
sizes 16 and 1). Cold-L2 CUDA-graph medians (rotating input copies), the same inputs for every kernel, and each
kernel's output against the committed one's.

    python benchmarks/paged_decode_ab.py [--kernel NAME=FILE ...] [--json out.json]

A kernel file without the `num_pages` argument (before 42eb061) is called without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect

import torch

import compile_pass  # noqa: F401
from compile_pass.kernels import paged_decode as pd
from compile_pass.kernels import paged_decode_kernel as committed
from _common import environment, require_cuda, rotating_graph_us, write_json
from paged_decode import case, kv_bytes

SHAPES = [(1, 4096, 16), (1, 32768, 16), (1, 32768, 1), (4, 32768, 16)]


def load(path):
    spec = importlib.util.spec_from_file_location(f"ab_kernel_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _DropNumPages:
    """An earlier split kernel (no `num_pages` parameter) under today's launcher, which passes it last."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args[:-1], **kwargs)


def split_kernel_of(module):
    kernel = module.paged_decode_split_kernel
    names = inspect.signature(kernel.fn).parameters
    return kernel if "num_pages" in names else _DropNumPages(kernel)


def time_kernel(kernel, shape):
    """(cold-L2 us per call, output of copy 0) of paged_decode at `shape` with `kernel` as the split kernel."""
    batch, ctx, ps = shape
    saved = committed.paged_decode_split_kernel
    committed.paged_decode_split_kernel = kernel  # the launcher imports it from the module at each call
    try:
        cases = {}

        def make(i):
            cases[i] = case(batch, ctx, ps) if i not in cases else cases[i]
            q, k, v, table, lens = cases[i]
            return lambda: torch.ops.syncfree.paged_decode(q, k, v, table, lens)

        torch.manual_seed(0)
        us = rotating_graph_us(make, kv_bytes(batch, ctx))
        q, k, v, table, lens = cases[0]
        out = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
        torch.cuda.synchronize()
        return us, out
    finally:
        committed.paged_decode_split_kernel = saved


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", nargs="*", default=[], metavar="NAME=FILE")
    parser.add_argument("--json")
    args = parser.parse_args()
    require_cuda()
    kernels = {"committed": committed.paged_decode_split_kernel}
    for spec in args.kernel:
        name, _, path = spec.partition("=")
        kernels[name] = split_kernel_of(load(path))
    rows = []
    for shape in SHAPES:
        row = {"B": shape[0], "ctx": shape[1], "page_size": shape[2]}
        base = None
        for name, kernel in kernels.items():
            us, out = time_kernel(kernel, shape)
            row[f"{name}_us"] = us
            if base is None:
                base = out
            else:
                row[f"{name}_max_abs_diff"] = float((out.float() - base.float()).abs().max())
        rows.append(row)
        print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        write_json(args.json, {"env": environment(), "rows": rows, "tuning": dict(pd.TUNING)})


if __name__ == "__main__":
    main()

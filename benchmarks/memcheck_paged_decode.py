"""paged_decode (both launch paths), ragged_extend_attention and kv_indices on inputs that would read out of bounds
if a kernel used what the contract says it never reads, for compute-sanitizer's memcheck (H200).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python benchmarks/memcheck_paged_decode.py

Without the caching allocator every tensor is its own allocation, so a read past one is an error memcheck sees.
The page tables hold page ids far outside the KV pool (-10**6, 10**9) in every column past a row's live pages, the
way a static-width table's tail holds anything; lengths are 0, a partial page, the full width, past the width
(clamped by the kernel), negative; tables are contiguous or column slices; Sq 1 and 4; page sizes 1 and 16; both
paths of paged_decode (the split kernel with one and several splits, the short-context kernel) forced through
their tuning dicts. Each result is compared with the vectorized torch implementation of the same semantics on the
host copies of the live data; the script exits 1 on a difference. `--device cpu` under TRITON_INTERPRET=1 runs the
same cases on the CPU (in float32 only: the interpreter's bfloat16 is not the GPU's).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.nn.functional as F

import compile_pass  # noqa: F401  (registers the ops)
from compile_pass.kernels import paged_decode as pd

HQ, HKV, D = 8, 2, 64
POISON = (-10**6, 10**9)


@contextlib.contextmanager
def path(name, sms):
    """Force paged_decode's launch path and the SM count its split rule sees."""
    saved, saved_sm = dict(pd.SHORT_TUNING), pd.sm_count
    pd.SHORT_TUNING["path"] = name
    pd.sm_count = lambda t: sms
    try:
        yield
    finally:
        pd.SHORT_TUNING.clear()
        pd.SHORT_TUNING.update(saved)
        pd.sm_count = saved_sm


def poisoned_table(gen, batch, width, ps, lens, pages):
    """Live columns hold distinct real pages; every other column a page id far outside the pool."""
    table = torch.empty(batch, width, dtype=torch.int32)
    ids = torch.randperm(pages, generator=gen)
    for b in range(batch):
        live = min(max(-(-int(lens[b]) // ps), 0), width)
        table[b] = POISON[b % 2]
        table[b, :live] = ids[b * width : b * width + live].to(torch.int32)
    return table


def reference(q, k, v, table, lens, ps):
    """The torch implementation of paged_decode's semantics, on the host (it reads only live columns)."""
    width = table.shape[1]
    clamped = lens.clamp(0, width * ps)
    safe = table.clone()
    cols = torch.arange(width)[None, :]
    safe[cols >= -(-clamped[:, None] // ps)] = 0  # never read by the semantics; a real page for the host copy
    return pd._attend_torch(q.cpu(), k.cpu(), v.cpu(), safe, clamped, 1.0 / D ** 0.5)


def paged_cases(device, dtype):
    gen = torch.Generator().manual_seed(0)
    out = []
    for ps in (1, 16):
        for sq in (1, 4):
            width = 256 // ps
            pages = 6 * width + 4
            lens = torch.tensor([0, 5, width * ps, width * ps + 37, -3, ps + 1])
            lens[1] = max(lens[1], sq)
            table = poisoned_table(gen, 6, width, ps, lens, pages)
            q = torch.randn(6, sq, HQ, D, generator=gen).to(dtype)
            k = torch.randn(pages, ps, HKV, D, generator=gen).to(dtype)
            v = torch.randn(pages, ps, HKV, D, generator=gen).to(dtype)
            wide = torch.full((6, width + 3), POISON[1], dtype=torch.int32)
            wide[:, 1 : 1 + width] = table
            for name, t, cut in (("contiguous", table, None), ("column_slice", wide, slice(1, 1 + width))):
                out.append((f"ps{ps} sq{sq} {name}", q, k, v, t, cut, lens, ps))
    return out


def check_paged_decode(device, dtype, tol) -> list[str]:
    bad = []
    for name, q, k, v, table, cut, lens, ps in paged_cases(device, dtype):
        dt = table.to(device) if cut is None else table.to(device)[:, cut]  # a column slice on the device too
        want = reference(q, k, v, table if cut is None else table[:, cut].contiguous(), lens, ps).float()
        args = (q.to(device), k.to(device), v.to(device), dt, lens.to(torch.int32).to(device))
        for label, forced, sms in (("split, 1 split", "split", 0), ("split, many", "split", 132),
                                   ("short", "short", 132)):
            with path(forced, sms):
                got = torch.ops.syncfree.paged_decode(*args).float().cpu()
            err = float((got - want).abs().max()) if got.numel() else 0.0
            if not torch.isfinite(got).all() or err > tol:
                bad.append(f"paged_decode {name} [{label}]: max err {err:.3g}")
    return bad


def check_ragged_extend(device, dtype, tol) -> list[str]:
    gen = torch.Generator().manual_seed(1)
    ps, width = 16, 16
    extend = [3, 1, 4, 0]
    lens = torch.tensor([20, 1, 256, 7])
    table = poisoned_table(gen, 4, width, ps, lens, 4 * width + 2)
    k = torch.randn(4 * width + 2, ps, HKV, D, generator=gen).to(dtype)
    v = torch.randn(4 * width + 2, ps, HKV, D, generator=gen).to(dtype)
    q = torch.randn(sum(extend), HQ, D, generator=gen).to(dtype)
    qo = F.pad(torch.cumsum(torch.tensor(extend), 0), (1, 0)).to(torch.int32)
    want = torch.ops.syncfree.ragged_extend_attention(q, k, v, table.clamp(min=0, max=4 * width + 1), lens.int(), qo,
                                                      max(extend)).float()
    bad = []
    for bound in (max(extend), 8, 64):
        got = torch.ops.syncfree.ragged_extend_attention(q.to(device), k.to(device), v.to(device), table.to(device),
                                                         lens.int().to(device), qo.to(device), bound).float().cpu()
        err = float((got - want).abs().max())
        if err > tol:
            bad.append(f"ragged_extend_attention bound {bound}: max err {err:.3g}")
    return bad


def check_kv_indices(device) -> list[str]:
    gen = torch.Generator().manual_seed(2)
    r2t = torch.randint(0, 10_000, (6, 64), generator=gen, dtype=torch.int32)
    rpi = torch.tensor([5, 0, 3])
    lens = torch.tensor([0, 64, 17])
    indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
    out = torch.full((3 * 64 + 5,), -7, dtype=torch.int32)
    want = out.clone()
    for b in range(3):
        want[int(indptr[b]) : int(indptr[b]) + int(lens[b])] = r2t[int(rpi[b]), : int(lens[b])]
    got = out.to(device)
    torch.ops.syncfree.kv_indices(got, r2t.to(device), rpi.to(device), lens.to(device), indptr.to(device))
    return [] if torch.equal(got.cpu(), want) else ["kv_indices differs from the loop"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args()
    bad = []
    dtypes = [(torch.float32, 2e-4)] + ([(torch.bfloat16, 3e-2)] if args.device == "cuda" else [])  # the
    for dtype, tol in dtypes:  # interpreter's bf16 is not the GPU's (numpy has none): fp32 only on the CPU
        bad += check_paged_decode(args.device, dtype, tol)
        bad += check_ragged_extend(args.device, dtype, tol)
    bad += check_kv_indices(args.device)
    if args.device == "cuda":
        torch.cuda.synchronize()
    for line in bad:
        print("DIFFERS", line)
    print(f"memcheck_paged_decode: {len(bad)} cases differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

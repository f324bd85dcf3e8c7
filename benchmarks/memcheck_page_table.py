"""The page-table ops on the inputs that once read out of bounds, for compute-sanitizer's memcheck (H200).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python benchmarks/memcheck_page_table.py

Without the caching allocator every tensor is its own allocation, so a read past one is an error memcheck sees
(with the cache on such reads land inside pooled segments and memcheck reports 0 errors). The inputs: a column
of a metadata matrix (`meta[:, 0]`), expanded (stride 0, a one-element allocation), step-2 slices, negative
request indices, out-of-range ones (just past, far past, on zero-length rows), lengths past the table and past
the static width, req_to_token as a column slice or transposed; both ops, the Triton kernel and the torch fill,
and checked=True on in-range inputs. Every result is compared with eager indexing (a plain loop on the host);
the script exits 1 on a difference. `--device cpu` under TRITON_INTERPRET=1 runs the same cases on the CPU.
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock

import torch

import compile_pass  # noqa: F401  (registers the ops)
import compile_pass.kernels.page_table as page_table_module

SENTINEL = -12345


def eager_cells(r2t, rpi, lens, page_size, width):
    """{(b, j): page} for the cells the contract specifies, indexing req_to_token as eager does."""
    r2t, rpi, lens = r2t.cpu(), rpi.cpu(), lens.cpu()
    cells = {}
    for b in range(rpi.shape[0]):
        idx = int(rpi[b])
        if not -r2t.shape[0] <= idx < r2t.shape[0]:
            continue  # eager raises IndexError: the row is unspecified (and page_table_ leaves it alone)
        n = min(-(-max(int(lens[b]), 0) // page_size), width, -(-r2t.shape[1] // page_size))
        for j in range(n):
            cells[(b, j)] = int(r2t[idx, j * page_size]) // page_size
    return cells


def cases(device):
    gen = torch.Generator().manual_seed(0)
    reqs, tokens, batch = 6, 40, 6

    def junk(*shape, high=10**6, dtype=torch.int64):
        return torch.randint(-high, high, shape, generator=gen, dtype=dtype)

    table = torch.randint(0, 10_000, (reqs, tokens), generator=gen, dtype=torch.int32)
    tables = {"contiguous": table.to(device)}
    wide = junk(reqs, tokens + 5, dtype=torch.int32)
    wide[:, 2:2 + tokens] = table
    tables["column_slice"] = wide.to(device)[:, 2:2 + tokens]
    tables["transposed"] = table.t().contiguous().to(device).t()
    good_idx = torch.tensor([-1, 3, -6, 3, 0, 5])  # negative and duplicate, all in range
    bad_idx = torch.tensor([reqs, -reqs - 1, 10**9, -(10**9), 2, -2])  # out of range, two in range
    lens_values = torch.tensor([0, 7, tokens, tokens + 9, 10**6, 0])  # 0, inside, past the table, far past

    def column(values):  # meta[:, 0] of a [B, 3] metadata matrix
        meta = junk(batch, 3)
        meta[:, 0] = values
        return meta.to(device)[:, 0]

    def step2(values):
        base = junk(2 * batch)
        base[::2] = values
        return base.to(device)[::2]

    def expanded(values):  # stride 0 over a one-element allocation
        return values[:1].to(device).expand(batch)

    for name, idx in (("negative", good_idx), ("out_of_range", bad_idx)):
        for lay_name, lay in (("contiguous", lambda v: v.to(device)), ("column", column), ("step2", step2),
                              ("expanded", expanded)):
            for table_name, r2t in tables.items():
                for dtype in (torch.int32, torch.int64):
                    rpi, lens = lay(idx.to(dtype)), lay(lens_values.to(dtype))
                    yield f"{name}/{lay_name}/{table_name}/{dtype}", r2t, rpi, lens, name != "out_of_range"


def run_case(r2t, rpi, lens, page_size, width, in_range):
    expect = eager_cells(r2t, rpi, lens, page_size, width)
    out = torch.ops.syncfree.page_table(r2t, rpi, lens, page_size, width, checked=False).cpu().tolist()
    wrong = [k for k, v in expect.items() if out[k[0]][k[1]] != v]
    full = torch.full((rpi.shape[0] + 2, width + 2), SENTINEL, dtype=torch.int32, device=r2t.device)
    torch.ops.syncfree.page_table_(full[1:, :width], r2t, rpi, lens, page_size)
    got = full.cpu().tolist()
    wrong += [(r - 1, c) for r in range(len(got)) for c in range(len(got[0]))
              if got[r][c] != expect.get((r - 1, c), SENTINEL)]
    if in_range:  # the device assertions run (and hold) too
        torch.ops.syncfree.page_table(r2t, rpi, lens.clamp(max=width * page_size), page_size, width, checked=True)
    return wrong


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("memcheck_page_table needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)")
    count, failures = 0, []
    for path in ("triton", "torch"):
        with mock.patch.object(page_table_module, "use_triton", lambda t, path=path: path == "triton"):
            for name, r2t, rpi, lens, in_range in cases(args.device):
                for page_size, width in ((1, 48), (3, 5), (16, 4)):
                    wrong = run_case(r2t, rpi, lens, page_size, width, in_range)
                    count += 1
                    if wrong:
                        failures.append(f"{path} {name} ps={page_size} width={width}: cells {wrong[:6]}")
    if args.device == "cuda":
        torch.cuda.synchronize()
    for line in failures:
        print("DIFFERS", line)
    print(f"memcheck_page_table: {count} cases, {len(failures)} differ from eager")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

"""GPU tests of the page-table ops' indexing (marker `gpu`, skipped without CUDA): on CUDA tensors the op runs the
Triton kernel; both it and the torch fill (forced) must index as eager does: any strides, negative indices
wrapped, out-of-range indices never read, nothing written outside the live cells (the sentinel invariant).
The same comparisons as kernels/test_page_table.py, against the same plain-loop reference."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernel_cases import (
    DTYPE_CASES,
    LAYOUT_CASES,
    assert_functional_as_eager,
    assert_inplace_as_eager,
    check_layout_case,
    make_eager_case,
    on_path,
)

pytestmark = pytest.mark.gpu

GPU_PATHS = ["triton", "torch"]
DEVICE = "cuda"  # a module constant, so the file's logic can be dry-run on CPU under TRITON_INTERPRET=1
SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.mark.parametrize("path", GPU_PATHS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("layouts", LAYOUT_CASES, ids="-".join)
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=lambda d: f"r2t_{d[0]}-idx_{d[1]}".replace("torch.", ""))
def test_cuda_strided_expanded_and_negative_inputs_index_as_eager(path, page_size, layouts, dtypes):
    check_layout_case(path, page_size, layouts, dtypes, device=DEVICE)


@pytest.mark.parametrize("path", GPU_PATHS)
@pytest.mark.parametrize("layouts", [("column", "column", "column_slice"), ("contiguous", "expanded", "contiguous")],
                         ids="-".join)
def test_cuda_out_of_range_indices_read_and_write_nothing(path, layouts):
    # Out of range both ways, huge, on a zero-length row, next to negative and duplicate in-range ones.
    indices = [2, 4, -5, 10**9, -1, 7, -4, 2]
    lengths = [12, 12, 5, 0, 7, 0, 30, 3]
    r2t, rpi, lens = make_eager_case(torch.Generator().manual_seed(3), 8, 4, 24, lengths, indices, torch.int32,
                                     torch.int64, *layouts, device=DEVICE)
    with on_path(path):
        for page_size in (1, 3, 16):
            assert_functional_as_eager(r2t, rpi, lens, page_size, 6)
            assert_inplace_as_eager(r2t, rpi, lens, page_size, 6)


@pytest.mark.parametrize("path", GPU_PATHS)
def test_cuda_random_cases_against_eager(path):
    layouts = ["contiguous", "column", "expanded", "step2"]
    tables = ["contiguous", "column_slice", "step2_columns", "step2_rows", "transposed", "expanded_rows"]
    for seed in range(60):
        gen = torch.Generator().manual_seed(seed)
        pick = lambda n: int(torch.randint(0, n, (1,), generator=gen))  # noqa: E731
        batch, num_reqs, tokens, width = 1 + pick(9), 1 + pick(6), 1 + pick(300), 1 + pick(40)
        page_size = [1, 3, 16][pick(3)]
        indices = torch.randint(-num_reqs - 2, num_reqs + 2, (batch,), generator=gen).tolist()
        lengths = torch.randint(-3, tokens + 3 * page_size, (batch,), generator=gen).tolist()
        dtypes = DTYPE_CASES[pick(3)]
        r2t, rpi, lens = make_eager_case(gen, batch, num_reqs, tokens, lengths, indices, *dtypes,
                                         layouts[pick(4)], layouts[pick(4)], tables[pick(6)], device=DEVICE)
        with on_path(path):
            assert_functional_as_eager(r2t, rpi, lens, page_size, width)
            assert_inplace_as_eager(r2t, rpi, lens, page_size, width)


def _run(script: str) -> subprocess.CompletedProcess:
    # A device-side assertion poisons the CUDA context: each checked call runs in its own process.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    code = (f"import torch, compile_pass\nDEVICE = {DEVICE!r}\n" + textwrap.dedent(script)
            + "\nif DEVICE == 'cuda':\n    torch.cuda.synchronize()\nprint('ran')\n")
    return subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=240)


CHECKED_SETUP = """
r2t = torch.arange(48, device=DEVICE).reshape(4, 12)
meta = torch.tensor([[2, 12], [-4, 5], [{bad}, 0]], device=DEVICE)
rpi, lens = meta[:, 0], meta[:, 1]
"""


CALLS = {
    "page_table": "torch.ops.syncfree.page_table(r2t, rpi, lens, 3, 4, checked=True)",
    "page_table_": "torch.ops.syncfree.page_table_(torch.zeros(3, 4, dtype=torch.int32, device=DEVICE), r2t, rpi, "
                   "lens, 3, checked=True)",
}


def test_cuda_checked_mode_passes_in_range_indices():
    ok = _run(CHECKED_SETUP.format(bad=-1) + "\n".join(CALLS.values()))
    assert ok.returncode == 0 and "ran" in ok.stdout, ok.stderr[-3000:]


@pytest.mark.parametrize("op,bad", [("page_table", 4), ("page_table_", -5)])
def test_cuda_checked_mode_asserts_on_out_of_range_indices(op, bad):
    # The bad index sits on a zero-length row: eager raises IndexError there too.
    failed = _run(CHECKED_SETUP.format(bad=bad) + CALLS[op])
    assert failed.returncode != 0 and "ran" not in failed.stdout, failed.stdout[-2000:]
    assert "device-side assert" in failed.stderr or "req_pool_indices" in failed.stderr, failed.stderr[-3000:]

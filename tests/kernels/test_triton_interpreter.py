"""The same kernel tests through the Triton interpreter (TRITON_INTERPRET=1), in a subprocess: triton.jit
decides at import whether a kernel is interpreted, so this process cannot switch."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest_helpers import interpreting

HERE = Path(__file__).resolve().parent


def _version(text: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def test_kernels_run_under_the_interpreter():
    if interpreting():
        import torch

        from compile_pass.kernels._triton import use_triton

        from kernel_cases import PATHS

        assert use_triton(torch.zeros(1)), "the interpreter path is not taken"
        assert "triton" in PATHS, "the page-table tests would not run the kernel"
        return
    triton = pytest.importorskip("triton")
    numpy = pytest.importorskip("numpy")
    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        pytest.skip(f"triton {triton.__version__}'s interpreter calls int() on 1-element arrays, which numpy "
                    f"{numpy.__version__} rejects (numpy < 2.4 works; the kernels themselves run on the GPU)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    files = [str(HERE / f) for f in ("test_page_table.py", "test_paged_decode.py", "test_triton_interpreter.py")]
    # Not -q: the header's "collected N items" is what the counts below add up to (one run, no second collection).
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "-x", *files],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # Every kernel test ran under the interpreter, but for bfloat16 (numpy has none): the counts add up.
    collected = int(re.search(r"collected (\d+) items?", proc.stdout).group(1))
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("bfloat16" in line for line in skips), skips
    assert passed + len(skips) == collected and passed >= 20, (passed, len(skips), collected)

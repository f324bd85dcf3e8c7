"""kernels/compile_ahead.py and kernels/_compile_helper.py: a compile Triton's JIT asks for is recorded here,
compiled in a helper process that imports no torch, and found by this process in Triton's on-disk cache.

There is no GPU here, but Triton compiles for a CUDA target without one (its ptxas is in the wheel): Triton's
driver is replaced by one that names an H200's target (sm_90), and the compile is real. tests/test_gpu.py checks on
the H200 that the first call then compiles none of this package's kernels.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from compile_pass.kernels import _compile_helper, compile_ahead  # noqa: E402
from compile_pass.kernels._triton import PointerArg  # noqa: E402
from compile_pass.kernels.page_table_kernel import page_table_kernel  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(getattr(triton, "knobs", None), "runtime"),
                                reason="triton.knobs.runtime (the JIT compile hook) is not in this Triton")

H200 = GPUTarget("cuda", 90, 32)


class H200Driver:
    """What Triton's JIT asks of its driver to specialize and compile a launch (not to run one)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return H200

    def is_active(self):
        return True


@pytest.fixture
def h200(monkeypatch, tmp_path):
    """Triton's JIT specializing for an H200, with a fresh on-disk cache, and the page-table kernel's in-memory
    cache for that device dropped afterwards; every compile this process does is listed (name, cache hit)."""
    monkeypatch.setattr(driver, "_active", H200Driver())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    compiles: list = []
    monkeypatch.setattr(knobs.compilation, "listener",
                        lambda src, cache_hit, **_: compiles.append((src.fn.fn.__name__, cache_hit)))
    page_table_kernel.device_caches.pop(0, None)
    yield compiles
    page_table_kernel.device_caches.pop(0, None)
    compile_ahead.helper.stop()


def _warm_up_page_table(rows: int, width: int, block: int):
    """The launch kernels/page_table.py makes for a [rows, width] int32 table, as a warm-up (fake pointers)."""
    out = torch.empty(rows, width, dtype=torch.int32)
    r2t = torch.empty(8, 1024, dtype=torch.int32)
    rpi, lens = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int32)
    return page_table_kernel.warmup(PointerArg(out), width, 1, PointerArg(r2t), 1024, 1, PointerArg(rpi), 1,
                                    PointerArg(lens), 1, 8, 1024, 1, width, BLOCK=block, grid=(rows, 1))


def test_a_recorded_compile_is_done_by_the_helper_and_found_here(h200):
    with compile_ahead.recording() as jobs:
        assert _warm_up_page_table(4, 16, 128) is None  # recorded, not compiled
    assert h200 == [] and knobs.runtime.jit_cache_hook is None
    (job,) = jobs
    assert (job.name, job.device, job.target) == ("page_table_kernel", 0, ("cuda", 90, 32))
    assert json.loads(job.specialization)["constant_vals"][-1] == 128  # BLOCK

    outcome = compile_ahead.compile_and_load(jobs)
    assert outcome == compile_ahead.Outcome(helper_compiled=1, loaded=1, errors=[])
    assert h200 == [("page_table_kernel", True)]  # this process read the helper's compile from disk
    kernel = page_table_kernel.device_caches[0][0][job.key]
    assert kernel.metadata.target.arch == 90
    # The launch's own lookup now finds it in memory: Triton compiles (and reads) nothing more.
    assert _warm_up_page_table(4, 16, 128) is kernel
    assert h200 == [("page_table_kernel", True)]


def test_the_jits_own_lookup_in_a_later_process_finds_the_helpers_compile(h200):
    """The helper's compile is stored under the key Triton's JIT computes for the same launch: a later process
    that launches the kernel itself (warm-ups off, or a precompiled step loaded with no backend call) reads it
    from disk instead of compiling it again. The in-memory cache dropped stands for the later process."""
    with compile_ahead.recording() as jobs:
        _warm_up_page_table(4, 16, 128)
    assert compile_ahead.compile_and_load(jobs).helper_compiled == 1
    assert h200 == [("page_table_kernel", True)]
    page_table_kernel.device_caches.pop(0, None)
    kernel = _warm_up_page_table(4, 16, 128)  # the JIT's own path: no hook, no decode
    assert h200 == [("page_table_kernel", True), ("page_table_kernel", True)]
    assert kernel.metadata.target.arch == 90


def test_a_different_launch_is_a_different_job_and_a_miss_compiles_here(h200):
    """A launch the helper did not compile (another BLOCK) is not in the on-disk cache: loading it compiles it in
    this process, to the same result a first launch would get."""
    with compile_ahead.recording() as jobs:
        _warm_up_page_table(4, 16, 128)
        _warm_up_page_table(4, 16, 64)
    assert len(jobs) == 2 and jobs[0].key != jobs[1].key
    compile_ahead.load(jobs[1])
    assert h200 == [("page_table_kernel", False)]
    assert _warm_up_page_table(4, 16, 64) is page_table_kernel.device_caches[0][0][jobs[1].key]


def test_a_job_the_helper_cannot_do_is_reported_and_the_rest_go_on(h200):
    with compile_ahead.recording() as jobs:
        _warm_up_page_table(4, 16, 128)
    bad = jobs[0]._replace(specialization="{not json", key="bad")
    outcome = compile_ahead.compile_and_load([bad, jobs[0]])
    assert outcome.helper_compiled == 1 and outcome.loaded == 1
    assert [(name, where) for name, where, _ in outcome.errors] == [("page_table_kernel", "helper"),
                                                                   ("page_table_kernel", "load")]
    assert "JSONDecodeError" in outcome.errors[0][2]


def test_a_helper_that_does_not_answer_is_killed_and_the_job_compiles_here(h200, monkeypatch):
    """Where the helper cannot work (here: a process that never answers), the first launch must not hang: past the
    deadline the helper is killed and the job compiles in this process."""
    with compile_ahead.recording() as jobs:
        _warm_up_page_table(4, 16, 128)
    monkeypatch.setattr(compile_ahead, "_HELPER_MAIN", "import time; time.sleep(600)")
    monkeypatch.setattr(compile_ahead, "ANSWER_SECONDS", 1.0)
    monkeypatch.setattr(compile_ahead, "JOB_SECONDS", 0.0)
    helper = compile_ahead.CompileHelper()
    monkeypatch.setattr(compile_ahead, "helper", helper)
    outcome = compile_ahead.compile_and_load(jobs)
    assert outcome.helper_compiled == 0 and outcome.loaded == 1
    assert [(where, error.split(":")[0]) for _, where, error in outcome.errors] == [("helper", "TimeoutError")]
    assert h200 == [("page_table_kernel", False)]  # compiled here
    assert helper._process.wait(timeout=30) is not None  # killed


def test_the_helper_imports_no_torch(tmp_path):
    """The helper loads a kernel file by its path, without its package: this one fails to load if torch was
    imported (the job's specialization is not valid either, so the error says which came first)."""
    kernel_file = tmp_path / "probe_kernel.py"
    kernel_file.write_text("import sys\nassert 'torch' not in sys.modules, 'torch imported'\n"
                           "import triton\n\n@triton.jit\ndef probe_kernel(x):\n    pass\n")
    job = {"module": "probe_kernel", "file": str(kernel_file), "name": "probe_kernel", "specialization": "{}",
           "env_vars": {}, "target": ("cuda", 90, 32), "environ": {}, "cache_dir": str(tmp_path / "cache")}
    helper = compile_ahead.CompileHelper()
    try:
        import pickle

        helper._ensure()

        pickle.dump([job], helper._process.stdin)
        helper._process.stdin.flush()
        ((ok, error, _),) = pickle.loads(compile_ahead._read(helper._process.stdout, 60))
        assert not ok and error.startswith("KeyError"), error  # decode's, after the file loaded without torch
    finally:
        helper.stop()


def test_the_helper_exits_when_its_input_closes_and_is_started_again():
    helper = compile_ahead.CompileHelper()
    helper.start()
    first = helper._process
    helper.stop()
    assert first.returncode == 0
    first_pid = first.pid
    helper.start()
    assert helper._process.poll() is None and helper._process.pid != first_pid
    helper._process.kill()
    helper._process.wait()
    helper.start()  # a helper that died is replaced
    assert helper._process.poll() is None
    helper.stop()


def test_starting_the_helper_does_not_wait_for_a_batch_in_flight():
    """The backend starts the helper at each compile's entry; while an earlier graph's batch is being compiled
    (the lock held by its warm-up thread) that must return at once, not after the batch."""
    helper = compile_ahead.CompileHelper()
    with helper._lock:  # as during a batch
        done = threading.Event()
        caller = threading.Thread(target=lambda: (helper.start(), done.set()))
        caller.start()
        assert done.wait(timeout=30)
        assert helper._process is None  # left to the batch's own start
    caller.join()


def test_a_forked_process_starts_its_own_helper(monkeypatch):
    """A fork (a data-loader worker, an engine's process pool) inherits the handle of its parent's helper: writing
    to it would interleave with the parent's batches, so the fork starts a helper of its own."""
    import os

    helper = compile_ahead.CompileHelper()
    helper.start()
    parents = helper._process
    try:
        monkeypatch.setattr(os, "getpid", lambda: helper._owner + 1)  # as in the child after a fork
        helper.start()
        assert helper._process is not parents and parents.poll() is None  # the parent's helper is left alone
        helper.stop()
    finally:
        monkeypatch.undo()
        parents.stdin.close()
        parents.wait(timeout=30)


def test_recording_keeps_only_this_threads_compiles_and_restores_the_hook(monkeypatch):
    seen = []

    def users_hook(**kwargs):
        seen.append(kwargs["fn"].jit_function)
        return True

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", users_hook)
    monkeypatch.setattr(driver, "_active", H200Driver())
    page_table_kernel.device_caches.pop(0, None)
    try:
        with compile_ahead.recording() as jobs:
            other = threading.Thread(target=_warm_up_page_table, args=(2, 8, 32))
            other.start()
            other.join()
            _warm_up_page_table(4, 16, 128)
        assert len(jobs) == 1 and seen == [page_table_kernel]  # the other thread's went to the user's hook
        assert knobs.runtime.jit_cache_hook is users_hook
    finally:
        page_table_kernel.device_caches.pop(0, None)


def test_decode_reads_back_what_triton_wrote():
    import triton.language as tl

    written = json.dumps({"signature": {"x": "*fp16", "n": "i32", "B": "constexpr"},
                          "constant_keys": [[2], [3]], "constant_vals": [64, "fp16"],
                          "attrs_keys": [[0]], "attrs_vals": [[["tt.divisibility", 16]]],
                          "options": {"num_warps": 4, "extern_libs": [["libdevice", "/x.bc"]]}})
    signature, constexprs, attrs, options = _compile_helper.decode(written)
    assert signature == {"x": "*fp16", "n": "i32", "B": "constexpr"}
    assert constexprs == {(2,): 64, (3,): tl.float16}
    assert attrs == {(0,): [["tt.divisibility", 16]]}  # lists, as parse_attr builds them (str(attrs) is hashed)
    assert options == {"num_warps": 4, "extern_libs": (("libdevice", "/x.bc"),)}

"""Compile this package's Triton kernels ahead of their first launch, in a helper process.

compile_pass/kernel_warmup.py drives three steps for a rewritten graph:

1. **record** (this process, the calling thread, milliseconds): each op's implementation runs on fake tensors with
   its launches turned into Triton's `warmup` (kernels/warmup.py). Triton's JIT cache hook sees each compile that
   warm-up would do (the kernel, its specialization and options, the target) and `recording()` keeps it as a
   CompileJob and answers True, so nothing compiles here.
2. **compile** (kernels/_compile_helper.py, a process importing only Triton and the kernel files): `triton.compile`
   of each job for the recorded target, into Triton's on-disk cache. No CUDA context there, and no GIL shared
   with AOTAutograd and Inductor, which a thread of this process would compete with (BENCHMARKS.md, ninth
   session: the same compiles took 2.4-3.7 s in a thread against 1.1-1.6 s alone, and slowed Inductor).
3. **load** (a thread of this process, once the helper has answered): `triton.compile` of the same source, options,
   target and environment finds the helper's entry on disk, and the kernel goes into the JIT function's in-memory
   cache under the key its first launch looks up: that launch compiles nothing.

A job the helper did not compile, or whose entry this process does not find (a key that came out different),
compiles in step 3, in the thread: later, but still ahead of the launch, and never different from what the
launch would have compiled, since it is Triton's own compile of the request Triton's JIT made.

Triton internals used (here only; tests/test_compile_ahead.py runs them on the installed Triton, tests/test_gpu.py
on the H200's): the JIT hook's arguments (`fn.jit_function`, `compile["device"]`, `["specialization_data"]`),
`JITFunction.device_caches[device]` (kernel cache, _, target, ...) and `triton.compile(..., _env_vars=)`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
from typing import Any, NamedTuple

from . import _compile_helper


class CompileJob(NamedTuple):
    """One compile Triton's JIT asked for: `key` is its in-memory cache key in `fn.device_caches[device]`."""

    fn: Any  # the @triton.jit JITFunction
    device: int
    key: str
    specialization: str  # Triton's JSON specialization (signature, constexprs, attrs, options)
    env_vars: dict  # Triton's cache-invalidating environment when it was asked for
    target: tuple  # (backend, arch, warp_size)

    @property
    def name(self) -> str:
        return self.fn.fn.__name__

    def request(self) -> dict:
        """What the helper process needs of it (kernels/_compile_helper.py), all picklable."""
        from triton import knobs

        return {"module": self.fn.fn.__module__, "file": self.fn.fn.__code__.co_filename, "name": self.name,
                "specialization": self.specialization, "env_vars": self.env_vars, "target": self.target,
                "environ": dict(os.environ), "cache_dir": knobs.cache.dir}


# --- step 1: record ------------------------------------------------------------------------------------------------

_recording = threading.local()
_hook_lock = threading.Lock()


def _record(**kwargs):
    """Triton's JIT cache hook while `recording()` is active: keep the compile, answer True (do not compile)."""
    jobs = getattr(_recording, "jobs", None)
    if jobs is None:  # another thread's compile, in the window: left to the hook that was there before
        previous = _previous_hook[0]
        return previous(**kwargs) if previous is not None else None
    from triton._C.libtriton import get_cache_invalidating_env_vars

    fn, request = kwargs["fn"].jit_function, kwargs["compile"]
    target = fn.device_caches[request["device"]][2]
    jobs.append(CompileJob(fn, request["device"], kwargs["key"], request["specialization_data"],
                           dict(get_cache_invalidating_env_vars()), (target.backend, target.arch, target.warp_size)))
    return True


_previous_hook: list = [None]


@contextlib.contextmanager
def recording():
    """Inside: a Triton compile this thread would do is recorded (in the yielded list) instead."""
    from triton import knobs

    jobs: list[CompileJob] = []
    with _hook_lock:
        _previous_hook[0] = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = _record
        _recording.jobs = jobs
        try:
            yield jobs
        finally:
            _recording.jobs = None
            knobs.runtime.jit_cache_hook = _previous_hook[0]
            _previous_hook[0] = None


# --- step 2: compile, in the helper process --------------------------------------------------------------------

_HELPER_MAIN = ("import importlib.util, sys; sys.path[:] = sys.argv[2:]; "
                "s = importlib.util.spec_from_file_location('syncfree_compile_helper', sys.argv[1]); "
                "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); m.main()")


# How long the helper may take to answer a batch before it is killed and this process compiles the jobs itself
# (a helper that cannot run, e.g. where sys.executable is not a Python, must not hang the first launch).
ANSWER_SECONDS = 60.0
JOB_SECONDS = 30.0


def _read(stream, timeout: float) -> bytes:
    """One answer of the helper: its 8-byte length, then that many bytes, within `timeout` seconds (waiting in
    select and os.read, without the GIL)."""
    import select
    import time

    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    data = bytearray()
    size = None
    while size is None or len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"the compile helper did not answer within {timeout:.0f} s")
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            raise EOFError("the compile helper exited without answering")
        data += chunk
        if size is None and len(data) >= 8:
            size, data = int.from_bytes(data[:8], "little"), data[8:]
    return bytes(data)


class CompileHelper:
    """The helper process: started once, ahead of its first batch (its Python and Triton imports then overlap the
    pass), and again when it has exited (idle for _compile_helper.IDLE_SECONDS)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._owner = os.getpid()

    def start(self) -> None:
        """Start the helper unless it is running; never waits (a batch in flight holds the lock: the helper is up)."""
        if self._lock.acquire(blocking=False):
            try:
                self._ensure()
            finally:
                self._lock.release()

    def _ensure(self) -> subprocess.Popen:
        if self._owner != os.getpid():  # a fork of the process that started it: its pipes are the parent's
            self._process, self._owner = None, os.getpid()
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _HELPER_MAIN, _compile_helper.__file__, *sys.path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        return self._process

    def compile(self, jobs: list[CompileJob]) -> list[tuple[bool, str, float]]:
        """Compile `jobs` in the helper: one (ok, error, seconds) each. Raises when the helper cannot answer."""
        batch = [job.request() for job in jobs]
        with self._lock:
            process = self._ensure()
            try:
                pickle.dump(batch, process.stdin)
                process.stdin.flush()
                answers = pickle.loads(_read(process.stdout, ANSWER_SECONDS + JOB_SECONDS * len(jobs)))
            except BaseException:
                process.kill()
                raise
        if len(answers) != len(jobs):
            raise RuntimeError(f"the compile helper answered {len(answers)} of {len(jobs)} jobs")
        return answers

    def stop(self) -> None:
        with self._lock:
            if self._process is not None and self._owner == os.getpid() and self._process.poll() is None:
                self._process.stdin.close()
                self._process.wait(timeout=30)
            self._process = None


helper = CompileHelper()


# --- step 3: load --------------------------------------------------------------------------------------------------

def load(job: CompileJob):
    """Put the kernel of `job` into its JIT function's in-memory cache, where its first launch looks: from the
    on-disk cache when the helper compiled it there, else compiled here. Returns the compiled kernel."""
    kernel = _compile_helper.compile_kernel(job.fn, job.specialization, job.target, job.env_vars)
    job.fn.device_caches[job.device][0][job.key] = kernel
    return kernel


class Outcome(NamedTuple):
    helper_compiled: int  # jobs the helper compiled (or found in the on-disk cache)
    loaded: int  # jobs now in their in-memory cache
    errors: list  # (kernel name, where, error) of the rest


def compile_and_load(jobs: list[CompileJob], use_helper: bool = True) -> Outcome:
    """Steps 2 and 3 for `jobs`; never raises (a job left out compiles at its first launch, as without this)."""
    errors: list = []
    compiled = 0
    if use_helper:
        try:
            for job, (ok, error, _) in zip(jobs, helper.compile(jobs)):
                compiled += ok
                if not ok:
                    errors.append((job.name, "helper", error))
        except Exception as e:  # noqa: BLE001 - the loads below then compile in this process
            errors.append(("*", "helper", f"{type(e).__name__}: {e}"))
    loaded = 0
    for job in jobs:
        try:
            load(job)
            loaded += 1
        except Exception as e:  # noqa: BLE001
            errors.append((job.name, "load", f"{type(e).__name__}: {e}"))
    return Outcome(compiled, loaded, errors)

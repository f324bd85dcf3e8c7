"""The helper process that compiles this package's Triton kernels for kernels/compile_ahead.py.

It runs as its own Python process and imports nothing but the standard library, Triton and the kernel files it is
asked for (each `*_kernel.py` imports only Triton): no torch, no CUDA context, and no GIL shared with the
compile (Inductor's Python work) going on in the process that started it.

    parent -> helper (stdin):   a pickled batch: [job, ...], each a dict
                                  module, file, name     the @triton.jit function (loaded from `file` as `module`)
                                  specialization         Triton's JSON specialization of the launch (its JIT hook)
                                  env_vars               Triton's cache-invalidating environment at the request
                                  target                 (backend, arch, warp_size)
                                  environ, cache_dir     the parent's environment and Triton cache directory
    helper -> parent (stdout):  its length (8 bytes, little-endian), then a pickled list, one (ok, error, seconds)
                                per job, in order

Each job is `triton.compile` of that source, options and environment for that target, into the on-disk cache the
parent then reads. The helper serves batches until its input closes or it has waited IDLE_SECONDS for one.
`decode` is also what the parent uses to rebuild the same source: one reading of the specialization, so the
two processes compute the same cache key, and the same key as Triton's JIT computes for that launch (a later
process with warm-ups off, or a precompiled step, finds these compiles too).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import select
import sys
import time

IDLE_SECONDS = 120.0


def _tuples(value):
    """JSON's lists back into the tuples Triton wrote (tuple constexprs and signatures, option tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def decode(specialization: str) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of Triton's JSON specialization of a launch."""
    import triton.language as tl

    data = json.loads(specialization)

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(_tuples(value["constexpr"]))
        if isinstance(value, dict):
            raise ValueError(f"a constexpr this helper does not rebuild: {value}")
        return _tuples(value)

    signature = {name: _tuples(kind) for name, kind in data["signature"].items()}
    constexprs = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    # The attribute values stay the lists JSON gives: Triton's parse_attr builds lists and its source hash is
    # of str(attrs), so tuples here would name another cache entry than the JIT's own (Triton's preload reads
    # them the same way).
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    options = {name: _tuples(value) for name, value in data["options"].items()}
    return signature, constexprs, attrs, options


def build_launcher(kernel) -> bool:
    """Build the kernel's C launcher into Triton's cache where this Triton compiles one per signature (3.6 and
    earlier: gcc, some 0.3 s, otherwise done at the kernel's first launch; later Triton has one launcher for all).
    False where there is none to build. The launcher's source depends only on the kernel's signature and
    constexprs, so the first launch in the parent finds it (Triton keys it by that source)."""
    from triton.backends.nvidia import driver as nvidia

    if not (hasattr(nvidia, "make_launcher") and hasattr(nvidia, "compile_module_from_src")):
        return False
    nvidia.CudaLauncher(kernel.src, kernel.metadata)  # the constructor compiles (or finds) and loads the module
    return True


def compile_kernel(fn, specialization: str, target: tuple, env_vars: dict):
    """Triton's compile of `fn` for this specialization, target and cache-invalidating environment (found in the
    on-disk cache when it was compiled there before with the same four)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = decode(specialization)
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget(*target), options=options, _env_vars=env_vars)


_modules: dict = {}


def _kernel(module: str, file: str, name: str):
    if (module, file) not in _modules:
        spec = importlib.util.spec_from_file_location(module, file)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module] = loaded
        spec.loader.exec_module(loaded)
        _modules[module, file] = loaded
    return getattr(_modules[module, file], name)


def compile_job(job: dict) -> tuple[bool, str, float]:
    start = time.perf_counter()
    try:
        os.environ.clear()
        os.environ.update(job["environ"])
        from triton import knobs

        knobs.cache.dir = job["cache_dir"]
        kernel = compile_kernel(_kernel(job["module"], job["file"], job["name"]), job["specialization"],
                                job["target"], job["env_vars"])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which then compiles the kernel itself
        return False, f"{type(e).__name__}: {e}", time.perf_counter() - start
    try:
        if job["target"][0] == "cuda":
            build_launcher(kernel)
        return True, "", time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - the first launch then builds the launcher, as without this
        return True, f"launcher: {type(e).__name__}: {e}", time.perf_counter() - start


def main() -> None:
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print (a warning of an import) must not land in the answers
    requests = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([requests], [], [], IDLE_SECONDS)
        if not ready:
            return
        try:
            batch = pickle.load(requests)
        except EOFError:
            return
        answer = pickle.dumps([compile_job(job) for job in batch])
        answers.write(len(answer).to_bytes(8, "little") + answer)  # length first: the parent reads with a deadline
        answers.flush()


if __name__ == "__main__":
    main()

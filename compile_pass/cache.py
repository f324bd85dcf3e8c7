"""Start-up caches: build a step's compile artifacts once (at image build time), ship them, load them at start-up.

    # at image build, on a machine of the kind that will serve (same GPU, torch, triton, Python, this package):
    step = compile_pass.compile(decode_step, max_context_len=32768, cudagraphs=True)
    step(*example_batch)                              # compile (every batch size you will serve)
    compile_pass.cache.save_artifacts("/opt/app/syncfree.artifacts")

    # at start-up, before the first call:
    compile_pass.cache.load_artifacts("/opt/app/syncfree.artifacts")   # a mismatch warns, and compiling goes on
    step = compile_pass.compile(decode_step, max_context_len=32768, cudagraphs=True)

`save_artifacts` wraps torch's mega-cache (`torch.compiler.save_cache_artifacts`: the FX graph cache, AOT
autograd's cache, Triton kernels, autotuning results of everything this process compiled or loaded) and adds
the post-grad check's findings of those graphs, which torch does not know of: without them a loaded FX-graph-cache
hit would compile once more without the cache. Loading writes both into this process's caches
(TORCHINDUCTOR_CACHE_DIR): the first call then traces with Dynamo again but runs neither AOT autograd nor Inductor
nor Triton's compiler.

A file carries who built it (torch, triton, Python, the GPU, a hash of this package's source). One that does not
match this process, is damaged or is not an artifacts file is not loaded: `load_artifacts` warns
(`ArtifactsMismatch`), names what differs and returns a result whose `loaded` is False, and the step then compiles
as it would without it. Every cache key also covers the versions, the options and the pass's code, so a file that
slipped through can only miss, never serve another graph. The file holds pickled torch artifacts: load only files
you built.

`aot_compile` / `load_compiled` (torch >= 2.12, where torch has `aot_compile`) go further: the Dynamo trace is
saved too, so the first call traces nothing. A loaded step checks Dynamo's guards on each call and runs the normal
compile (`fallback`) for inputs the saved graph does not cover, or for a file that does not load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import struct
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from . import _compat

MAGIC = b"SYNCFREE-ARTIFACTS\n"
FORMAT = 1


class ArtifactsMismatch(UserWarning):
    """A cache-artifacts file was not loaded: built elsewhere (another torch, GPU, ...), damaged, or not one."""


class ArtifactsError(RuntimeError):
    """Saving failed (nothing compiled), or, with strict=True, loading did."""


@dataclasses.dataclass
class ArtifactsInfo:
    """What a save wrote or a load read: `loaded` (False when a load was refused), why not (`reason`), the
    artifact counts by kind (torch's "inductor", "aot_autograd", "autotune", ..., and our "syncfree_findings")."""

    path: str
    loaded: bool = True
    reason: str = ""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    built_by: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.loaded


def identity() -> dict[str, Any]:
    """What an artifacts file must share with the process that loads it."""
    from .post_grad_check import source_hash

    cuda = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cuda = f"{torch.cuda.get_device_name()} (sm{major}{minor}, CUDA {torch.version.cuda})"
    triton = None
    try:
        import triton as _triton

        triton = _triton.__version__
    except ImportError:
        pass
    return {"format": FORMAT, "torch": torch.__version__, "triton": triton,
            "python": ".".join(platform.python_version_tuple()[:2]), "cuda": cuda,
            "torch_syncfree_source": source_hash()}


def _mismatches(built: dict, here: dict) -> list[str]:
    return [f"{key} {built.get(key)!r} (this process: {here[key]!r})" for key in here if built.get(key) != here[key]]


def save_artifacts(path: str | Path) -> ArtifactsInfo:
    """Write every compile artifact this process made or loaded (torch's and the post-grad findings) to `path`."""
    from .post_grad_check import findings_seen

    blob = _compat.save_cache_artifacts()
    if blob is None:
        raise ArtifactsError("no compile artifacts were recorded in this process: call the compiled step (every "
                             "shape you will serve) before save_artifacts")
    findings = findings_seen()
    header = {**identity(), "findings": findings, "torch_bytes": len(blob),
              "sha256": hashlib.sha256(blob).hexdigest()}
    data = json.dumps(header, sort_keys=True).encode()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(MAGIC + struct.pack("<Q", len(data)) + data + blob)
    tmp.replace(path)
    return ArtifactsInfo(str(path), counts={"torch_bytes": len(blob), "syncfree_findings": len(findings)},
                         built_by=identity())


def _read(path: Path) -> tuple[dict, bytes]:
    """(header, torch's bytes); ValueError saying what is wrong with the file."""
    raw = path.read_bytes()
    if not raw.startswith(MAGIC):
        raise ValueError("not a torch-syncfree artifacts file (compile_pass.cache.save_artifacts writes them)")
    start = len(MAGIC) + 8
    if len(raw) < start:
        raise ValueError("the file is truncated")
    (size,) = struct.unpack("<Q", raw[len(MAGIC):start])
    try:
        header = json.loads(raw[start:start + size])
    except ValueError:
        raise ValueError("its header is damaged") from None
    blob = raw[start + size:]
    if not isinstance(header, dict) or len(blob) != header.get("torch_bytes") \
            or hashlib.sha256(blob).hexdigest() != header.get("sha256"):
        raise ValueError("its contents are damaged (size or checksum)")
    return header, blob


def load_artifacts(path: str | Path, *, strict: bool = False) -> ArtifactsInfo:
    """Load an artifacts file into this process's caches, before the first call of the step. Where the file is
    missing, damaged or built elsewhere: warn (ArtifactsMismatch) naming why, load nothing and return a falsy
    result (the step then compiles normally); strict=True raises ArtifactsError instead."""
    from .post_grad_check import save_findings

    def refuse(why: str, built_by: dict | None = None) -> ArtifactsInfo:
        message = f"syncfree: cache artifacts {path} not loaded: {why}; the step compiles as without them"
        if strict:
            raise ArtifactsError(message)
        warnings.warn(message, ArtifactsMismatch, stacklevel=3)
        return ArtifactsInfo(str(path), loaded=False, reason=why, built_by=built_by or {})

    try:
        header, blob = _read(Path(path))
    except OSError as e:
        return refuse(f"cannot read it ({e.strerror or e})")
    except ValueError as e:
        return refuse(str(e))
    built_by = {k: v for k, v in header.items() if k not in ("findings", "torch_bytes", "sha256")}
    differs = _mismatches(header, identity())
    if differs:
        return refuse("built with " + ", ".join(differs), built_by)
    try:
        counts = _compat.load_cache_artifacts(blob)
    except Exception as e:  # noqa: BLE001  (torch writing its caches: a full or read-only disk, say)
        return refuse(f"torch could not write its artifacts into this process's caches ({type(e).__name__}: "
                      f"{str(e)[:200]})", built_by)
    if counts is None:
        return refuse("torch could not read its artifacts", built_by)
    findings = header.get("findings") or {}
    for key, entry in findings.items():
        save_findings(key, entry)
    return ArtifactsInfo(str(path), counts={**counts, "syncfree_findings": len(findings)}, built_by=built_by)


# -- AOT precompile: the Dynamo trace saved too (torch >= 2.12) ------------------------------------------------------
def _require_aot() -> None:
    why = _compat.aot_compile_supported()
    if why:
        raise ArtifactsError(f"{why}: AOT precompile needs torch >= 2.12; use save_artifacts / load_artifacts, "
                             "which every supported torch has")


def aot_compile(fn: Callable, args: tuple, kwargs: dict | None = None, *, max_context_len: int, **options):
    """Compile `fn` through the backend for these example inputs, Dynamo's trace included; the result is callable
    and has save_compiled_function(path). Options as compile_pass.compile's (fullgraph is implied)."""
    from .backend import syncfree_backend
    from .options import SyncfreeOptions

    _require_aot()
    options = {"max_context_len": max_context_len, **options}
    SyncfreeOptions.from_dict(options)
    with _compat.aot_compile_enabled():
        compiled = torch.compile(fn, backend=syncfree_backend, options=options, fullgraph=True)
    with _compat.capture_scalar_outputs():
        try:
            return _compat.aot_compile(compiled, args, kwargs or {})
        except RuntimeError as e:
            if "SerializableCallable" not in str(e):
                raise
            raise ArtifactsError("this step cannot be AOT-compiled: the backend's result is not one torch can "
                                 f"save ({str(e).splitlines()[0][:200]}); use save_artifacts / load_artifacts") from e


class LoadedStep:
    """An AOT-compiled step read back: its guards are checked on each call; inputs they do not cover go to
    `fallback` (the normal compile)."""

    def __init__(self, compiled, fallback: Callable | None, path: str):
        self.compiled = compiled
        self.fallback = fallback
        self.path = path
        if compiled is not None:
            compiled.disable_guard_check()  # checked here, once per call

    def __call__(self, *args, **kwargs):
        if self.compiled is not None and self.compiled.guard_check(*args, **kwargs):
            return self.compiled(*args, **kwargs)
        if self.fallback is None:
            raise ArtifactsError(f"the step loaded from {self.path} does not cover these inputs (Dynamo's guards "
                                 "fail) and no fallback was given")
        return self.fallback(*args, **kwargs)


def load_compiled(path: str | Path, fallback: Callable | None = None, *, strict: bool = False) -> LoadedStep:
    """Read a step saved by aot_compile(...).save_compiled_function(path). A file that does not load (another
    torch or GPU, damaged) warns (ArtifactsMismatch) and every call goes to `fallback`, e.g.
    compile_pass.compile(step, ...); strict=True raises instead."""
    try:
        _require_aot()
        compiled = _compat.load_compiled_function(str(path))
    except Exception as e:  # noqa: BLE001  (torch raises many kinds here: version checks, unpickling)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        message = (f"syncfree: compiled step {path} not loaded ({type(e).__name__}: {first}); "
                   + ("calls go to the fallback compile" if fallback is not None else "no fallback was given"))
        if strict or fallback is None:
            raise ArtifactsError(message) from e
        warnings.warn(message, ArtifactsMismatch, stacklevel=2)
        compiled = None
    return LoadedStep(compiled, fallback, str(path))

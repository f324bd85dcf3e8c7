"""Start-up caches: build a step's compile artifacts once (at image build time), ship them, load them at start-up.

    # at image build, on a machine of the kind that will serve (same GPU, torch, triton, Python, this package):
    step = compile_pass.compile(decode_step, max_context_len=32768, cudagraphs=True)
    step(*example_batch)                              # compile (every batch size you will serve)
    compile_pass.cache.save_artifacts("/opt/app/syncfree.artifacts")

    # at start-up, before the first call (options: the step's, so that a file built with others is refused):
    compile_pass.cache.load_artifacts("/opt/app/syncfree.artifacts",
                                      options={"max_context_len": 32768, "cudagraphs": True})  # a mismatch warns
    step = compile_pass.compile(decode_step, max_context_len=32768, cudagraphs=True)

`save_artifacts` wraps torch's mega-cache (`torch.compiler.save_cache_artifacts`: the FX graph cache, AOT
autograd's cache, Triton kernels, autotuning results of everything this process compiled or loaded) and adds
what torch does not know of: the post-grad check's findings of those graphs (without them a loaded FX-graph-cache
hit would compile once more without the cache), and the Triton binaries of this package's own kernels (kernels/:
page_table, paged_decode, ...) that this process compiled or loaded. Those run outside Inductor, launched by the
package's custom ops, so torch's artifacts do not hold them; without them each JITs at its first launch (1.85 s
of a precompiled start on an H200). compile_pass._triton_cache says how they are found (Triton's compilation
listener, by the module that defines the kernel) and written. Loading writes all three into this process's caches
(TORCHINDUCTOR_CACHE_DIR; TRITON_CACHE_DIR, or where Triton and Inductor would put it when unset), never replacing
a different file already there: the first call then traces with Dynamo again but runs neither AOT autograd nor
Inductor nor Triton's compiler.

A file carries who built it (torch, triton, Python, the GPU, a hash of this package's source, the rules'
fingerprint), its format (FORMAT) and the backend options it was built with (`options`: each distinct set the
saving process compiled with; the step's own for aot_compile). One that does not match this process, is damaged, is
of another format (an older torch-syncfree's), is not an artifacts file, or was built with other options than the
step's (given to the loader as `options=`; load_compiled takes them from its fallback by default) is not loaded:
the loader warns (`ArtifactsMismatch`), names what differs and returns a result whose `loaded` is False and whose
`reason` says why, nothing of it is written (no Triton binary either), and the step then compiles as it would
without it (strict=True raises ArtifactsError instead, and nothing compiles). Every cache key also covers the
versions, the options and the pass's code, so a file that slipped through can only miss, never serve another
graph. The file holds pickled torch artifacts: load only files you built.

`aot_compile` / `load_compiled` (where torch has `aot_compile`: 2.11 and 2.13 here) go further: the Dynamo trace is
saved too, so the first call traces nothing. `aot_compile(...).save_compiled_function(path)` writes one file of
the same kind: torch's compiled function, the package's Triton binaries and the same identity, checked before
anything is loaded or written. A loaded step checks Dynamo's guards on each call and runs the normal compile
(`fallback`) for inputs the saved graph does not cover, or for a file that does not load. A step file of torch's
own format (written by `save_compiled_function` before FORMAT 2) still loads, without binaries.
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

from . import _compat, _triton_cache, log

MAGIC = b"SYNCFREE-ARTIFACTS\n"
# 1: torch's artifacts and the findings. 2: the Triton binaries of the package's kernels too, and a `kind`
# (ARTIFACTS: save_artifacts' file; STEP: aot_compile's save_compiled_function, torch's compiled function inside).
# 3: the backend options the file was built with (`options`) and the rules' fingerprint (`rules`, in identity()).
FORMAT = 3
ARTIFACTS, STEP = "artifacts", "compiled_step"
# Header fields that say what, not who built it (`options`: checked against the step's own, not the process's).
_NOT_IDENTITY = ("findings", "torch_bytes", "sha256", "triton_kernels", "kind", "options")


class ArtifactsMismatch(UserWarning):
    """A cache-artifacts file was not loaded: built elsewhere (another torch, GPU, ...), damaged, or not one."""


class ArtifactsError(RuntimeError):
    """Saving failed (nothing compiled), or, with strict=True, loading did."""


@dataclasses.dataclass
class ArtifactsInfo:
    """What a save wrote or a load read: `loaded` (False when a load was refused), why not (`reason`), the
    artifact counts by kind (torch's "inductor", "aot_autograd", "autotune", ..., and our "syncfree_findings",
    "triton_kernels"), and what became of the package's Triton binaries (`triton`)."""

    path: str
    loaded: bool = True
    reason: str = ""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    built_by: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The backend options the file was built with (SyncfreeOptions.to_dict()): one per distinct set of options the
    # saving process compiled with (save_artifacts), the step's own (aot_compile); [] where the file records none.
    options: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # The package's Triton kernels: saved ({"kernels", "bytes", "names"}) or written at a load ({"kernels",
    # "written", "present", "conflicts", "failed", "dirs"}: entries per outcome, summed over the dirs).
    triton: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.loaded


def identity() -> dict[str, Any]:
    """What an artifacts file must share with the process that loads it: the versions (torch, triton, Python, the
    GPU, this package's source) and the rules' fingerprint (their order, source and reason codes)."""
    from .post_grad_check import source_hash
    from .rules import rules_fingerprint

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
            "torch_syncfree_source": source_hash(), "rules": rules_fingerprint()}


# -- the options a file was built with ---------------------------------------------------------------------------
def normalized_options(options: dict | Any) -> dict[str, Any]:
    """Backend options (as compile_pass.compile or torch.compile(options=...) take them, or a SyncfreeOptions) as
    a file records them: SyncfreeOptions.to_dict(), every default filled in, JSON-plain."""
    from .options import SyncfreeOptions

    opts = options if isinstance(options, SyncfreeOptions) else SyncfreeOptions.from_dict(dict(options))
    return json.loads(json.dumps(opts.to_dict(), sort_keys=True, default=repr))


def _compiled_options(fn) -> dict | None:
    """The options given to the syncfree backend by compile_pass.compile or torch.compile(backend="syncfree",
    options=... / mode=...): read from torch's wrapper of the backend (its compiler_fn and kwargs), or None."""
    from .backend import _mode_options

    frontier, seen = [getattr(fn, "_syncfree_compiled", fn)], set()
    for _ in range(8):
        following = []
        for obj in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            kwargs = getattr(obj, "kwargs", None)
            if getattr(getattr(obj, "compiler_fn", None), "__name__", "") == "syncfree_backend" \
                    and isinstance(kwargs, dict):
                return {**_mode_options(kwargs.get("mode")), **(kwargs.get("options") or {})}
            following += [cell.cell_contents for cell in getattr(obj, "__closure__", None) or ()
                          if _has_contents(cell)]
            following += [getattr(obj, a) for a in ("_torchdynamo_orig_backend", "_inner_convert")
                          if getattr(obj, a, None) is not None]
        frontier = following
    return None


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def options_of(fn) -> dict[str, Any] | None:
    """The normalized options a compiled step runs with: a function made by compile_pass.compile, or by
    torch.compile(backend="syncfree"); None for anything else (a plain function: nothing to compare)."""
    given = getattr(fn, "_syncfree_options", None)
    if given is None:
        given = _compiled_options(fn)
    if given is None:
        graphs = getattr(fn, "_syncfree_reports", None)
        return dict(graphs[0].options) if graphs else None
    try:
        return normalized_options(given)
    except (TypeError, ValueError):
        return None


def _options_differ(built: list[dict], wanted: dict) -> str | None:
    """None when `wanted` is one of the option sets a file was built with; else what differs, from the nearest."""
    if any(b == wanted for b in built):
        return None
    if not built:
        return "no backend options recorded (it holds no syncfree compile)"
    nearest = min(built, key=lambda b: sum(b.get(k) != wanted.get(k) for k in set(b) | set(wanted)))
    keys = sorted(k for k in set(nearest) | set(wanted) if nearest.get(k) != wanted.get(k))
    return "other options: " + ", ".join(f"{k} {nearest.get(k)!r} (this step: {wanted.get(k)!r})" for k in keys)


def _mismatches(built: dict, here: dict) -> list[str]:
    def shown(key, value):
        if key in ("rules", "torch_syncfree_source") and isinstance(value, str) and len(value) > 12:
            return repr(value[:12] + "...")  # fingerprints: their first characters say enough
        return repr(value)

    return [f"{key} {shown(key, built.get(key))} (this process: {shown(key, here[key])})" for key in here
            if built.get(key) != here[key]]


def _write(path: Path, kind: str, blob: bytes, **fields) -> dict:
    """Write MAGIC, the header (identity, kind, the package's Triton binaries, `fields`) and torch's bytes,
    atomically; the Triton summary of what went in."""
    entries = _triton_cache.collect()
    header = {**identity(), **fields, "kind": kind, "triton_kernels": _triton_cache.encode(entries),
              "torch_bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    data = json.dumps(header, sort_keys=True).encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(MAGIC + struct.pack("<Q", len(data)) + data + blob)
    tmp.replace(path)
    return dict(kernels=len(entries), bytes=sum(len(d) for e in entries for d in e["files"].values()),
                names=sorted({e["name"] for e in entries}))


def save_artifacts(path: str | Path) -> ArtifactsInfo:
    """Write every compile artifact this process made or loaded (torch's, the post-grad findings and the
    package's Triton binaries) to `path`."""
    from .post_grad_check import findings_seen

    blob = _compat.save_cache_artifacts()
    if blob is None:
        raise ArtifactsError("no compile artifacts were recorded in this process: call the compiled step (every "
                             "shape you will serve) before save_artifacts")
    findings = findings_seen()
    options = _options_compiled_here()
    path = Path(path)
    triton = _write(path, ARTIFACTS, blob, findings=findings, options=options)
    return ArtifactsInfo(str(path), counts={"torch_bytes": len(blob), "syncfree_findings": len(findings),
                                            "triton_kernels": triton["kernels"]},
                         built_by=identity(), options=options, triton=triton)


def _options_compiled_here() -> list[dict]:
    """Every distinct set of backend options this process compiled a graph with (compile_pass.reports())."""
    from .report import reports

    found: list[dict] = []
    for report in reports():
        if report.options:
            options = json.loads(json.dumps(report.options, sort_keys=True, default=repr))
            if options not in found:
                found.append(options)
    return found


class _Refused(ValueError):
    """A file that must not load, and why (with who built it and the options it was built with, where its header
    says)."""

    def __init__(self, why: str, built_by: dict | None = None, options: list | None = None):
        super().__init__(why)
        self.built_by = built_by or {}
        self.options = list(options or [])


def _read(raw: bytes, kind: str) -> tuple[dict, bytes, list[dict]]:
    """(header, torch's bytes, the Triton entries) of a file's contents of this kind, format and identity;
    _Refused saying what is wrong with it. Nothing is written here."""
    if not raw.startswith(MAGIC):
        raise _Refused("not a torch-syncfree artifacts file (compile_pass.cache.save_artifacts writes them)")
    start = len(MAGIC) + 8
    if len(raw) < start:
        raise _Refused("the file is truncated")
    (size,) = struct.unpack("<Q", raw[len(MAGIC):start])
    try:
        header = json.loads(raw[start:start + size])
    except ValueError:
        raise _Refused("its header is damaged") from None
    if not isinstance(header, dict):
        raise _Refused("its header is damaged")
    built_by = {k: v for k, v in header.items() if k not in _NOT_IDENTITY}
    options = header.get("options") if isinstance(header.get("options"), list) else []
    if header.get("format") != FORMAT:
        raise _Refused(f"it is of file format {header.get('format')!r}, written by another version of "
                       f"torch-syncfree (this one reads format {FORMAT}): build it again", built_by, options)
    blob = raw[start + size:]
    if len(blob) != header.get("torch_bytes") or hashlib.sha256(blob).hexdigest() != header.get("sha256"):
        raise _Refused("its contents are damaged (size or checksum)", built_by, options)
    try:
        entries = _triton_cache.decode(header.get("triton_kernels", []))
    except ValueError as e:
        raise _Refused(str(e), built_by, options) from None
    found = header.get("kind", ARTIFACTS)
    if found != kind:
        raise _Refused("it is " + ("a compiled step (aot_compile's save_compiled_function): load it with "
                                   "compile_pass.cache.load_compiled" if found == STEP else
                                   "an artifacts file (save_artifacts): load it with compile_pass.cache.load_artifacts"
                                   if found == ARTIFACTS else f"of kind {found!r}"), built_by, options)
    differs = _mismatches(header, identity())
    if differs:
        raise _Refused("built with " + ", ".join(differs), built_by, options)
    return header, blob, entries


def _write_triton(entries: list[dict]) -> dict:
    """The package's Triton binaries into this process's Triton cache; an OSError is counted, not raised (the
    kernels then JIT as without them)."""
    if not entries:
        return {}
    try:
        return _triton_cache.write(entries)
    except OSError as e:  # the cache directory itself cannot be made
        return dict(kernels=len(entries), written=0, present=0, conflicts=0, failed=len(entries), dirs=[],
                    error=f"{type(e).__name__}: {str(e)[:200]}")


def load_artifacts(path: str | Path, *, strict: bool = False, options: dict | None = None) -> ArtifactsInfo:
    """Load an artifacts file into this process's caches, before the first call of the step. Where the file is
    missing, damaged or built elsewhere (other versions, other rules), or, given `options` (the step's backend
    options, as compile_pass.compile takes them), built with none of those options: warn (ArtifactsMismatch)
    naming why, load nothing and return a falsy result (the step then compiles normally); strict=True raises
    ArtifactsError instead. The result's `options` lists the option sets the file was built with."""
    from .post_grad_check import save_findings

    wanted = normalized_options(options) if options is not None else None

    def refuse(why: str, built_by: dict | None = None, built_options: list | None = None) -> ArtifactsInfo:
        message = f"syncfree: cache artifacts {path} not loaded: {why}"
        if strict:
            raise ArtifactsError(message)
        warnings.warn(message + "; the step compiles as without them", ArtifactsMismatch, stacklevel=3)
        return ArtifactsInfo(str(path), loaded=False, reason=why, built_by=built_by or {},
                             options=list(built_options or []))

    try:
        header, blob, entries = _read(Path(path).read_bytes(), ARTIFACTS)
    except OSError as e:
        return refuse(f"cannot read it ({e.strerror or e})")
    except _Refused as e:
        return refuse(str(e), e.built_by, e.options)
    built_by = {k: v for k, v in header.items() if k not in _NOT_IDENTITY}
    built_options = list(header.get("options") or [])
    differs = _options_differ(built_options, wanted) if wanted is not None else None
    if differs:
        return refuse(f"built with {differs}", built_by, built_options)
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
    triton = _write_triton(entries)
    return ArtifactsInfo(str(path), counts={**counts, "syncfree_findings": len(findings),
                                            "triton_kernels": len(entries)}, built_by=built_by,
                         options=built_options, triton=triton)


# -- AOT precompile: the Dynamo trace saved too (where torch has aot_compile) ----------------------------------------
def _require_aot() -> None:
    why = _compat.aot_compile_supported()
    if why:
        raise ArtifactsError(f"{why}: AOT precompile needs torch >= 2.12; use save_artifacts / load_artifacts, "
                             "which every supported torch has")


class CompiledStep:
    """aot_compile's result: callable as torch's AOT-compiled function is (its other attributes are torch's);
    `save_compiled_function(path)` writes one file with torch's compiled function, the package's Triton binaries
    and who built it, which load_compiled reads."""

    def __init__(self, compiled, options: dict | None = None):
        self.compiled = compiled
        self.options = options  # normalized: what the file records and load_compiled compares

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name):
        if name == "compiled":
            raise AttributeError(name)
        return getattr(self.compiled, name)

    def save_compiled_function(self, path: str | Path, external_data: dict | None = None) -> ArtifactsInfo:
        path = Path(path)
        blob = _compat.compiled_function_bytes(self.compiled, str(path.parent), external_data)
        options = [self.options] if self.options is not None else []
        triton = _write(path, STEP, blob, options=options)
        return ArtifactsInfo(str(path), counts={"torch_bytes": len(blob), "triton_kernels": triton["kernels"]},
                             built_by=identity(), options=options, triton=triton)


def aot_compile(fn: Callable, args: tuple, kwargs: dict | None = None, *, max_context_len: int,
                **options) -> CompiledStep:
    """Compile `fn` through the backend for these example inputs, Dynamo's trace included; the result is callable
    and has save_compiled_function(path). Options as compile_pass.compile's (fullgraph is implied)."""
    from .backend import syncfree_backend
    from .options import SyncfreeOptions

    _require_aot()
    options = {"max_context_len": max_context_len, **options}
    recorded = normalized_options(SyncfreeOptions.from_dict(options))
    with _compat.aot_compile_enabled():
        compiled = torch.compile(fn, backend=syncfree_backend, options=options, fullgraph=True)
    with _compat.capture_scalar_outputs():
        try:
            return CompiledStep(_compat.aot_compile(compiled, args, kwargs or {}), recorded)
        except RuntimeError as e:
            if "SerializableCallable" not in str(e):
                raise
            raise ArtifactsError("this step cannot be AOT-compiled: the backend's result is not one torch can "
                                 f"save ({str(e).splitlines()[0][:200]}); use save_artifacts / load_artifacts") from e


class LoadedStep:
    """An AOT-compiled step read back: its guards are checked on each call; inputs they do not cover go to
    `fallback` (the normal compile). `info` says what was loaded (its `triton`: the package's binaries written)."""

    def __init__(self, compiled, fallback: Callable | None, path: str, info: ArtifactsInfo | None = None):
        self.compiled = compiled
        self.fallback = fallback
        self.path = path
        self.info = info if info is not None else ArtifactsInfo(path, loaded=compiled is not None)
        if compiled is not None:
            compiled.disable_guard_check()  # checked here, once per call

    def __call__(self, *args, **kwargs):
        if self.compiled is not None and self.compiled.guard_check(*args, **kwargs):
            return self.compiled(*args, **kwargs)
        if self.fallback is None:
            raise ArtifactsError(f"the step loaded from {self.path} does not cover these inputs (Dynamo's guards "
                                 "fail) and no fallback was given")
        return self.fallback(*args, **kwargs)


def load_compiled(path: str | Path, fallback: Callable | None = None, *, strict: bool = False,
                  options: dict | None = None) -> LoadedStep:
    """Read a step saved by aot_compile(...).save_compiled_function(path), and write the package's Triton binaries
    it holds into this process's Triton cache. A file that does not load (another torch, GPU, version of this
    package or of its rules, damaged), or that was built with other backend options than the step's (`options`,
    as compile_pass.compile takes them; by default the options `fallback` was compiled with, where it was
    compiled by compile_pass.compile or torch.compile(backend="syncfree")), warns (ArtifactsMismatch), writes
    nothing and every call goes to `fallback`, e.g. compile_pass.compile(step, ...); strict=True raises instead.
    A file of torch's own format (an older save_compiled_function's) loads as torch reads it, without binaries
    and without options to compare."""
    built_by: dict = {}
    built_options: list = []
    wanted = normalized_options(options) if options is not None else (options_of(fallback) if fallback is not None
                                                                       else None)
    try:
        _require_aot()
        raw = Path(path).read_bytes()
        if raw.startswith(MAGIC):
            header, blob, entries = _read(raw, STEP)
            built_by = {k: v for k, v in header.items() if k not in _NOT_IDENTITY}
            built_options = list(header.get("options") or [])
            differs = _options_differ(built_options, wanted) if wanted is not None else None
            if differs:
                raise _Refused(f"built with {differs}", built_by, built_options)
        else:
            blob, entries = raw, []
        compiled = _compat.load_compiled_function_bytes(blob)
    except Exception as e:  # noqa: BLE001  (torch raises many kinds here: version checks, unpickling)
        if isinstance(e, _Refused):
            why = str(e)
            built_by, built_options = e.built_by, e.options
        else:
            first = log.first_line(e, 300)
            why = f"{type(e).__name__}: {first}"
        message = f"syncfree: compiled step {path} not loaded ({why})"
        if strict or fallback is None:
            raise ArtifactsError(message + ("" if strict else "; no fallback was given")) from e
        warnings.warn(message + "; calls go to the fallback compile", ArtifactsMismatch, stacklevel=2)
        return LoadedStep(None, fallback, str(path), ArtifactsInfo(str(path), loaded=False, reason=why,
                                                                   built_by=built_by, options=built_options))
    triton = _write_triton(entries)
    info = ArtifactsInfo(str(path), counts={"torch_bytes": len(blob), "triton_kernels": len(entries)},
                         built_by=built_by, options=built_options, triton=triton)
    return LoadedStep(compiled, fallback, str(path), info)

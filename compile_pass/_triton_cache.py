"""This package's own Triton kernels in Triton's cache (issue 29): the cache entries this process compiled or
loaded for them, read for compile_pass.cache to ship, and written into the Triton cache of the process that loads.

The kernels of kernels/ (page_table, paged_decode's split and combine, ...) are @triton.jit functions that custom
ops launch outside Inductor, so torch's mega-cache does not carry their binaries: each one JITs at its first launch
in a process whose Triton cache lacks it (1.85 s of a precompiled start's first call on an H200).

Which entries are ours: Triton reports every compile and every cache hit to `triton.knobs.compilation.listener`,
with the source (its `fn`, the @triton.jit function) and the paths of the entry's files. `install()`, called at
`import compile_pass`, chains a listener (the one already set still runs) that records an entry when the compiled
function is defined in a module of this package (`compile_pass.*`, kernels/ included):
- by the function's module, not its name: another library's kernel of the same name is not ours, and a kernel
  added to or renamed in kernels/ needs no list;
- by the paths Triton itself reported: the directory it really used (Inductor points TRITON_CACHE_DIR at its own
  cache when it builds its first kernel launcher in a process that did not set it), and only what this process
  compiled or loaded, never a stale entry of an older build left in a cache directory.

A Triton cache entry (triton 3.6 through 3.8) is a directory named by its key (a hash of the kernel's source, its
options, the target and Triton's version: an entry is only ever read by the same compile) holding `<name>.json`
(the metadata), the IR and binary files (`.cubin`, ...) and `__grp__<name>.json`, which lists the files' paths.
Triton serves a hit when the group file exists and every path in it does. Writing an entry writes its files, then
the group file with this machine's paths. A file already there with other content is never replaced (that entry is
left to Triton, which compiles it again), and an entry whose group file exists is left as it is.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import uuid
from pathlib import Path

_PACKAGE = __name__.partition(".")[0]  # "compile_pass"; kernels/ imports as compile_pass.kernels
_LOCK = threading.Lock()
_SEEN: dict[str, dict] = {}  # entry directory -> {"key", "name", "files": {file name: path}}


def _knobs():
    try:
        from triton import knobs
    except ImportError:  # no triton, or one without knobs (older than torch 2.11's)
        return None
    return knobs


def is_package_kernel(src) -> bool:
    """Is the Triton source `src` (triton.compiler.ASTSource) one of this package's @triton.jit functions?"""
    jit = getattr(src, "fn", None)
    module = getattr(getattr(jit, "fn", None), "__module__", None) or getattr(jit, "__module__", None)
    return isinstance(module, str) and (module == _PACKAGE or module.startswith(_PACKAGE + "."))


def _plain(name) -> bool:
    """A file or directory name that stays inside the directory it is joined to."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\x00" not in name


def _record(src, metadata_group) -> None:
    if not metadata_group or not is_package_kernel(src):
        return
    name = str(getattr(src, "name", "") or "")[:150]  # Triton's own truncation of the file names
    meta = metadata_group.get(f"{name}.json")
    if not _plain(name) or meta is None:
        return
    directory = os.path.dirname(os.path.abspath(meta))
    files = {}
    for child, path in metadata_group.items():
        path = os.path.abspath(path)
        if not _plain(child) or os.path.dirname(path) != directory or os.path.basename(path) != child:
            return  # not the file cache's layout (a custom cache manager): nothing to ship
        files[child] = path
    with _LOCK:
        _SEEN[directory] = dict(key=os.path.basename(directory), name=name, files=files)


def install() -> bool:
    """Record this package's Triton compiles and cache hits from now on; False where this triton cannot say."""
    knobs = _knobs()
    compilation = getattr(knobs, "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        return False
    previous = compilation.listener
    if getattr(previous, "_syncfree_recorder", False):  # compile_pass imported again: replace ours, keep the chain
        previous = previous._syncfree_previous

    def listener(*args, **kwargs):
        try:
            _record(kwargs.get("src", args[0] if args else None),
                    kwargs.get("metadata_group", args[2] if len(args) > 2 else None))
        except Exception:  # noqa: BLE001  (recording must never break a compile)
            pass
        if previous is not None:
            previous(*args, **kwargs)

    listener._syncfree_recorder = True
    listener._syncfree_previous = previous
    compilation.listener = listener
    return True


def installed() -> bool:
    knobs = _knobs()
    return getattr(getattr(getattr(knobs, "compilation", None), "listener", None), "_syncfree_recorder", False)


def recorded() -> list[dict]:
    """The entries recorded so far: {"key", "name", "files": {file name: path}}, one per key."""
    with _LOCK:
        seen = [dict(e, files=dict(e["files"])) for e in _SEEN.values()]
    out: dict[str, dict] = {}
    for entry in sorted(seen, key=lambda e: (e["name"], e["key"])):
        out.setdefault(entry["key"], entry)
    return list(out.values())


def collect() -> list[dict]:
    """The recorded entries with their files' bytes: {"key", "name", "files": {file name: bytes}}. An entry whose
    files are gone since (a cache directory cleaned) is left out."""
    entries = []
    for entry in recorded():
        try:
            files = {child: Path(path).read_bytes() for child, path in sorted(entry["files"].items())}
        except OSError:
            continue
        entries.append(dict(key=entry["key"], name=entry["name"], files=files))
    return entries


def encode(entries: list[dict]) -> list[dict]:
    """JSON-ready: each file's bytes in base64 with its sha256."""
    return [dict(key=e["key"], name=e["name"],
                 files={child: dict(sha256=hashlib.sha256(data).hexdigest(), data=base64.b64encode(data).decode())
                        for child, data in e["files"].items()}) for e in entries]


def decode(items) -> list[dict]:
    """encode's inverse; ValueError when an entry is malformed or a file's checksum does not match."""
    if not isinstance(items, list):
        raise ValueError("its Triton kernels are damaged")
    entries = []
    for item in items:
        try:
            key, name, files = item["key"], item["name"], item["files"]
            if not (_plain(key) and _plain(name) and isinstance(files, dict) and f"{name}.json" in files
                    and all(_plain(child) and not child.startswith("__grp__") for child in files)):
                raise ValueError
            decoded = {}
            for child, f in files.items():
                data = base64.b64decode(f["data"], validate=True)
                if hashlib.sha256(data).hexdigest() != f["sha256"]:
                    raise ValueError
                decoded[child] = data
        except (KeyError, TypeError, ValueError):
            raise ValueError("its Triton kernels are damaged (a malformed entry or a checksum)") from None
        entries.append(dict(key=key, name=name, files=decoded))
    return entries


def cache_dirs() -> list[str]:
    """Where this process's Triton will look for the package's kernels: TRITON_CACHE_DIR, else Triton's default
    (~/.triton/cache) and the directory Inductor sets TRITON_CACHE_DIR to when it builds its first kernel launcher
    (<Inductor's cache>/triton/<device>), which a kernel launched after that uses."""
    knobs = _knobs()
    cache = getattr(knobs, "cache", None)
    dirs = [getattr(cache, "dir", None) or os.environ.get("TRITON_CACHE_DIR")
            or os.path.join(os.path.expanduser("~"), ".triton", "cache")]
    if os.environ.get("TRITON_CACHE_DIR") is None:
        import torch

        from . import _compat

        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        dirs.append(_compat.inductor_triton_cache_dir(device))
    return list(dict.fromkeys(os.path.abspath(d) for d in dirs))


def _put(path: Path, data: bytes) -> bool:
    """Write `path` unless it exists; True when it then holds `data` (False: another content was there)."""
    tmp = path.with_name(f"{path.name}.tmp.pid_{os.getpid()}_{uuid.uuid4().hex}")
    tmp.write_bytes(data)
    try:
        try:
            os.link(tmp, path)  # atomic, and never replaces a file that appeared meanwhile
        except FileExistsError:
            return path.read_bytes() == data
        except OSError:  # a file system without hard links
            if path.exists():
                return path.read_bytes() == data
            os.replace(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _write_entry(directory: Path, entry: dict) -> str:
    group = directory / f"__grp__{entry['name']}.json"
    if group.exists():
        return "present"  # Triton's own entry, or one written before: left as it is
    for child, data in entry["files"].items():
        path = directory / child
        if path.exists() and path.read_bytes() != data:
            return "conflicts"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for child, data in entry["files"].items():
            if not _put(directory / child, data):
                return "conflicts"
        paths = {child: str(directory / child) for child in entry["files"]}
        _put(group, json.dumps({"child_paths": paths}).encode())
    except OSError:
        return "failed"
    return "written"


def write(entries: list[dict], dirs: list[str] | None = None) -> dict:
    """Write the entries into each of `dirs` (default cache_dirs()): counts of entries written, already present,
    left because another file was in the way (conflicts) and failed (a read-only or full disk), and the dirs."""
    dirs = cache_dirs() if dirs is None else dirs
    counts = dict(written=0, present=0, conflicts=0, failed=0)
    for d in dirs:
        for entry in entries:
            counts[_write_entry(Path(d) / entry["key"], entry)] += 1
    return dict(kernels=len(entries), **counts, dirs=list(dirs))

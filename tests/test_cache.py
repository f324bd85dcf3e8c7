"""Compile caches (issue 29, and issue 27 item 4): the post-grad check's uuid is a true cache identity, a second
process hits the FX graph cache and AOT autograd's cache for the same syncfree step and misses when an option,
a fact or the pass's code changes, and shipped artifacts (compile_pass.cache) load in a fresh process with empty
caches without compiling again, or warn and compile normally when they do not match."""

import base64
import json
import os
import pathlib
import re
import struct
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import compile_pass
import compile_pass.cache as cache
from compile_pass.options import SyncfreeOptions
from compile_pass.post_grad_check import SyncFreeCheck

pytestmark = pytest.mark.inductor


def uuid_of(**options) -> str:
    return SyncFreeCheck(SyncfreeOptions.from_dict({"max_context_len": 64, **options}).fingerprint()).uuid()


# -- the uuid (no compile) -----------------------------------------------------------------------------------------
def test_uuid_is_stable_and_follows_every_option_that_changes_the_rewrite():
    base = uuid_of()
    assert uuid_of() == base
    changed = [uuid_of(max_context_len=128), uuid_of(checked=False), uuid_of(length_bounds={"verify_lens": 8}),
               uuid_of(page_size=16), uuid_of(static_escapes=True), uuid_of(cpu_mirrors={"a_cpu": "a"})]
    assert len({base, *changed}) == len(changed) + 1


@torch.library.custom_op("cachetest::flat_reader", mutates_args=())
def flat_reader(indices: torch.Tensor, indptr: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return indices.new_zeros(lengths.shape)


@flat_reader.register_fake
def _(indices, indptr, lengths):
    return indices.new_empty(lengths.shape)


def test_uuid_follows_registered_facts():
    import consumers_for_tests  # noqa: F401  (its ops)
    from compile_pass.rules.bounded_writers import register_bounded_writer, unregister_bounded_writer
    from compile_pass.rules.flat_kv_indices import register_indptr_reader, unregister_flat_kv_facts

    base = uuid_of()
    op = torch.ops.syncfree_test.unguarded_sum.default
    compile_pass.register_self_guarding_consumer(op, page_table="page_table", lengths="lens")
    try:
        consumer = uuid_of()
    finally:
        compile_pass.unregister_self_guarding_consumer(op)
    register_bounded_writer("cachetest_module:writer_kernel", table="t", lengths="lens", page_size=16)
    try:
        writer = uuid_of()
    finally:
        unregister_bounded_writer("cachetest_module:writer_kernel")
    register_indptr_reader(torch.ops.cachetest.flat_reader.default, indices="indices", indptr="indptr",
                           lengths="lengths")
    try:
        reader = uuid_of()
    finally:
        unregister_flat_kv_facts(torch.ops.cachetest.flat_reader.default)
    assert len({base, consumer, writer, reader}) == 4
    assert uuid_of() == base  # unregistering gives the old identity back


def test_uuid_follows_the_rules_and_the_source(monkeypatch):
    import compile_pass.post_grad_check as post_grad_check
    import compile_pass.rules as rules

    base = uuid_of()
    real = rules.rules_fingerprint()
    monkeypatch.setattr(rules, "rules_fingerprint", lambda: real + "a rule's source changed")
    edited_rule = uuid_of()
    monkeypatch.undo()
    assert uuid_of() == base
    monkeypatch.setattr(post_grad_check, "source_hash", lambda: "another source")
    assert len({base, edited_rule, uuid_of()}) == 3


def test_source_hash_covers_the_kernels():
    from compile_pass.post_grad_check import _package_dirs

    import compile_pass.kernels as kernels

    assert any(os.path.samefile(d, os.path.dirname(kernels.__file__)) for d in _package_dirs())


def test_findings_key_ignores_machine_dependent_inductor_settings():
    from torch._inductor import config

    from compile_pass import _compat

    before = _compat.inductor_cache_config_fingerprint()
    with config.patch(compile_threads=(config.compile_threads or 1) + 7):
        assert _compat.inductor_cache_config_fingerprint() == before
    with config.patch(max_autotune=not config.max_autotune):
        assert _compat.inductor_cache_config_fingerprint() != before


# -- artifacts files that must not load (no compile) ---------------------------------------------------------------
def _refused(path, match):
    with pytest.warns(cache.ArtifactsMismatch, match=match):
        info = cache.load_artifacts(path)
    assert not info and not info.loaded and info.reason
    with pytest.raises(cache.ArtifactsError, match=match):
        cache.load_artifacts(path, strict=True)
    return info


def _forge(path, blob=b"torch bytes", **header):
    import hashlib
    import struct

    head = {**cache.identity(), "findings": {}, "torch_bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
            **header}
    data = json.dumps(head).encode()
    path.write_bytes(cache.MAGIC + struct.pack("<Q", len(data)) + data + blob)
    return path


def test_foreign_damaged_and_missing_files_warn_and_load_nothing(tmp_path):
    _refused(tmp_path / "missing.bin", "cannot read it")
    (tmp_path / "other.bin").write_bytes(b"PK\x03\x04 a zip, say")
    _refused(tmp_path / "other.bin", "not a torch-syncfree artifacts file")
    foreign = "2.10.0+cu128" if torch.__version__ != "2.10.0+cu128" else "2.11.0+cu130"  # not the torch running
    info = _refused(_forge(tmp_path / "torch.bin", torch=foreign), f"torch '{re.escape(foreign)}'")
    assert info.built_by["torch"] == foreign
    _refused(_forge(tmp_path / "gpu.bin", cuda="NVIDIA H100 (sm90, CUDA 12.8)"), "cuda 'NVIDIA H100")
    _refused(_forge(tmp_path / "code.bin", torch_syncfree_source="0" * 64), "torch_syncfree_source")
    # A file of the format before the Triton binaries (an older torch-syncfree's): refused, naming the format.
    _refused(_forge(tmp_path / "format1.bin", format=1), "file format 1.*build it again")
    _refused(_forge(tmp_path / "step.bin", kind=cache.STEP), "a compiled step.*load_compiled")
    damaged = _forge(tmp_path / "damaged.bin")
    damaged.write_bytes(damaged.read_bytes()[:-3] + b"xyz")
    _refused(damaged, "damaged")
    # A well-formed file whose torch part torch cannot read: torch says so in its log, we in a warning.
    _refused(_forge(tmp_path / "garbage.bin", blob=b"\x00\x01 not torch's format"), "torch could not read")



# -- the options, rules and versions a file was built with (issue 44, item 2; no compile) -------------------------
def _header(path) -> dict:
    raw = pathlib.Path(path).read_bytes()
    start = len(cache.MAGIC) + 8
    (size,) = struct.unpack("<Q", raw[len(cache.MAGIC):start])
    return json.loads(raw[start:start + size])


@pytest.fixture
def built_at_64(tmp_path, monkeypatch):
    """An artifacts file saved by a process whose only syncfree compiles used max_context_len=64 (torch's part
    stubbed: no compile)."""
    from compile_pass import _compat
    from compile_pass import report as report_module

    graphs = [compile_pass.SyncReport(options=SyncfreeOptions.from_dict({"max_context_len": 64}).to_dict())] * 2
    monkeypatch.setattr(report_module, "_ALL", __import__("collections").deque(graphs))
    monkeypatch.setattr(_compat, "save_cache_artifacts", lambda: b"torch bytes")
    monkeypatch.setattr(_compat, "load_cache_artifacts", lambda blob: {"inductor": 1})
    return cache.save_artifacts(tmp_path / "a.bin")


def test_a_saved_file_records_its_options_rules_and_versions(built_at_64):
    from compile_pass.rules import rules_fingerprint

    header = _header(built_at_64.path)
    at_64 = cache.normalized_options({"max_context_len": 64})
    assert header["options"] == [at_64] and built_at_64.options == [at_64]  # one entry per distinct option set
    assert header["rules"] == rules_fingerprint() and header["format"] == cache.FORMAT == 3
    assert {"torch", "triton", "python", "cuda", "torch_syncfree_source"} <= set(header)
    info = cache.load_artifacts(built_at_64.path)  # no options given: loaded, and info says what it was built with
    assert info and info.options == [at_64] and info.built_by["rules"] == rules_fingerprint()


def test_artifacts_built_with_other_options_are_refused(built_at_64):
    path = built_at_64.path
    with pytest.warns(cache.ArtifactsMismatch, match=r"other options: max_context_len 64 \(this step: 128\); "
                                                     "the step compiles as without them"):
        info = cache.load_artifacts(path, options={"max_context_len": 128})
    assert not info and info.reason == "built with other options: max_context_len 64 (this step: 128)"
    assert info.options == [cache.normalized_options({"max_context_len": 64})]
    with pytest.raises(cache.ArtifactsError, match=r"checked True \(this step: False\)") as raised:
        cache.load_artifacts(path, strict=True, options={"max_context_len": 64, "checked": False})
    assert "compiles as without them" not in str(raised.value)  # it raised: nothing compiles
    assert cache.load_artifacts(path, strict=True, options={"max_context_len": 64})  # the same options: loads


def test_a_file_of_other_rules_or_versions_is_refused(tmp_path):
    for field, value in (("rules", "0" * 64), ("torch_syncfree_source", "1" * 64)):
        info = _refused(_forge(tmp_path / f"{field}.bin", **{field: value}), f"{field} '{value[:12]}\\.\\.\\.'")
        assert info.built_by[field] == value
    with pytest.raises(cache.ArtifactsError) as raised:
        cache.load_artifacts(tmp_path / "missing.bin", strict=True)
    assert "compiles as without them" not in str(raised.value)


class _LoadedFunction:
    """What torch's load_compiled_function returns, as far as LoadedStep uses it."""

    def disable_guard_check(self):
        pass

    def guard_check(self, *args, **kwargs):
        return True

    def __call__(self, *args):
        return "the saved step"


def _step_file(path, options) -> pathlib.Path:
    return _forge(path, kind=cache.STEP, options=[cache.normalized_options(o) for o in options])


def test_load_compiled_refuses_a_step_built_with_the_fallback_s_other_options(tmp_path, monkeypatch):
    """The issue's case: saved at max_context_len=64, loaded with a fallback compiled at 128. A length of 100 would
    then raise in the saved step: the file is refused and every call goes to the fallback."""
    from compile_pass import _compat

    monkeypatch.setattr(_compat, "aot_compile_supported", lambda: None)
    monkeypatch.setattr(_compat, "load_compiled_function_bytes", lambda blob: _LoadedFunction())
    path = _step_file(tmp_path / "step.aot", [{"max_context_len": 64}])
    at_128 = compile_pass.compile(_decode, max_context_len=128)  # not called: no compile
    with pytest.warns(cache.ArtifactsMismatch, match=r"max_context_len 64 \(this step: 128\).*calls go to the "
                                                     "fallback compile"):
        step = cache.load_compiled(path, at_128)
    assert step.compiled is None and step.fallback is at_128 and not step.info.loaded
    assert step.info.reason == "built with other options: max_context_len 64 (this step: 128)"
    assert step.info.options == [cache.normalized_options({"max_context_len": 64})]
    by_name = torch.compile(_decode, backend="syncfree", options={"max_context_len": 128})  # the same, by name
    with pytest.raises(cache.ArtifactsError, match="max_context_len 64") as raised:
        cache.load_compiled(path, by_name, strict=True)
    assert "fallback" not in str(raised.value)  # it raised: no call goes anywhere
    with pytest.warns(cache.ArtifactsMismatch, match="cudagraphs False"):
        cache.load_compiled(path, lambda *a: None, options={"max_context_len": 64, "cudagraphs": True})
    # The same options (from the fallback, or given): it loads.
    same = cache.load_compiled(path, compile_pass.compile(_decode, max_context_len=64))
    assert same.info.loaded and same() == "the saved step"
    assert cache.load_compiled(path, options={"max_context_len": 64}).info.loaded
    # A fallback whose options are unknown (a plain function): nothing to compare, it loads.
    assert cache.load_compiled(path, _decode).info.loaded


def test_an_aot_compiled_step_records_its_options_and_refuses_other_ones(tmp_path):
    from compile_pass import _compat

    if _compat.aot_compile_supported() is not None:
        pytest.skip(_compat.aot_compile_supported())
    args = _inputs()
    aot = cache.aot_compile(_decode, args, max_context_len=64)
    saved = aot.save_compiled_function(tmp_path / "step.aot")
    assert saved.options == [cache.normalized_options({"max_context_len": 64})]
    assert _header(tmp_path / "step.aot")["options"] == saved.options
    fallback = compile_pass.compile(_decode, max_context_len=128)
    with pytest.warns(cache.ArtifactsMismatch, match="max_context_len 64"):
        step = cache.load_compiled(tmp_path / "step.aot", fallback)
    g = torch.Generator().manual_seed(1)  # a token table 128 wide: a length of 100 fits the fallback's bound only
    q, k, v = torch.randn(3, 1, 4, 8, generator=g), torch.randn(192, 4, 2, 8, generator=g), torch.randn(192, 4, 2, 8)
    long = (q, k, v, torch.randperm(6 * 128, generator=g).to(torch.int32).view(6, 128), torch.tensor([4, 1, 2]),
            torch.tensor([100, 9, 5]))
    torch.testing.assert_close(step(*long), _decode(*long))


# -- the Triton binaries of the package's own kernels (no compile: Triton's cache entries made as it makes them) ---
def _triton_entry(kernel, tag: bytes, cache_hit=None):
    """A Triton cache entry of `kernel` in TRITON_CACHE_DIR, written as triton.compiler.compile writes one
    (Triton's FileCacheManager: the files, then the group file of their paths), and, unless cache_hit is None,
    Triton's report of it to its compilation listener, as at a compile (False) or a cache hit (True).
    (key, name, {file name: bytes})."""
    import hashlib

    import triton
    from triton.compiler import ASTSource
    from triton.runtime.cache import FileCacheManager

    name = kernel.__name__
    key = hashlib.sha256(kernel.__module__.encode() + name.encode() + tag).hexdigest()[:52]
    manager = FileCacheManager(key)
    files = {f"{name}.source": b"# " + name.encode() + tag, f"{name}.ttir": b"module { " + tag + b" }",
             f"{name}.cubin": b"\x7fELF\x02\x01" + hashlib.sha256(tag).digest() * 64,
             f"{name}.json": json.dumps({"name": name, "hash": key, "num_warps": 4}).encode()}
    group = {child: manager.put(data, child) for child, data in files.items()}
    manager.put_group(f"{name}.json", group)
    listener = triton.knobs.compilation.listener  # None where nothing listens (nothing records then)
    if cache_hit is not None and listener is not None:
        listener(src=ASTSource(kernel, {}), metadata=json.loads(files[f"{name}.json"]), metadata_group=group,
                 times=None, cache_hit=cache_hit)
    return key, name, files


def _other_librarys_kernel():
    """A @triton.jit kernel of the package's own name, defined outside the package (another library's)."""
    import triton

    @triton.jit
    def page_table_kernel(x):
        pass

    return page_table_kernel


def _listing(root) -> dict:
    """{path under root: bytes} of every file below it."""
    root = pathlib.Path(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} \
        if root.exists() else {}


def _triton_hit(root, key, name) -> dict | None:
    """What Triton's compile reads for this entry in TRITON_CACHE_DIR=root: the group's files (a cache hit) or
    None (a miss)."""
    from triton.runtime.cache import FileCacheManager

    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(root)
    try:
        return FileCacheManager(key).get_group(f"{name}.json")
    finally:
        if old is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = old


@pytest.fixture
def triton_build(tmp_path, monkeypatch):
    """A build process's Triton cache (TRITON_CACHE_DIR=tmp/build-triton) with entries of two of the package's
    kernels that Triton reported (one compiled, one a cache hit), another library's kernel of the same name as
    ours (reported too), and an older build's entry of ours that this process never used; torch's part of the
    artifacts stubbed (no compile). Returns the package's entries, the others' keys and the saved file."""
    pytest.importorskip("triton")
    from compile_pass import _compat, _triton_cache
    from compile_pass.kernels.page_table_kernel import page_table_kernel
    from compile_pass.kernels.paged_decode_kernel import paged_decode_combine_kernel

    monkeypatch.setattr(_triton_cache, "_SEEN", {})  # this test's compiles only
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "build-triton"))
    ours = [_triton_entry(page_table_kernel, b"a", cache_hit=False),
            _triton_entry(paged_decode_combine_kernel, b"b", cache_hit=True)]
    others = [_triton_entry(_other_librarys_kernel(), b"a", cache_hit=False)[0],
              _triton_entry(page_table_kernel, b"an older build")[0]]  # in the cache, never compiled nor loaded here
    monkeypatch.setattr(_compat, "save_cache_artifacts", lambda: b"torch bytes")
    monkeypatch.setattr(_compat, "load_cache_artifacts",
                        lambda blob: {"inductor": 1} if blob == b"torch bytes" else None)
    saved = cache.save_artifacts(tmp_path / "a.bin")
    return dict(ours=ours, others=others, path=tmp_path / "a.bin", saved=saved)


def test_the_packages_triton_binaries_ship_and_arrive_byte_identical(triton_build, tmp_path, monkeypatch):
    ours, path = triton_build["ours"], triton_build["path"]
    assert triton_build["saved"].counts["triton_kernels"] == 2
    assert triton_build["saved"].triton["names"] == ["page_table_kernel", "paged_decode_combine_kernel"]
    serve = tmp_path / "serve-triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(serve))  # a fresh machine's cache
    info = cache.load_artifacts(path)
    assert info and info.counts["triton_kernels"] == 2
    assert (info.triton["written"], info.triton["conflicts"], info.triton["dirs"]) == (2, 0, [str(serve)])
    arrived = _listing(serve)
    expected = {f"{key}/{child}": data for key, _, files in ours for child, data in files.items()}
    assert {k: v for k, v in arrived.items() if "/__grp__" not in k} == expected  # exactly ours, byte-identical
    for key, name, files in ours:  # Triton's own lookup finds each: the first launch is a cache hit
        assert _triton_hit(serve, key, name) == {child: str(serve / key / child) for child in files}
    for key in triton_build["others"]:
        assert not any(k.startswith(key + "/") for k in arrived)
    # Loading again, or into a cache that has the entries: nothing is written twice.
    again = cache.load_artifacts(path)
    assert (again.triton["written"], again.triton["present"]) == (0, 2) and _listing(serve) == arrived


def test_loading_never_replaces_a_different_file_and_a_foreign_file_writes_no_binary(triton_build, tmp_path,
                                                                                     monkeypatch):
    (key, name, files), path = triton_build["ours"][0], triton_build["path"]
    serve = tmp_path / "serve-triton"
    (serve / key).mkdir(parents=True)
    (serve / key / f"{name}.cubin").write_bytes(b"built on this machine")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(serve))
    info = cache.load_artifacts(path)
    assert info and (info.triton["written"], info.triton["conflicts"]) == (1, 1)
    assert (serve / key / f"{name}.cubin").read_bytes() == b"built on this machine"
    assert not (serve / key / f"__grp__{name}.json").exists()  # that entry is left to Triton (it compiles again)

    # Built elsewhere (another torch, GPU, package version): refused before anything is written.
    raw = path.read_bytes()
    start = len(cache.MAGIC) + 8
    (size,) = struct.unpack("<Q", raw[len(cache.MAGIC):start])
    header = json.loads(raw[start:start + size])
    assert len(header["triton_kernels"]) == 2
    for field, value in (("torch", "2.10.0+cu128"), ("cuda", "NVIDIA H100 (sm90, CUDA 12.8)"),
                         ("torch_syncfree_source", "0" * 64)):
        data = json.dumps({**header, field: value}).encode()
        foreign = tmp_path / f"{field}.bin"
        foreign.write_bytes(cache.MAGIC + struct.pack("<Q", len(data)) + data + raw[start + size:])
        fresh = tmp_path / f"{field}-triton"
        monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
        _refused(foreign, field)
        assert _listing(fresh) == {}
        data = json.dumps({**header, field: value, "kind": cache.STEP}).encode()
        foreign.write_bytes(cache.MAGIC + struct.pack("<Q", len(data)) + data + raw[start + size:])
        with pytest.warns(cache.ArtifactsMismatch, match=f"not loaded.*{field}"):
            step = cache.load_compiled(foreign, fallback=lambda *a: "fallback")
        assert step() == "fallback" and not step.info.loaded and _listing(fresh) == {}
    # A damaged binary (its checksum): refused, nothing written.
    header["triton_kernels"][0]["files"][f"{name}.cubin"]["data"] = base64.b64encode(b"flipped").decode()
    data = json.dumps(header).encode()
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(cache.MAGIC + struct.pack("<Q", len(data)) + data + raw[start + size:])
    fresh = tmp_path / "damaged-triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    _refused(damaged, "Triton kernels are damaged")
    assert _listing(fresh) == {}


def test_without_triton_cache_dir_the_binaries_go_where_triton_and_inductor_will_look(triton_build, tmp_path,
                                                                                     monkeypatch):
    """TRITON_CACHE_DIR unset: Triton's default (TRITON_HOME/.triton/cache) and the directory Inductor sets it to
    when it builds its first kernel launcher (<TORCHINDUCTOR_CACHE_DIR>/triton/<device>)."""
    from compile_pass import _compat

    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    info = cache.load_artifacts(triton_build["path"])
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    dirs = [str(tmp_path / "home" / ".triton" / "cache"), _compat.inductor_triton_cache_dir(device)]
    assert dirs[1].startswith(str(tmp_path / "inductor"))
    assert info.triton["dirs"] == dirs and info.triton["written"] == 4
    for d in dirs:
        assert len([k for k in _listing(d) if k.endswith(".cubin")]) == 2


def test_the_recorder_chains_the_listener_already_set_and_records_the_packages_kernels_only(tmp_path, monkeypatch):
    triton = pytest.importorskip("triton")
    from compile_pass import _triton_cache
    from compile_pass.kernels.page_table_kernel import page_table_kernel

    heard = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: heard.append(kw["cache_hit"]))
    monkeypatch.setattr(_triton_cache, "_SEEN", {})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    previous = triton.knobs.compilation.listener
    assert _triton_cache.install() and _triton_cache.install()  # compile_pass imported twice: one recorder
    assert triton.knobs.compilation.listener._syncfree_previous is previous
    _triton_entry(_other_librarys_kernel(), b"x", cache_hit=False)
    key, name, files = _triton_entry(page_table_kernel, b"x", cache_hit=True)
    assert heard == [False, True]  # the listener that was there still hears every compile
    assert [(e["key"], e["name"], sorted(e["files"])) for e in _triton_cache.recorded()] == [(key, name, sorted(files))]


def test_a_failing_cache_write_warns_and_loads_nothing(tmp_path, monkeypatch):
    from compile_pass import _compat

    def full_disk(blob):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_compat, "load_cache_artifacts", full_disk)
    _refused(_forge(tmp_path / "ok.bin"), "could not write its artifacts.*No space left")


def test_save_without_a_compile_says_what_to_do(tmp_path, monkeypatch):
    from compile_pass import _compat

    monkeypatch.setattr(_compat, "save_cache_artifacts", lambda: None)
    with pytest.raises(cache.ArtifactsError, match="call the compiled step"):
        cache.save_artifacts(tmp_path / "a.bin")


def _decode(q, k, v, r2t, rpi, lens):
    m = lens.max().item()
    table = r2t[rpi, :m:4] // 4
    return torch.ops.syncfree.paged_decode(q, k, v, table.to(torch.int32), lens.to(torch.int32))


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 4, 8, generator=g)
    k, v = torch.randn(96, 4, 2, 8, generator=g), torch.randn(96, 4, 2, 8, generator=g)
    r2t = torch.randperm(6 * 64, generator=g).to(torch.int32).view(6, 64)
    return q, k, v, r2t, torch.tensor([4, 1, 2]), torch.tensor([3, 9, 5])


def test_a_damaged_file_then_a_normal_compile_gives_eager_results(tmp_path):
    path = _forge(tmp_path / "damaged.bin", blob=b"\x00 damaged")
    with pytest.warns(cache.ArtifactsMismatch):
        assert not cache.load_artifacts(path)
    args = _inputs()
    step = compile_pass.compile(_decode, max_context_len=64, fullgraph=True)
    torch.testing.assert_close(step(*args), _decode(*args))
    assert compile_pass.last_report().rewritten


# -- across processes: one fresh cache dir, three processes ---------------------------------------------------------
CHILD = textwrap.dedent('''
    import hashlib, json, os, pathlib, sys, warnings
    import torch, compile_pass, compile_pass.cache as cache
    from compile_pass import _compat
    import compile_pass.backend as backend
    sys.path.insert(0, sys.argv[2])
    from test_cache import _decode, _inputs
    import consumers_for_tests  # registers a consumer at import: the same facts in every process

    compiles = []
    real_compile_fx = _compat.compile_fx
    _compat.compile_fx = lambda gm, ex, p: compiles.append(p.get("fx_graph_cache", True)) or real_compile_fx(gm, ex, p)
    torch._dynamo.config.capture_scalar_outputs = True
    args = _inputs()
    expected = _decode(*args)

    def compile_once(**options):
        torch._dynamo.reset()
        before, n = _compat.compile_cache_counters(), len(compiles)
        # By name, as a user writes it (compile_pass.compile is the same backend with the flag set for you).
        compiled = torch.compile(_decode, backend="syncfree", fullgraph=True,
                                 options={"max_context_len": 64, **options})
        out = compiled(*args)
        after = _compat.compile_cache_counters()
        report = compile_pass.last_report()
        return dict(counters={k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)},
                    compile_fx=compiles[n:], equal=torch.equal(out, expected),
                    rewritten=len(report.rewritten), post_grad=report.post_grad)

    def triton_files():  # {path under TRITON_CACHE_DIR: sha256} of every file there
        root = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in root.rglob("*") if p.is_file()} if root.exists() else {}

    result, mode, ship = {}, sys.argv[1], sys.argv[3]
    if mode == "build":
        result["A"] = compile_once()
        # No Triton compile on CPU: two entries as Triton writes and reports them, ours and another library's
        # kernel of the same name.
        from compile_pass.kernels.page_table_kernel import page_table_kernel
        from test_cache import _other_librarys_kernel, _triton_entry
        key, name, files = _triton_entry(page_table_kernel, b"build", cache_hit=False)
        _triton_entry(_other_librarys_kernel(), b"build", cache_hit=False)
        result["triton_entry"] = dict(key=key, name=name, files={c: hashlib.sha256(d).hexdigest()
                                                                 for c, d in files.items()})
        result["triton_build"] = triton_files()
        result["saved"] = cache.save_artifacts(ship + "/artifacts.bin").counts
        if _compat.aot_compile_supported() is None:
            aot = cache.aot_compile(_decode, args, max_context_len=64)
            aot.save_compiled_function(ship + "/step.aot")
            result["aot_equal"] = torch.equal(aot(*args), expected)
    elif mode == "warm":
        result["A"] = compile_once()
        result["max_context_len"] = compile_once(max_context_len=128)
        result["checked"] = compile_once(checked=False)
        result["length_bounds"] = compile_once(length_bounds={"verify_lens": 8})
        op = torch.ops.syncfree_test.unguarded_sum.default
        compile_pass.register_self_guarding_consumer(op, page_table="page_table", lengths="lens")
        result["fact"] = compile_once()
        compile_pass.unregister_self_guarding_consumer(op)
        import compile_pass.rules as rules
        real = rules.rules_fingerprint
        rules.rules_fingerprint = lambda: real() + "edited"
        result["rule_source"] = compile_once()
        rules.rules_fingerprint = real
        result["A_again"] = compile_once()
    elif mode == "shipped":
        result["loaded"] = cache.load_artifacts(ship + "/artifacts.bin").counts
        result["triton_after_artifacts"] = triton_files()
        result["A"] = compile_once()
        if _compat.aot_compile_supported() is None:
            backend_calls = []
            real_backend = backend._compile_rewritten
            backend._compile_rewritten = lambda *a: backend_calls.append(1) or real_backend(*a)
            torch._dynamo.reset()
            fallback = lambda *a: (_ for _ in ()).throw(AssertionError("the fallback ran"))
            os.environ["TRITON_CACHE_DIR"] = ship + "/step-triton"  # the compiled step alone brings them too
            step = cache.load_compiled(ship + "/step.aot", fallback)
            result["triton_after_step"] = triton_files()
            result["aot"] = dict(equal=torch.equal(step(*args), expected), backend_calls=len(backend_calls))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                open(ship + "/bad.aot", "wb").write(b"not a compiled function")
                bad = cache.load_compiled(ship + "/bad.aot", compile_pass.compile(_decode, max_context_len=64,
                                                                                  fullgraph=True))
                result["aot_bad"] = dict(equal=torch.equal(bad(*args), expected),
                                         warned=[str(w.message) for w in caught
                                                 if issubclass(w.category, cache.ArtifactsMismatch)])
    print("RESULT " + json.dumps(result))
''')


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """The same step in three fresh processes: `build` on an empty cache dir (saves artifacts), `warm` on the
    same dir, `shipped` on another empty dir after loading the artifacts."""
    root = tmp_path_factory.mktemp("caches")
    script = root / "child.py"
    script.write_text(CHILD)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    # this module, consumers_for_tests, and whatever put the package under test on the parent's path
    path = os.pathsep.join([tests_dir, os.path.join(tests_dir, "support"),
                            *filter(None, [os.environ.get("PYTHONPATH")])])

    def run(mode, cache_dir):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / cache_dir),
               "TRITON_CACHE_DIR": str(root / (cache_dir + "-triton")), "PYTHONPATH": path}
        proc = subprocess.run([sys.executable, str(script), mode, tests_dir, str(root)], capture_output=True,
                              text=True, timeout=400, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        return json.loads(line[len("RESULT "):])

    runs = {mode: run(mode, cache_dir) for mode, cache_dir in
            (("build", "inductor"), ("warm", "inductor"), ("shipped", "inductor-empty"))}
    return {**runs, "root": str(root)}


def _hit(run):
    c = run["counters"]
    return c.get("fxgraph_hit", 0) >= 1 and c.get("aot_autograd_hit", 0) >= 1 and not c.get("fxgraph_miss") \
        and not c.get("aot_autograd_miss") and run["compile_fx"] == [True]


def _miss(run):
    c = run["counters"]
    return c.get("fxgraph_miss", 0) >= 1 and not c.get("fxgraph_hit") and not c.get("aot_autograd_hit")


def test_the_first_process_compiles(processes):
    a = processes["build"]["A"]
    assert a["equal"] and a["rewritten"] == 1 and a["counters"].get("fxgraph_miss", 0) >= 1
    assert processes["build"]["saved"]["syncfree_findings"] >= 1


def test_a_second_process_hits_both_caches(processes):
    a = processes["warm"]["A"]
    assert _hit(a), a  # one compile_fx, with the cache: the stored findings answered for the check
    assert a["equal"] and a["rewritten"] == 1 and a["post_grad"]["local_scalar_dense"] == 0
    assert _hit(processes["warm"]["A_again"])


@pytest.mark.parametrize("change", ["max_context_len", "checked", "length_bounds", "fact", "rule_source"])
def test_what_changes_the_rewrite_misses(processes, change):
    run = processes["warm"][change]
    assert _miss(run), run
    assert run["equal"]


def test_shipped_artifacts_load_into_empty_caches_without_compiling(processes):
    shipped = processes["shipped"]
    assert shipped["loaded"]["syncfree_findings"] >= 1 and shipped["loaded"].get("inductor", 0) >= 1
    a = shipped["A"]
    assert _hit(a), a  # no Inductor, no AOT autograd, no second compile for the findings
    assert a["equal"] and a["rewritten"] == 1 and a["post_grad"]["local_scalar_dense"] == 0


def test_the_packages_triton_binaries_reach_a_fresh_process_through_either_file(processes, tmp_path_factory):
    """The build process's entry of ours (not the other library's kernel of the same name) arrives in the fresh
    process's empty Triton cache byte-identical, from the artifacts file and from the compiled step, and Triton's
    own lookup finds it there (the first launch is a cache hit)."""
    from compile_pass import _compat

    entry, build = processes["build"]["triton_entry"], processes["build"]["triton_build"]
    assert processes["build"]["saved"]["triton_kernels"] == 1 and processes["shipped"]["loaded"]["triton_kernels"] == 1
    expected = {f"{entry['key']}/{child}": sha for child, sha in entry["files"].items()}
    assert all(build[path] == sha for path, sha in expected.items()) and len(build) > len(expected) + 1
    group = f"{entry['key']}/__grp__{entry['name']}.json"
    root = pathlib.Path(processes["root"])
    places = [("triton_after_artifacts", root / "inductor-empty-triton")]
    if _compat.aot_compile_supported() is None:
        places.append(("triton_after_step", root / "step-triton"))
    for field, directory in places:
        arrived = processes["shipped"][field]
        assert set(arrived) == {*expected, group} and all(arrived[p] == sha for p, sha in expected.items()), field
        hit = _triton_hit(directory, entry["key"], entry["name"])
        assert hit == {child: str(directory / entry["key"] / child) for child in entry["files"]}, field


def test_an_aot_compiled_step_loads_without_tracing(processes):
    from compile_pass import _compat

    if _compat.aot_compile_supported() is not None:
        pytest.skip(_compat.aot_compile_supported())
    assert processes["build"]["aot_equal"]
    assert processes["shipped"]["aot"] == {"equal": True, "backend_calls": 0}
    bad = processes["shipped"]["aot_bad"]
    assert bad["equal"] and bad["warned"] and "not loaded" in bad["warned"][0]


def test_aot_compile_names_the_torch_it_needs(monkeypatch):
    from compile_pass import _compat

    monkeypatch.setattr(_compat, "aot_compile_supported", lambda: "torch 2.11.0 has no aot_compile")
    with pytest.raises(cache.ArtifactsError, match="torch >= 2.12.*save_artifacts"):
        cache.aot_compile(_decode, _inputs(), max_context_len=64)
    with pytest.raises(cache.ArtifactsError, match="no fallback"):
        cache.load_compiled("x.aot")
    with pytest.warns(cache.ArtifactsMismatch, match="torch >= 2.12"):
        step = cache.load_compiled("x.aot", fallback=_decode)
    args = _inputs()
    torch.testing.assert_close(step(*args), _decode(*args))


def test_findings_key_covers_region_bodies():
    """A regional step's outer code names its bodies only: two bodies must not share stored findings."""
    from compile_pass.post_grad_check import findings_key

    def outer(body):
        root = torch.nn.Module()
        root.body = torch.fx.symbolic_trace(body)
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_module("body", (x,)))
        return torch.fx.GraphModule(root, graph)

    check = SyncFreeCheck(SyncfreeOptions.from_dict({"max_context_len": 64}).fingerprint())
    a, b = outer(lambda x: x + 1), outer(lambda x: x * 2)
    assert a.code == b.code
    inputs = [torch.zeros(2)]
    assert findings_key(check, a, inputs, {}) != findings_key(check, b, inputs, {})
    assert findings_key(check, a, inputs, {}) == findings_key(check, outer(lambda x: x + 1), inputs, {})


def _writes(q, k, v, r2t, rpi, lens, other):
    m = lens.max().item()
    table = r2t[rpi, :m:4] // 4
    other.add_(1)  # the proof assumes `other` is none of lens, r2t, rpi: a per-call guard checks it
    return torch.ops.syncfree.paged_decode(q, k, v, table.to(torch.int32), lens.to(torch.int32))


def test_an_aot_compiled_step_keeps_the_alias_guard(tmp_path):
    """The backend's per-call check of the inputs the proof assumed distinct is saved with the step: called with
    `other` a view of `lens`, the loaded step runs the untouched graph (eager semantics)."""
    from compile_pass import _compat

    if _compat.aot_compile_supported() is not None:
        pytest.skip(_compat.aot_compile_supported())

    def inputs(alias):
        q, k, v, r2t, rpi, lens = _inputs()
        return q, k, v, r2t, rpi, lens, (lens[:] if alias else torch.tensor([1, 2, 3]))

    aot = cache.aot_compile(_writes, inputs(False), max_context_len=64)
    assert compile_pass.last_report().disjoint_inputs and compile_pass.last_report().rewritten
    aot.save_compiled_function(str(tmp_path / "step.aot"))
    assert (tmp_path / "step.aot").read_bytes().startswith(cache.MAGIC)
    step = cache.load_compiled(tmp_path / "step.aot")
    assert step.info.loaded and step.info.built_by["torch"] == torch.__version__
    # A step file of torch's own format (what save_compiled_function wrote before FORMAT 2) still loads.
    aot.compiled.save_compiled_function(str(tmp_path / "torch.aot"))
    older = cache.load_compiled(tmp_path / "torch.aot")
    assert older.compiled is not None and older.info.counts["triton_kernels"] == 0
    for alias in (False, True):
        got, want = inputs(alias), inputs(alias)
        torch.testing.assert_close(step(*got), _writes(*want))
        torch.testing.assert_close(got[5], want[5])  # the in-place write landed as in eager

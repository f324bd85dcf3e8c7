"""compile_pass.kernel_warmup and kernels/warmup.py: this package's kernels compiled ahead of their first launch.

The claim is that a warm-up compiles exactly the launches the real first call makes (same kernel, grid, argument
dtypes and address alignment, ints and constexprs), from nothing but the layouts a traced graph carries. Here the
kernels are replaced by recorders: a real launch records ("run", ...), a warm-up ("warm", ...), and the two lists
are compared, for each op over many shapes and layouts, and for a traced graph against the eager run of the same
step. The CPU takes the kernels' Triton path (use_triton patched on) with an H200's SM count, so the launch
arguments are those a GPU would get; tests/test_gpu.py checks on the H200 that the first call then compiles none
of them itself.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compile_pass import _compat, kernel_warmup
from compile_pass.kernel_warmup import KernelCall, TensorSpec, kernel_calls, record_calls
from compile_pass.kernels import _triton
from compile_pass.kernels import kv_indices as kv_indices_module
from compile_pass.kernels import page_table as page_table_module
from compile_pass.kernels import paged_decode as paged_decode_module
from compile_pass.kernels.warmup import IMPLEMENTATIONS
from passlib import make_fb, run

KERNEL_MODULES = {
    "page_table_kernel": "compile_pass.kernels.page_table_kernel",
    "paged_decode_split_kernel": "compile_pass.kernels.paged_decode_kernel",
    "paged_decode_combine_kernel": "compile_pass.kernels.paged_decode_kernel",
    "paged_decode_short_kernel": "compile_pass.kernels.paged_decode_short_kernel",
    "kv_indices_kernel": "compile_pass.kernels.kv_indices_kernel",
}


def _described(args) -> tuple:
    """What Triton compiles a launch for: a pointer's dtype and whether its address is a multiple of 16; an int's
    type (i32 or i64) and whether it is 1, a multiple of 16 or neither; a float's type. Two launches alike in
    these (and in grid, constexprs and options) hit one compiled kernel. (The values themselves may differ: a
    fake `empty_like` strides a size-1 dimension as contiguous where eager keeps the input's stride.)"""
    return tuple(_specialized(a) for a in args)


def _specialized(a):
    if hasattr(a, "data_ptr"):
        return ("pointer", a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("bool", a)
    if isinstance(a, int):
        kind = "i32" if -2**31 <= a < 2**31 else "i64"
        return (kind, "one" if a == 1 else "multiple of 16" if a % 16 == 0 else "other")
    if isinstance(a, float):
        return ("fp32",)
    return a


class RecordingKernel:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def run_kernel(*args, **kwargs):
            self.log.append(("run", self.name, tuple(grid), _described(args), kwargs))
        return run_kernel

    def warmup(self, *args, grid, **kwargs):
        for a in args:
            assert not isinstance(a, torch.Tensor), "a warm-up passes no tensor to Triton"
        self.log.append(("warm", self.name, tuple(grid), _described(args), kwargs))


@pytest.fixture
def launches(monkeypatch):
    """The launches made (run and warm), with every kernel of this package a recorder, the Triton path taken on
    CPU tensors and an H200's 132 SMs."""
    import importlib

    log: list = []
    for name, module in KERNEL_MODULES.items():
        monkeypatch.setattr(importlib.import_module(module), name, RecordingKernel(name, log))
    for module in (page_table_module, paged_decode_module, kv_indices_module):
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    monkeypatch.setattr(paged_decode_module, "sm_count", lambda t: 132)
    monkeypatch.setattr(_triton, "device_programs", lambda t, per_sm=4: per_sm * 132)
    for module in (page_table_module, kv_indices_module):
        monkeypatch.setattr(module, "device_programs", lambda t, per_sm=4: per_sm * 132)
    return log


def _split(log):
    runs = [entry[1:] for entry in log if entry[0] == "run"]
    warms = [entry[1:] for entry in log if entry[0] == "warm"]
    return runs, warms


def _call(op: str, *args) -> KernelCall:
    specs = tuple(TensorSpec.of(a) if isinstance(a, torch.Tensor) else a for a in args)
    return KernelCall(op, specs, ())


def _assert_warm_equals_run(launches, op: str, *args):
    IMPLEMENTATIONS[op](*args)
    assert record_calls([_call(op, *args)])[0] == 1
    runs, warms = _split(launches)
    assert runs, f"{op} launched nothing: the case does not test a launch"
    assert warms == runs


def test_each_warmable_name_is_the_schema_name_of_its_op():
    """The backend finds a call by its op's schema name: a name given to @warmable that is not the op's own would
    silently leave that op's kernels to their first launch."""
    assert set(IMPLEMENTATIONS) == {"syncfree::page_table", "syncfree::page_table_", "syncfree::paged_decode",
                                    "syncfree::kv_indices"}
    for name in IMPLEMENTATIONS:
        op = getattr(torch.ops.syncfree, name.split("::")[1]).default
        assert op._schema.name == name


# -- each op: its warm-up launches are its real launches ----------------------------------------------------------
def _view(values: torch.Tensor, layout: str) -> torch.Tensor:
    """`values` as a contiguous tensor, a column of a [B, 3] matrix (offset 1) or every other element (offset 1)."""
    if layout == "contiguous":
        return values.clone()
    if layout == "column":
        meta = torch.zeros(values.shape[0], 3, dtype=values.dtype)
        meta[:, 1] = values
        return meta[:, 1]
    base = torch.zeros(2 * values.shape[0] + 1, dtype=values.dtype)
    base[1::2] = values
    return base[1::2]


LAYOUTS = st.sampled_from(["contiguous", "column", "step2"])


# Each example clears the fixture's log first (and sets the path it tests).
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 9), page_size=st.sampled_from([1, 16, 64]), max_pages=st.integers(1, 300),
       reqs=st.integers(1, 6), index_layout=LAYOUTS, lens_layout=LAYOUTS,
       index_dtype=st.sampled_from([torch.int32, torch.int64]), in_place=st.booleans(), checked=st.booleans())
def test_page_table_warm_up_is_its_launch(launches, batch, page_size, max_pages, reqs, index_layout, lens_layout,
                                         index_dtype, in_place, checked):
    launches.clear()
    r2t = torch.arange(reqs * 256, dtype=torch.int32).view(reqs, 256)
    rpi = _view(torch.arange(batch, dtype=index_dtype) % reqs, index_layout)
    lens = _view(torch.ones(batch, dtype=index_dtype), lens_layout)  # within every bound: checked passes
    if in_place:
        table = torch.zeros(batch + 2, max_pages, dtype=torch.int32)
        _assert_warm_equals_run(launches, "syncfree::page_table_", table, r2t, rpi, lens, page_size, checked)
    else:
        _assert_warm_equals_run(launches, "syncfree::page_table", r2t, rpi, lens, page_size, max_pages, checked)


# Each example clears the fixture's log first (and sets the path it tests).
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 64), hkv=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 4, 8]),
       dim=st.sampled_from([16, 64, 128]), page_size=st.sampled_from([1, 16, 64]), width=st.integers(1, 512),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), path=st.sampled_from(["split", "short"]),
       q_offset=st.booleans())
def test_paged_decode_warm_up_is_its_launch(launches, monkeypatch, batch, hkv, group, dim, page_size, width, dtype,
                                           path, q_offset):
    launches.clear()
    monkeypatch.setitem(paged_decode_module.SHORT_TUNING, "path", path)
    shape = (batch, 1, hkv * group, dim)
    # q as a slice of a wider buffer (storage offset, a row stride not of its own shape) or on its own
    q = torch.zeros(batch, 1, hkv * group + 1, dim, dtype=dtype)[:, :, 1:] if q_offset else torch.zeros(shape, dtype=dtype)
    k = torch.zeros(3, page_size, hkv, dim, dtype=dtype)
    v = torch.zeros(3, page_size, hkv, dim, dtype=dtype)
    table = torch.zeros(batch, width, dtype=torch.int32)
    lens = torch.ones(batch, dtype=torch.int32)
    _assert_warm_equals_run(launches, "syncfree::paged_decode", q, k, v, table, lens, None, None)


def test_kv_indices_warm_up_is_its_launch(launches):
    fb = make_fb([3, 9, 5])
    out = torch.zeros(64, dtype=torch.int32)
    indptr = torch.tensor([0, 3, 12, 17], dtype=torch.int32)
    _assert_warm_equals_run(launches, "syncfree::kv_indices", out, fb.req_to_token, fb.req_pool_indices,
                            fb.seq_lens, indptr)


# -- a traced graph: its calls, warmed, are the eager run's launches ----------------------------------------------
@torch.compiler.nested_compile_region
def _layer(q, k, v, table, lens):
    return q + torch.ops.syncfree.paged_decode(q, k, v, table, lens)


def _regional_step(q, k, v, fb):
    m = fb.seq_lens.max().item()
    table = (fb.req_to_token[fb.req_pool_indices, :m:4] // 4).to(torch.int32)  # the pass makes it page_table
    lens = fb.seq_lens.to(torch.int32)
    for _ in range(3):
        q = _layer(q, k, v, table, lens)
    return q


def _regional_inputs():
    fb = make_fb([3, 9, 5])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 4, 16, generator=gen)
    k = torch.randn(16, 4, 2, 16, generator=gen)
    v = torch.randn(16, 4, 2, 16, generator=gen)
    return q, k, v, fb


def _traced_graph(step, args, **options):
    _, backend, _ = run(step, *args, **options)
    (gm,) = backend.graphs
    return gm


def test_a_regional_graphs_calls_are_found_once_each(launches):
    gm = _traced_graph(_regional_step, _regional_inputs(), max_context_len=64)
    calls = kernel_calls(gm, IMPLEMENTATIONS)
    # the pass's page table (outside the region) and the region body's paged_decode, once for three layer calls
    assert sorted(c.op for c in calls) == ["syncfree::page_table", "syncfree::paged_decode"]
    decode = next(c for c in calls if c.op == "syncfree::paged_decode")
    assert decode.args[0] == TensorSpec((3, 1, 4, 16), (64, 64, 16, 1), 0, torch.float32, torch.device("cpu"))
    table = next(c for c in calls if c.op == "syncfree::page_table")
    assert table.args[3:5] == (4, 16)  # page size and the static width: 64 // 4 pages


def test_a_traced_graph_warms_up_the_launches_of_its_first_run(launches):
    args = _regional_inputs()
    _, backend, compiled = run(_regional_step, *args, max_context_len=64)
    (gm,) = backend.graphs
    launches.clear()
    assert record_calls(kernel_calls(gm, IMPLEMENTATIONS))[0] == 2
    _, warms = _split(launches)
    launches.clear()
    with _compat.capture_scalar_outputs():
        compiled(*args)  # the rewritten graph, run once: its real launches
    runs, _ = _split(launches)
    assert len(runs) == 1 + 3  # the page table, and paged_decode in each of the three layers
    assert sorted(set(map(repr, runs))) == sorted(map(repr, warms))  # each distinct launch warmed, once


def test_calls_with_symbolic_sizes_are_left_out(launches):
    def step(q, k, v, table, lens):
        return torch.ops.syncfree.paged_decode(q, k, v, table, lens)

    q, k, v, _ = _regional_inputs()
    table, lens = torch.zeros(3, 4, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    static = _traced_graph(step, (q, k, v, table, lens))
    assert len(kernel_calls(static, IMPLEMENTATIONS)) == 1
    torch._dynamo.reset()
    from passlib import Rewriting

    backend = Rewriting()
    compiled = torch.compile(step, backend=backend, dynamic=True, fullgraph=True)
    compiled(q, k, v, table, lens)
    (gm,) = backend.graphs
    assert kernel_calls(gm, IMPLEMENTATIONS) == []


# -- the thread, its gate, its failure mode ----------------------------------------------------------------------
def test_compiling_only_hands_triton_dtypes_and_alignment_not_tensors(launches):
    kernel = RecordingKernel("k", launches)
    x = torch.zeros(9, dtype=torch.int64)
    with _triton.compiling_only():
        _triton.launch(kernel, (2,), x[1:], x, 7, BLOCK=4)
    _triton.launch(kernel, (2,), x[1:], x, 7, BLOCK=4)
    pointers = [("pointer", torch.int64, False), ("pointer", torch.int64, True), ("i32", "other")]
    assert launches == [("warm", "k", (2,), tuple(pointers), {"BLOCK": 4}),
                        ("run", "k", (2,), tuple(pointers), {"BLOCK": 4})]


def test_a_launch_waits_for_the_warm_up_thread(launches):
    finished = threading.Event()

    def slow_warm_up():
        time.sleep(0.3)
        finished.set()

    thread = threading.Thread(target=slow_warm_up)
    thread.start()
    _triton.add_warmup(thread)
    seen = []

    class Probe(RecordingKernel):
        def __getitem__(self, grid):
            seen.append(finished.is_set())
            return super().__getitem__(grid)

    _triton.launch(Probe("k", launches), (1,), 3)
    assert seen == [True]
    assert _triton._warmups == []


def test_a_failing_warm_up_is_skipped_and_the_rest_still_compile(launches):
    q, k, v, _ = _regional_inputs()
    table, lens = torch.zeros(3, 4, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    bad = _call("syncfree::paged_decode", q, k[..., :8], v, table, lens, None, None)  # head dims differ: raises
    good = _call("syncfree::paged_decode", q, k, v, table, lens, None, None)
    assert record_calls([bad, good])[0] == 1
    runs, warms = _split(launches)
    assert runs == [] and len(warms) >= 1


def test_warm_ups_are_off_without_cuda_and_when_turned_off(monkeypatch):
    gm = _traced_graph(_regional_step, _regional_inputs(), max_context_len=64)
    assert kernel_warmup.start(gm) is None  # CPU here: nothing to compile ahead
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernel_warmup.enabled()
    assert kernel_warmup.start(gm) is None  # the graph's tensors are on the CPU
    monkeypatch.setenv("SYNCFREE_PREWARM_KERNELS", "0")
    assert not kernel_warmup.enabled()


def test_a_cuda_graph_starts_one_named_thread(monkeypatch, launches):
    """On a CUDA machine the backend's call records the graph's compiles in the calling thread and hands them to a
    daemon thread named for the warm-up (helper process by default, this process with =thread), which a launch
    joins."""
    gm = _traced_graph(_regional_step, _regional_inputs(), max_context_len=64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda", 0)
    found = [c._replace(args=tuple(a._replace(device=cuda) if isinstance(a, TensorSpec) else a for a in c.args))
             for c in kernel_calls(gm, IMPLEMENTATIONS)]
    monkeypatch.setattr(kernel_warmup, "kernel_calls", lambda gm, implementations: found)
    recorded, ran = [], []
    jobs = ["job-1", "job-2"]
    monkeypatch.setattr(kernel_warmup, "record_calls", lambda calls: (recorded.append(calls), (len(calls), jobs))[1])
    monkeypatch.setattr(kernel_warmup, "_compile_and_load", lambda jobs, use_helper: ran.append((jobs, use_helper)))
    for setting, use_helper in (("1", True), ("thread", False)):
        monkeypatch.setenv("SYNCFREE_PREWARM_KERNELS", setting)
        thread = kernel_warmup.start(gm)
        assert thread is not None and thread.name == kernel_warmup.THREAD_NAME and thread.daemon
        _triton.wait_for_warmups()
        assert recorded[-1] == found and ran[-1] == (jobs, use_helper)

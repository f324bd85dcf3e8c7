"""The allocated-table rule (issue 20, recipe 2: FlashMLA / TRTLLM-MLA / aiter): `n = cdiv(max, 64)` sizes
`torch.full((bs, n), -1)`, a user Triton kernel with bounded-writer facts fills each row by its length, and a
self-guarding consumer reads the table by the same lengths. Compiled (pass-only backend) against eager over
several length vectors; the kept variants assert their reason codes.

The user kernel runs through the Triton interpreter on CPU. triton.jit decides at import whether a kernel is
interpreted, so without TRITON_INTERPRET=1 this file runs itself in a subprocess with it set (as
test_triton_interpreter.py does). Two shims make Dynamo trace a user kernel on a machine without a GPU: Dynamo
recognises only JITFunctions (the interpreter's InterpretedFunction is refused by torch on purpose), and only
when torch.utils._triton.has_triton() is True (False without a GPU). `traceable` wraps the interpreted kernel
in a JITFunction over the same Python function whose launches go to the interpreter; `dynamo_sees_triton`
patches has_triton while Dynamo traces. Neither touches the pass.
"""

from __future__ import annotations

import contextlib
import operator
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from conftest_helpers import interpreting
from paged_steps import Scratch, grown_scratch_step, maxima, padded_blocks, paged_inputs
from passlib import Rewriting, compile_traced

TESTS = Path(__file__).resolve().parents[1]
PS = 64
MCL = 512  # max_context_len: the static table is ceil(512 / 64) = 8 pages wide
REQS = 6
NUM_PAGES = REQS * MCL // PS
_NOT_INTERPRETING = pytest.mark.skipif(not interpreting(), reason="runs in a subprocess with TRITON_INTERPRET=1 "
                                                                   "(test_this_file_under_the_interpreter)")


def needs_interpreter(test):
    """Only under TRITON_INTERPRET=1, where the user Triton kernel runs on the CPU. The marker `interpreter` is what
    test_this_file_under_the_interpreter's subprocess selects: the file's other tests already ran in this process."""
    return pytest.mark.interpreter(_NOT_INTERPRETING(test))


def _version(text: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def test_this_file_under_the_interpreter():
    if interpreting():
        return
    triton = pytest.importorskip("triton")
    numpy = pytest.importorskip("numpy")
    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        pytest.skip(f"triton {triton.__version__}'s interpreter rejects numpy {numpy.__version__}")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging",
                           "-m", "interpreter", str(Path(__file__))], env=env, capture_output=True, text=True,
                          timeout=600, cwd=TESTS)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert int(re.search(r"(\d+) passed", proc.stdout).group(1)) >= 10, proc.stdout[-2000:]


# -- the shims (tests only) -------------------------------------------------------------------------------
@contextlib.contextmanager
def dynamo_sees_triton():
    import torch.utils._triton as triton_utils

    old = triton_utils.has_triton
    triton_utils.has_triton = lambda *args, **kwargs: True  # torch 2.15 calls has_triton(include_cpu=True)
    try:
        yield
    finally:
        triton_utils.has_triton = old


if interpreting():
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from compile_pass.kernels.flashmla_kv_indices import flashmla_kv_indices_kernel, reference

    class _Interpreted(JITFunction):
        """A JITFunction (what Dynamo traces) whose launches run the interpreter."""

        def __init__(self, interpreted):
            super().__init__(interpreted.fn)
            self._interpreted = interpreted

        def run(self, *args, grid, warmup, **kwargs):
            return self._interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)

    def traceable(kernel):
        return _Interpreted(kernel)

    KERNEL = traceable(flashmla_kv_indices_kernel)

    @triton.jit
    def unregistered_writer(req_to_token_ptr, req_pool_indices_ptr, page_kernel_lens_ptr, kv_start_idx,
                            kv_indices_ptr, req_to_token_ptr_stride: tl.constexpr, kv_indices_ptr_stride,
                            PAGED_SIZE: tl.constexpr = 64):
        pid = tl.program_id(axis=0)
        row = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
        pages = (tl.maximum(tl.load(page_kernel_lens_ptr + pid).to(tl.int64), 0) + PAGED_SIZE - 1) // PAGED_SIZE
        page = tl.arange(0, 16).to(tl.int64)
        token = tl.load(req_to_token_ptr + row * req_to_token_ptr_stride + page * PAGED_SIZE, mask=page < pages)
        tl.store(kv_indices_ptr + pid * kv_indices_ptr_stride + page, token // PAGED_SIZE, mask=page < pages)

    UNREGISTERED = traceable(unregistered_writer)

    @triton.jit
    def block_writer(req_to_token_ptr, req_pool_indices_ptr, page_kernel_lens_ptr, kv_indices_ptr,
                     req_to_token_ptr_stride, kv_indices_ptr_stride, PAGED_SIZE: tl.constexpr,
                     PAGES: tl.constexpr):
        """SGLang's 2-D launch: program (b, j) writes pages [j * PAGES, (j + 1) * PAGES) of row b, masked by the
        row's own page count."""
        pid, block = tl.program_id(axis=0), tl.program_id(axis=1)
        row = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
        pages = (tl.maximum(tl.load(page_kernel_lens_ptr + pid).to(tl.int64), 0) + PAGED_SIZE - 1) // PAGED_SIZE
        page = block * PAGES + tl.arange(0, PAGES).to(tl.int64)
        token = tl.load(req_to_token_ptr + row * req_to_token_ptr_stride + page * PAGED_SIZE, mask=page < pages)
        tl.store(kv_indices_ptr + pid * kv_indices_ptr_stride + page, token // PAGED_SIZE, mask=page < pages)

    BLOCK_WRITER = traceable(block_writer)

    @triton.jit
    def fill(out_ptr, X: tl.constexpr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, tl.zeros([N], tl.float32) + X)

    FILL = traceable(fill)


# -- inputs -----------------------------------------------------------------------------------------------
def make_inputs(lengths, seed=0, width=MCL):
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(REQS * width // PS, generator=gen).view(REQS, -1)
    tok = torch.arange(width)
    r2t = (pages[:, tok // PS] * PS + tok % PS).to(torch.int32)
    rpi = torch.randperm(REQS, generator=gen)[: len(lengths)]
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    q = torch.randn(len(lengths), 1, 4, 16, generator=gen)
    k = torch.randn(NUM_PAGES, PS, 2, 16, generator=gen)
    v = torch.randn(NUM_PAGES, PS, 2, 16, generator=gen)
    return q, k, v, r2t, rpi, seq_lens


VECTORS = [[5, 130, 64], [512, 1, 0], [64, 65, 1], [200, 300, 511]]
ATTN = torch.ops.syncfree.paged_decode


def run_pass(step, vectors, **options):
    """Compile with the pass-only backend; compare with eager on every vector. Returns the backend."""
    backend = Rewriting(max_context_len=MCL, **options)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for lengths in vectors:
        args = make_inputs(lengths)
        with dynamo_sees_triton(), compile_pass._compat.capture_scalar_outputs():
            got = compiled(*args)
        torch.testing.assert_close(got, step(*make_inputs(lengths)))
    assert len(backend.graphs) == 1, "recompiled"
    return backend


def kept_codes(backend):
    return [(i.reason_code, i.rule) for i in backend.report.kept]


def flashmla_step(q, k, v, r2t, rpi, seq_lens):
    m = seq_lens.max().item()
    n = triton.cdiv(m, PS)
    bs = seq_lens.shape[0]
    table = torch.full((bs, n), -1, dtype=torch.int32, device=seq_lens.device)
    KERNEL[(bs,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
    return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


# -- rewritten --------------------------------------------------------------------------------------------
@needs_interpreter
def test_the_example_kernel_writes_what_its_reference_says():
    q, k, v, r2t, rpi, seq_lens = make_inputs([5, 130, 0])
    table = torch.full((3, 3), -1, dtype=torch.int32)
    KERNEL[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
    torch.testing.assert_close(table, reference(r2t, rpi, seq_lens, torch.full((3, 3), -1, dtype=torch.int32)))
    assert (table[0, 1:] == -1).all() and (table[2] == -1).all()


@needs_interpreter
def test_flashmla_shape_is_rewritten_to_the_static_width():
    backend = run_pass(flashmla_step, VECTORS)
    report = backend.report
    assert not report.kept, str(report)
    (item,) = report.rewritten
    assert item.rule == "allocated_table"
    assert "allocated table -> width 8 (page_size 64)" in item.reason, item.reason
    assert "upper bound -> 512" in item.reason and "lengths asserted on the device" in item.reason
    graph = backend.graphs[0].graph
    targets = [n.target for n in graph.nodes]
    assert "item" not in targets and torch.ops.aten._assert_scalar.default not in targets
    (alloc,) = [n for n in graph.nodes if n.target is torch.full]
    assert tuple(alloc.args[0]) == (3, 8)
    (writer,) = [n for n in graph.nodes if compile_pass._compat.user_triton_kernel(n) is not None]
    assert writer.kwargs["kwargs"]["kv_indices_ptr_stride"] == 8 and writer.kwargs["grid"] == [(3, 1, 1)]
    # Dynamo's own check `u0 >= -63` stays, exactly, as a device assertion (any length >= -63)
    assert torch.ops.aten.amax.default in targets and torch.ops.aten.any.default not in targets


@needs_interpreter
def test_empty_table_and_page_count_spelled_by_hand():
    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        n = (m + PS - 1) // PS
        table = torch.empty((seq_lens.shape[0], n), dtype=torch.int32)
        KERNEL[(seq_lens.shape[0],)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0),
                                     PAGED_SIZE=PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    backend = run_pass(step, VECTORS[:3])
    assert not backend.report.kept and backend.report.rewritten[0].rule == "allocated_table", str(backend.report)


@needs_interpreter
def test_a_length_past_the_bound_raises_on_the_device():
    backend = Rewriting(max_context_len=MCL)
    compiled = torch.compile(flashmla_step, backend=backend, fullgraph=True)
    with dynamo_sees_triton(), compile_pass._compat.capture_scalar_outputs():
        compiled(*make_inputs([5, 130, 64]))
        with pytest.raises(RuntimeError, match="static bound"):
            compiled(*make_inputs([5, 600, 64], width=1024))


# -- kept -------------------------------------------------------------------------------------------------
@needs_interpreter
def test_an_unregistered_kernel_keeps_the_max():
    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        n = triton.cdiv(m, PS)
        table = torch.full((3, n), -1, dtype=torch.int32)
        UNREGISTERED[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    backend = run_pass(step, VECTORS[:2])
    assert kept_codes(backend) == [("writer_unknown", "allocated_table")], str(backend.report)


@needs_interpreter
def test_a_registered_writer_with_wrong_facts_or_other_lengths_keeps_the_max():
    from compile_pass.rules.bounded_writers import register_bounded_writer, unregister_bounded_writer

    with pytest.raises(ValueError, match="not a parameter"):
        register_bounded_writer(UNREGISTERED, table="table", lengths="page_kernel_lens_ptr", page_size=64)

    def other_lengths(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        table = torch.full((3, triton.cdiv(m, PS)), -1, dtype=torch.int32)
        # other values (every row filled to the max: eager is fine), not the values the max was taken over
        writer_lens = seq_lens.amax().expand_as(seq_lens).contiguous()
        KERNEL[(3,)](r2t, rpi, writer_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    assert kept_codes(run_pass(other_lengths, VECTORS[:2])) == [("lengths_differ", "allocated_table")]

    register_bounded_writer(UNREGISTERED, table="kv_indices_ptr", lengths="page_kernel_lens_ptr", page_size=32,
                            table_stride="kv_indices_ptr_stride")
    try:  # facts that say pages of 32: they do not agree with the count's 64
        def step(q, k, v, r2t, rpi, seq_lens):
            m = seq_lens.max().item()
            table = torch.full((3, triton.cdiv(m, PS)), -1, dtype=torch.int32)
            UNREGISTERED[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
            return ATTN(q, k, v, table, seq_lens.to(torch.int32))

        assert kept_codes(run_pass(step, VECTORS[:2])) == [("page_size", "allocated_table")]
    finally:
        unregister_bounded_writer(UNREGISTERED)


@needs_interpreter
def test_the_table_written_by_anything_else_keeps_the_max():
    def in_place(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        table = torch.full((3, triton.cdiv(m, PS)), -1, dtype=torch.int32)
        KERNEL[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        table.add_(0)  # a write between the writer and the reader (`table[:, 0] = 0` also checks n > 0: width_use)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    assert kept_codes(run_pass(in_place, VECTORS[:2])) == [("table_written", "allocated_table")]

    def second_kernel(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        table = torch.full((3, triton.cdiv(m, PS)), -1, dtype=torch.int32)
        KERNEL[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        UNREGISTERED[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    assert kept_codes(run_pass(second_kernel, VECTORS[:2])) == [("table_written", "allocated_table")]


@needs_interpreter
def test_the_width_used_elsewhere_keeps_the_max():
    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        table = torch.full((3, triton.cdiv(m, PS)), -1, dtype=torch.int32)
        KERNEL[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32)) * table.shape[1]

    assert kept_codes(run_pass(step, VECTORS[:2])) == [("width_use", "allocated_table")]


@needs_interpreter
def test_a_grid_derived_from_the_width_keeps_the_max():
    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        n = triton.cdiv(m, PS)
        table = torch.full((3, n), -1, dtype=torch.int32)
        KERNEL[(3, n)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    assert kept_codes(run_pass(step, VECTORS[:2])) == [("writer_grid", "allocated_table")]


@needs_interpreter
def test_a_consumer_with_other_pages_or_no_writer_keeps_the_max():
    def read_before_writing(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        table = torch.full((3, triton.cdiv(m, PS)), 0, dtype=torch.int32)
        out = ATTN(q, k, v, table, seq_lens.to(torch.int32))
        KERNEL[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        return out, ATTN(q, k, v, table, seq_lens.to(torch.int32))

    assert kept_codes(run_pass(read_before_writing, VECTORS[:2])) == [("no_writer", "allocated_table")]

    def bounded_sum(q, k, v, r2t, rpi, seq_lens):  # registered without page_size_of: pages cannot be tied
        m = seq_lens.max().item()
        table = torch.full((3, triton.cdiv(m, PS)), -1, dtype=torch.int32)
        KERNEL[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        return torch.ops.syncfree_test.bounded_sum(table, seq_lens, PS, m)

    assert kept_codes(run_pass(bounded_sum, VECTORS[:2])) == [("page_size", "allocated_table")]


@needs_interpreter
def test_a_plain_page_table_max_still_goes_to_the_page_table_rule():
    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        table = r2t[rpi, :m:PS] // PS
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)

    backend = run_pass(step, VECTORS[:2])
    assert [i.rule for i in backend.report.rewritten] == ["page_table"], str(backend.report)


@needs_interpreter
def test_through_inductor():
    """compile_pass.compile (Inductor) with the user kernel on CPU: see the report for what this shows."""
    compiled = compile_pass.compile(flashmla_step, max_context_len=MCL)
    with dynamo_sees_triton():
        try:
            got = compiled(*make_inputs(VECTORS[0]))
        except Exception as e:  # Inductor lowers user Triton kernels for GPU devices only
            report = compile_pass.last_report()  # the pass ran (the rewrite is done) before Inductor failed
            assert report.rewritten and report.rewritten[0].rule == "allocated_table", str(report)
            pytest.xfail(f"Inductor does not compile a user Triton kernel on CPU tensors: {type(e).__name__}: "
                         f"{str(e)[:200]}")
    torch.testing.assert_close(got, flashmla_step(*make_inputs(VECTORS[0])))
    report = compile_pass.last_report()
    assert report.rewritten and not report.syncs_remaining, str(report)


@needs_interpreter
def test_a_dynamic_batch_launches_on_the_symbolic_rows():
    backend = Rewriting(max_context_len=MCL)
    compiled = torch.compile(flashmla_step, backend=backend, fullgraph=True, dynamic=True)
    for lengths in ([5, 130, 64], [7, 500], [1, 2, 3, 4]):
        with dynamo_sees_triton(), compile_pass._compat.capture_scalar_outputs():
            got = compiled(*make_inputs(lengths))
        torch.testing.assert_close(got, flashmla_step(*make_inputs(lengths)))
    assert len(backend.graphs) == 1 and not backend.report.kept, str(backend.report)
    (writer,) = [n for n in backend.graphs[0].graph.nodes if compile_pass._compat.user_triton_kernel(n) is not None]
    (rows, one, one_) = writer.kwargs["grid"][0]
    assert isinstance(rows, torch.fx.Node) and (one, one_) == (1, 1)


@needs_interpreter
def test_lengths_written_after_the_writer_keep_the_max():
    """The writer is excluded from the write check by its facts; any other write to the lengths still counts."""
    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        table = torch.full((3, triton.cdiv(m, PS)), -1, dtype=torch.int32)
        KERNEL[(3,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        seq_lens.add_(0)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    assert kept_codes(run_pass(step, VECTORS[:2])) == [("written", "allocated_table")]


@needs_interpreter
def test_request_indices_with_their_own_symbolic_size_still_rewrite():
    """After a second batch size Dynamo may give req_pool_indices a size symbol of its own (s81 beside the
    lengths' s37): program b still reads entry b, in the step as in eager, so the rewrite holds (found on the
    H200, engine_steps_gpu.py's mla step)."""
    backend = Rewriting(max_context_len=MCL)
    compiled = torch.compile(flashmla_step, backend=backend, fullgraph=True)
    for lengths in ([5, 130, 64, 7], [512, 1, 0, 3, 9, 100], [2, 3, 4, 5, 6]):
        with dynamo_sees_triton(), compile_pass._compat.capture_scalar_outputs():
            got = compiled(*make_inputs(lengths))
        torch.testing.assert_close(got, flashmla_step(*make_inputs(lengths)))
        assert not backend.report.kept and backend.report.rewritten, str(backend.report)
    sizes = [n.meta["example_value"].shape[0] for n in backend.graphs[-1].graph.nodes
             if n.op == "placeholder" and n.name in ("l_seq_lens_", "l_rpi_")]
    assert len(sizes) == 2 and all(isinstance(s, torch.SymInt) for s in sizes), sizes


# -- an op as the bounded writer (compile_pass.register_bounded_writer with an op): no Triton needed ------------
# SGLang's FlashMLA and TRTLLM-MLA shapes: a persistent -1 scratch sliced `buf[:bs, :n]`, and a round-up width
# `cdiv(cdiv(m, 64), L) * L`, both filled by a writer op addressed through the table's row stride.
_LIB = torch.library.Library("syncfree_test_writer", "DEF")
for _name in ("block_table_writer", "undeclared_writer"):
    _LIB.define(f"{_name}(Tensor req_to_token, Tensor req_pool_indices, Tensor lengths, Tensor(a!) table, "
                "SymInt table_stride, int page_size) -> ()")


def _write_rows(req_to_token, req_pool_indices, lengths, table, table_stride, page_size):
    """Row b's first cdiv(lengths[b], page_size) columns, written through `table_stride` as SGLang's kernel does
    (not clamped to the table's width: raises where a row would land past the table's storage)."""
    room = table.untyped_storage().nbytes() // table.element_size() - table.storage_offset()
    for b in range(lengths.shape[0]):
        pages = -(-max(int(lengths[b]), 0) // page_size)
        if pages > table_stride or b * table_stride + pages > room:
            raise IndexError(f"row {b} needs {pages} columns, the row stride is {table_stride}")
        cols = req_to_token[req_pool_indices[b], : pages * page_size : page_size] // page_size
        table.as_strided((pages,), (1,), table.storage_offset() + b * table_stride).copy_(cols.to(table.dtype))


for _name in ("block_table_writer", "undeclared_writer"):
    _LIB.impl(_name, _write_rows, "CPU")
    torch.library.register_fake(f"syncfree_test_writer::{_name}", lambda *a: None, lib=_LIB)
WRITER = torch.ops.syncfree_test_writer.block_table_writer
UNDECLARED = torch.ops.syncfree_test_writer.undeclared_writer
compile_pass.register_bounded_writer(WRITER, table="table", lengths="lengths", page_size="page_size",
                                     req_pool_indices="req_pool_indices", req_to_token="req_to_token",
                                     table_stride="table_stride")
BS = 3
OP_VECTORS = [[5, 130, 64], [512, 1, 0], [64, 65, 1], [200, 300, 511]]


def run_op(step, vectors=OP_VECTORS, width=8, **options):
    """The step on (inputs, a persistent -1 buffer [REQS, width]); compiled (pass-only backend) and eager on copies
    of the same buffer: the outputs (the table's first cdiv(max, 64) columns where it is returned) and the buffer
    after the step are equal. Returns the backend."""
    backend = Rewriting(max_context_len=MCL, **options)
    compare_on_buffers(torch.compile(step, backend=backend, fullgraph=True), step, vectors, width)
    assert len(backend.graphs) == 1, "recompiled"
    return backend


def compare_on_buffers(compiled, step, vectors, width):
    """`compiled` and `step` (eager) over `vectors`, each on its own copy of one persistent -1 buffer [REQS,
    width]: the outputs (a returned table's first columns, eager's width) and the buffers after each step equal."""
    buf_got = torch.full((REQS, width), -1, dtype=torch.int32)
    buf_want = buf_got.clone()
    for lengths in vectors:
        with compile_pass._compat.capture_scalar_outputs():
            got = compiled(*make_inputs(lengths), buf_got)
        want = step(*make_inputs(lengths), buf_want)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            g = g[:, : w.shape[1]] if g.dtype == torch.int32 else g  # a returned table: at the static width
            torch.testing.assert_close(g, w)
        assert torch.equal(buf_got, buf_want)


def scratch_step(q, k, v, r2t, rpi, seq_lens, buf):
    m = seq_lens.max().item()
    table = buf[: seq_lens.shape[0], : (m + PS - 1) // PS]  # FlashMLA: the grown scratch, sliced
    WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
    return ATTN(q, k, v, table[: seq_lens.shape[0]], seq_lens.to(torch.int32)), table


def round_up_step(q, k, v, r2t, rpi, seq_lens, buf):
    m = seq_lens.max().item()
    blocks = (m + PS - 1) // PS
    blocks = (blocks + 2) // 3 * 3  # TRTLLM-MLA: padded to a multiple of the constraint (3 here, 64 in SGLang)
    table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
    WRITER(r2t, rpi, seq_lens, table, blocks, PS)
    return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


def _slice_stop(backend):
    (node,) = [n for n in backend.graphs[0].graph.nodes if n.target is operator.getitem and n.args[0].op ==
               "placeholder" and isinstance(n.args[1], tuple)]
    return node.args[1][1].stop


def test_a_sliced_persistent_scratch_is_rewritten_to_the_static_width():
    backend = run_op(scratch_step, static_escapes=True)
    report = backend.report
    assert not report.kept and [i.rule for i in report.rewritten] == ["allocated_table"], str(report)
    assert "sliced table -> width 8 (page_size 64)" in report.rewritten[0].reason
    assert _slice_stop(backend) == 8
    assert "item" not in backend.targets()


def test_the_row_view_of_the_rewritten_scratch_gets_the_static_width_too():
    """The backend keeps CUDA graphs on only for a graph whose nodes hold no unbacked symbol: the row view
    `table[:bs]` that reaches the consumer must not keep the dynamic width's symbol in its example value (the
    H200 run's flashmla_scratch graph ran without CUDA graphs for that)."""
    from compile_pass._compat import example_value
    from compile_pass.pipeline import holds_unbacked_symbols as _holds_unbacked_symbols

    gm = run_op(scratch_step, static_escapes=True).graphs[0]
    (view,) = [n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0].target is operator.getitem]
    assert example_value(view).shape[1] == 8
    assert not _holds_unbacked_symbols(gm)


def test_a_sliced_scratch_wider_than_the_bound_gets_the_bound_s_width():
    backend = run_op(scratch_step, width=11, static_escapes=True)
    assert not backend.report.kept and _slice_stop(backend) == 8, str(backend.report)


def test_a_round_up_page_count_is_rewritten_to_the_round_up_at_the_bound():
    backend = run_op(round_up_step)
    report = backend.report
    assert not report.kept, str(report)
    assert "allocated table -> width 9 (page_size 64, rounded up)" in report.rewritten[0].reason, str(report)
    (alloc,) = [n for n in backend.graphs[0].graph.nodes if n.target is torch.full]
    assert tuple(alloc.args[0]) == (BS, 9)
    (writer,) = [n for n in backend.graphs[0].graph.nodes if n.target in (WRITER, WRITER.default)]
    assert writer.args[4] == 9


def test_a_length_past_the_bound_raises_with_the_sliced_scratch():
    backend = Rewriting(max_context_len=MCL, static_escapes=True)
    compiled = torch.compile(scratch_step, backend=backend, fullgraph=True)
    buf = torch.full((REQS, 16), -1, dtype=torch.int32)
    with compile_pass._compat.capture_scalar_outputs():
        compiled(*make_inputs([5, 130, 64]), buf)
        assert backend.report.rewritten and not backend.report.kept, str(backend.report)
        with pytest.raises(RuntimeError, match="static bound"):
            compiled(*make_inputs([5, 600, 64], width=1024), buf)


# kept: each keeps eager's result (run_op compares) and says why
def test_a_scratch_narrower_than_the_bound_keeps_the_max():
    vectors = [[5, 130, 64], [300, 1, 0]]  # within the 6 columns eager needs
    backend = run_op(scratch_step, vectors, width=6, static_escapes=True)
    assert kept_codes(backend) == [("buffer_narrow", "allocated_table")], str(backend.report)


def test_the_sliced_table_escaping_without_static_escapes_keeps_the_max():
    assert kept_codes(run_op(scratch_step)) == [("escapes", "allocated_table")]


def test_an_undeclared_writer_of_the_scratch_keeps_the_max():
    def step(q, k, v, r2t, rpi, seq_lens, buf):
        m = seq_lens.max().item()
        table = buf[: seq_lens.shape[0], : (m + PS - 1) // PS]
        UNDECLARED(r2t, rpi, seq_lens, table, table.stride(0), PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    backend = run_op(step)
    assert kept_codes(backend) == [("not_a_consumer", "page_table")], str(backend.report)


# -- under CUDA graphs the rewritten scratch is a static input (backend.mark_static_scratch) --------------------
def undeclared_scratch_step(q, k, v, r2t, rpi, seq_lens, buf):
    m = seq_lens.max().item()
    table = buf[: seq_lens.shape[0], : (m + PS - 1) // PS]
    UNDECLARED(r2t, rpi, seq_lens, table, table.stride(0), PS)  # writes the scratch, with no writer facts
    return ATTN(q, k, v, table, seq_lens.to(torch.int32))


def through_aot(monkeypatch, step, vectors=OP_VECTORS[:2], width=8, **options):
    """The step through the syncfree backend with AOT autograd in place of Inductor (fast), against eager on
    copies of one persistent buffer. Returns, per graph AOT compiled, what it saw (the inputs it counts as static
    and those the graph writes in place, by source name; whether the backend asked for CUDA graphs), the
    placeholders the backend marked static (a graph that keeps its host read runs as captured: AOT fails on its
    unbacked sizes, and the backend says so in a warning), and the backend's reports."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    from compile_pass import backend as syncfree

    seen = []

    def compile_checked(gm, example_inputs, patches, opts):
        names = [compile_pass._compat.placeholder_source_name(n) for n in gm.graph.nodes if n.op == "placeholder"]

        def forward(fx, args):
            meta = torch._guards.TracingContext.try_get().fw_metadata
            seen.append(dict(static=[names[i] for i in meta.static_input_indices],
                             mutated=[names[i] for i, info in enumerate(meta.input_info) if info.mutates_data],
                             cudagraphs=bool(patches.get("triton.cudagraphs"))))
            return make_boxed_func(fx.forward)

        compiled = aot_module_simplified(gm, example_inputs, fw_compiler=forward)
        return compiled, {"local_scalar_dense": [], "unbacked_symbols": [], "reads": []}, 0.0

    monkeypatch.setattr(syncfree, "_compile_checked", compile_checked)
    marked, mark = [], compile_pass._compat.mark_static_placeholder
    monkeypatch.setattr(compile_pass._compat, "mark_static_placeholder",
                        lambda node: marked.append(compile_pass._compat.placeholder_source_name(node)) or mark(node))
    reports = []
    with compile_pass.report.collecting_reports(reports):
        compiled = torch.compile(step, fullgraph=True, backend=lambda gm, inputs: syncfree.syncfree_backend(
            gm, inputs, options={"max_context_len": MCL, **options}))
        compare_on_buffers(compiled, step, vectors, width)
    return seen, marked, reports


def test_under_cudagraphs_the_rewritten_scratch_is_a_static_input(monkeypatch):
    """FlashMLA's grown scratch is a graph input the step writes in place: CUDA graph trees skip such a graph
    ("mutated inputs") unless the input is static. The backend makes it so, for the scratch the rule proved."""
    seen, marked, reports = through_aot(monkeypatch, scratch_step, cudagraphs=True, static_escapes=True)
    assert reports[-1].rewritten and not reports[-1].kept, str(reports[-1])
    assert marked == ["L['buf']"] and seen and all(s["cudagraphs"] for s in seen), (marked, seen)
    assert seen[0]["static"] == ["L['buf']"] and "L['buf']" in seen[0]["mutated"], seen
    assert any("L['buf']" in n and "static input of the CUDA graph" in n for n in reports[-1].notes), \
        reports[-1].notes


def test_without_cudagraphs_no_input_is_made_static(monkeypatch):
    seen, marked, reports = through_aot(monkeypatch, scratch_step, static_escapes=True)
    assert reports[-1].rewritten and not marked and seen and seen[0]["static"] == [], seen
    assert not any("static input" in n for n in reports[-1].notes)


@pytest.mark.parametrize("step, width, code", [(undeclared_scratch_step, 8, "not_a_consumer"),
                                                (scratch_step, 6, "buffer_narrow")])
def test_a_written_scratch_whose_max_is_kept_is_not_made_static(monkeypatch, step, width, code):
    """The max kept, the graph keeps its host read and runs without CUDA graphs: nothing is marked."""
    seen, marked, reports = through_aot(monkeypatch, step, [[5, 130, 64], [300, 1, 0]], width=width,
                                        cudagraphs=True, static_escapes=True)
    assert [i.reason_code for i in reports[-1].kept] == [code], str(reports[-1])
    assert not marked and all(s["static"] == [] and not s["cudagraphs"] for s in seen), (marked, seen)
    assert not any("static input" in n for n in reports[-1].notes), reports[-1].notes


def test_the_plan_exposes_only_the_proven_sliced_scratch_as_a_static_input():
    from compile_pass.options import SyncfreeOptions
    from compile_pass.sync_pass import SyncPass

    results = []

    def backend(gm, example_inputs):
        results.append(SyncPass(SyncfreeOptions.from_dict({"max_context_len": MCL, "static_escapes": True}))(gm))
        return gm.forward

    for step, width in ((scratch_step, 8), (round_up_step, 8), (undeclared_scratch_step, 8), (scratch_step, 6)):
        torch._dynamo.reset()
        with compile_pass._compat.capture_scalar_outputs():
            torch.compile(step, backend=backend, fullgraph=True)(*make_inputs([5, 130, 64]),
                                                                 torch.full((REQS, width), -1, dtype=torch.int32))
    scratch, round_up, undeclared, narrow = results
    assert scratch.rewritten and len(scratch.static_inputs) == 1 and scratch.static_names == ["L['buf']"]
    assert round_up.rewritten and round_up.static_inputs == [] and round_up.static_names == []
    assert undeclared.kept and undeclared.static_inputs == [] and narrow.kept and narrow.static_inputs == []


def test_a_static_input_no_longer_aligned_runs_the_untouched_graph():
    """Inductor does not check a static input's alignment again at run time: the per-call guard does, on the
    host, and runs the graph as captured where the scratch moved to an unaligned offset."""
    from compile_pass.backend import guard_disjoint_inputs

    calls = []

    class Original:
        def forward(self, *args):
            calls.append("untouched")

    guarded = guard_disjoint_inputs(lambda *args: calls.append("compiled"), Original(), [], aligned=[1])
    pool = torch.zeros(64, dtype=torch.int32)
    for start in (0, 1, 4):  # 0, 4 and 16 bytes into the storage
        guarded(torch.zeros(2), pool[start: start + 8])
    assert calls == ["compiled", "untouched", "compiled"]


def test_a_consumer_reading_other_lengths_keeps_the_max():
    def step(q, k, v, r2t, rpi, seq_lens, buf):
        m = seq_lens.max().item()
        table = buf[: seq_lens.shape[0], : (m + PS - 1) // PS]
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
        other = (seq_lens // 2).to(torch.int32)  # fewer keys: eager is fine, but not the values of the max
        return ATTN(q, k, v, table, other)

    assert kept_codes(run_op(step)) == [("lengths_differ", "allocated_table")]


def test_a_slice_not_from_the_first_column_keeps_the_max():
    def step(q, k, v, r2t, rpi, seq_lens, buf):
        m = seq_lens.max().item()
        table = buf[: seq_lens.shape[0], 1: (m + PS - 1) // PS + 1]
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    backend = run_op(step, width=9)  # the count is an end, but not of a table this rule takes
    assert kept_codes(backend) == [("page_count", "page_table")], str(backend.report)


def test_a_round_up_that_is_no_multiple_of_form_keeps_the_max():
    def halved(q, k, v, r2t, rpi, seq_lens, buf):
        m = seq_lens.max().item()
        blocks = ((m + PS - 1) // PS + 3) // 4 * 2  # half a multiple of 4: narrower than the pages of long rows
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, seq_lens, table, blocks, PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    def rounded_down(q, k, v, r2t, rpi, seq_lens, buf):
        m = seq_lens.max().item()
        blocks = (m + PS - 1) // PS // 2 * 2  # a round-down: eager is fine on an even page count, the form is not
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, seq_lens, table, blocks, PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    # eager's tables are wide enough on these: at most 2 pages (halved), an even count of pages (rounded down)
    assert kept_codes(run_op(halved, [[100, 5, 7], [128, 1, 64]])) == [("round_up", "allocated_table")]
    # Dynamo folds it into `(m + 63) // 128 * 2`: a page count of 128 that rounds the bound down, under no rule
    backend = run_op(rounded_down, [[100, 5, 7], [256, 130, 1]])
    assert backend.report.kept and not backend.report.rewritten, str(backend.report)


def test_an_op_writer_is_checked_against_its_schema():
    with pytest.raises(ValueError, match="must write only its table"):
        compile_pass.register_bounded_writer(UNDECLARED, table="lengths", lengths="lengths", page_size=64)
    with pytest.raises(ValueError, match="is not a parameter"):
        compile_pass.register_bounded_writer(UNDECLARED, table="table", lengths="seq_lens", page_size=64)
    with pytest.raises(ValueError, match="an op owns its launch"):
        compile_pass.register_bounded_writer(UNDECLARED, table="table", lengths="lengths", page_size=64,
                                             pages_per_program=4)
    from compile_pass.rules.bounded_writers import facts_of

    assert not any("undeclared_writer" in key for key in facts_of("allocated_table"))


# -- a Triton writer on SGLang's 2-D grid (pages_per_program) -----------------------------------------------------
def block_grid_step(q, k, v, r2t, rpi, seq_lens):
    m = seq_lens.max().item()
    n = triton.cdiv(m, PS)
    bs = seq_lens.shape[0]
    table = torch.full((bs, n), -1, dtype=torch.int32)
    BLOCK_WRITER[(bs, triton.cdiv(n, 2))](r2t, rpi, seq_lens, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS,
                                          PAGES=2)
    return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


@needs_interpreter
def test_a_two_dimensional_grid_with_pages_per_program_is_rewritten():
    from compile_pass.rules.bounded_writers import register_bounded_writer, unregister_bounded_writer

    register_bounded_writer(BLOCK_WRITER, table="kv_indices_ptr", lengths="page_kernel_lens_ptr", page_size="PAGED_SIZE",
                            req_pool_indices="req_pool_indices_ptr", req_to_token="req_to_token_ptr",
                            table_stride="kv_indices_ptr_stride", pages_per_program=2)
    try:
        backend = run_pass(block_grid_step, VECTORS)
        assert not backend.report.kept, str(backend.report)
        (writer,) = [n for n in backend.graphs[0].graph.nodes if compile_pass._compat.user_triton_kernel(n) is not None]
        assert writer.kwargs["grid"] == [(3, 4, 1)]  # cdiv(8 pages, 2 per program)
    finally:
        unregister_bounded_writer(BLOCK_WRITER)


@needs_interpreter
def test_a_two_dimensional_grid_without_pages_per_program_keeps_the_max():
    from compile_pass.rules.bounded_writers import register_bounded_writer, unregister_bounded_writer

    register_bounded_writer(BLOCK_WRITER, table="kv_indices_ptr", lengths="page_kernel_lens_ptr", page_size="PAGED_SIZE",
                            req_pool_indices="req_pool_indices_ptr", req_to_token="req_to_token_ptr",
                            table_stride="kv_indices_ptr_stride")
    try:
        assert kept_codes(run_pass(block_grid_step, VECTORS[:2])) == [("writer_grid", "allocated_table")]
    finally:
        unregister_bounded_writer(BLOCK_WRITER)


@needs_interpreter
def test_the_sliced_scratch_filled_by_a_triton_writer_is_rewritten():
    """FlashMLA's scratch with the Triton writer (its stride the scratch's own, a constant Dynamo keeps among the
    kernel's constant arguments), as engine_steps_gpu.py's flashmla_scratch step runs it on a GPU."""
    def step(q, k, v, r2t, rpi, seq_lens, buf):
        m = seq_lens.max().item()
        bs = seq_lens.shape[0]
        table = buf[:bs, : triton.cdiv(m, PS)]
        KERNEL[(bs,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)

    with dynamo_sees_triton():
        backend = run_op(step, width=10)
    assert not backend.report.kept and "sliced table -> width 8" in backend.report.rewritten[0].reason, \
        str(backend.report)
    assert _slice_stop(backend) == 8


@needs_interpreter
def test_a_round_up_table_filled_by_a_triton_writer_is_rewritten():
    """TRTLLM-MLA's padded width with the Triton writer, the width itself passed as its row stride, as
    engine_steps_gpu.py's trtllm_round_up step runs it on a GPU."""
    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        bs = seq_lens.shape[0]
        blocks = triton.cdiv(triton.cdiv(m, PS), 3) * 3
        table = torch.full((bs, blocks), -1, dtype=torch.int32)
        KERNEL[(bs,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), blocks, PAGED_SIZE=PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)

    backend = run_pass(step, VECTORS)
    assert not backend.report.kept and "width 9 (page_size 64, rounded up)" in backend.report.rewritten[0].reason, \
        str(backend.report)
    (writer,) = [n for n in backend.graphs[0].graph.nodes if compile_pass._compat.user_triton_kernel(n) is not None]
    assert writer.kwargs["kwargs"]["kv_indices_ptr_stride"] == 9



# -- TRTLLM-MLA's round-up branch with the Triton writer (issue 45, item 6) ---------------------------------------
# Found on the H200 (2026-12-05): the step with the project's Triton writer broke at `if blocks % lcm != 0` under
# fullgraph ("Could not guard on data-dependent expression"), while the same step with a writer op was rewritten.
# Dynamo names a user Triton launch's constants by their index in torch's kernel side table, a new index for each
# trace: the two outcomes' traces differed in that index alone. The signature now spells the entries.
def trtllm_triton_step(page_size: int, other_constant: int | None = None):
    """TRTLLM-MLA's decode metadata with the Triton writer, the padded width as its row stride. With
    `other_constant`, the outcome that rounds up launches the kernel with that PAGED_SIZE instead (a different
    launch: the two outcomes compute different tables)."""
    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        bs = seq_lens.shape[0]
        lcm = 4096 // page_size
        blocks = (m + page_size - 1) // page_size
        launch = page_size
        if blocks % lcm != 0:  # trtllm_mla_backend.py _calc_padded_blocks
            blocks = (blocks + lcm - 1) // lcm * lcm
            launch = other_constant or page_size
        table = torch.full((bs, blocks), -1, dtype=torch.int32)
        KERNEL[(bs,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), blocks, PAGED_SIZE=launch)
        # a self-guarding reader of each row's live pages (exact sums of page ids: every written cell is read),
        # not the attention, whose interpreted kernel at 32768 tokens costs minutes here
        return torch.ops.syncfree_test.paged_sum(table, seq_lens, k, m)
    return step


@needs_interpreter
@pytest.mark.parametrize("bound,page_size", [(4096, 64), (32768, 64), (8192, 32)])
def test_the_round_up_branch_with_the_triton_writer_is_rewritten_and_no_max_raises(bound, page_size):
    """Maxima at the edges of every residue class of the round-up, batches 1 and 4: each compiled step equals
    eager (the reader sums every row's written pages), one graph per batch size, rewritten to the bound's
    padded width, and no assertion on the branch's outcome in the graph."""
    step = trtllm_triton_step(page_size)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    rng = random.Random(bound)
    for n, m in enumerate(maxima(bound, page_size, 5)):
        batch = 4 if n % 2 else 1
        lengths = [m] + [rng.randint(0, m) for _ in range(batch - 1)]
        inputs = paged_inputs(lengths, bound, page_size, n, reqs=REQS, heads=2, dim=8)
        with dynamo_sees_triton():
            got = call(*inputs)
        torch.testing.assert_close(got, step(*inputs))
    reports = backend.reports
    assert len(reports) == 2 and all(not r.kept and [i.rule for i in r.rewritten] == ["allocated_table"]
                                     for r in reports), "\n".join(map(str, reports))
    width = padded_blocks(bound, page_size)
    assert all(f"width {width} (page_size {page_size}" in r.rewritten[0].reason for r in reports), \
        "\n".join(map(str, reports))
    for gm in backend.graphs[-2:]:
        asserts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_scalar.default]
        assert not any("traced at the bound" in str(n.args) for n in asserts), [n.args for n in asserts]


@needs_interpreter
def test_outcomes_that_launch_the_writer_with_other_constants_are_not_one_computation():
    """The control: the outcome that rounds up launches the writer with PAGED_SIZE 128, the other with 64 (the
    tables differ). The two traces differ in the launch's constants, so the branch is not decided: the step keeps
    eager's values at every max."""
    bound, page_size = 8192, 64
    step = trtllm_triton_step(page_size, other_constant=128)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    for n, m in enumerate([bound, 4095, 4097, 1, 0, 8000]):
        inputs = paged_inputs([m, 3, min(m, 2)], bound, page_size, n, reqs=REQS, heads=2, dim=8)
        with dynamo_sees_triton():
            got = call(*inputs)
        torch.testing.assert_close(got, step(*inputs))
    assert not any(r.rewritten for r in backend.reports), "\n".join(map(str, backend.reports))


@needs_interpreter
def test_outcomes_that_launch_with_constants_that_print_alike_are_not_one_computation():
    """A helper's program (2026-12-05): the outcomes launch one kernel with the constexpr nan and -nan, which print
    alike; the two traces were merged and the bound's outcome's -nan became nan (the sign bit wrong at every max
    whose pages are a multiple of 64). Constants are compared by type and bits: not merged, eager's bits. (A float
    constant that stock Dynamo writes into its FX code, `torch.full((4,), -nan)`, loses the sign with any backend:
    not this launch, whose constants stay in the kernel side table.)"""
    bound, page_size = 8192, 64

    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        bs = seq_lens.shape[0]
        lcm = 4096 // page_size
        blocks = (m + page_size - 1) // page_size
        if blocks % lcm != 0:
            blocks = (blocks + lcm - 1) // lcm * lcm
            value = float("nan")
        else:
            value = -float("nan")  # the bound's outcome at 8192: 128 pages
        table = torch.full((bs, blocks), -1, dtype=torch.int32)
        KERNEL[(bs,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), blocks, PAGED_SIZE=page_size)
        out = torch.zeros(4, dtype=torch.float32)
        FILL[(1,)](out, value, 4)
        return torch.ops.syncfree_test.paged_sum(table, seq_lens, k, m), out

    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    for m in [bound, 4096, 4095, 1, 0, 100, 4097]:
        inputs = paged_inputs([m, min(m, 3)], bound, page_size, 0, reqs=REQS, heads=2, dim=8)
        with dynamo_sees_triton():
            got, got_fill = call(*inputs)
        want, want_fill = step(*inputs)
        torch.testing.assert_close(got, want)
        assert torch.equal(got_fill.view(torch.int32), want_fill.view(torch.int32)), (m, got_fill, want_fill)
    assert not any(r.rewritten for r in backend.reports), "\n".join(map(str, backend.reports))

# -- a scratch grown from None (issue 45, item 5) ---------------------------------------------------------------
# SGLang's FlashMLABackend._eager_block_kv_indices on a fresh backend: the scratch is None, so the first step
# allocates `(bs, n)` and slices all of it, `buf[:bs, :n]`: a full view of the allocation, the same table. Later
# steps find the scratch the first one stored, at the static width, and slice it (the sliced-scratch form).
def grown_step(state: Scratch):
    return grown_scratch_step(state, WRITER, PS)


def realistic_inputs(lengths, bound, seed=0):
    """make_inputs at a realistic bound: a token table of `bound` tokens per request over a pool of small heads."""
    return paged_inputs(lengths, bound, PS, seed, reqs=REQS, heads=2, dim=8)


@pytest.mark.parametrize("bound", [MCL, 4096, 32768])
def test_a_scratch_grown_from_none_reaches_the_static_width_in_the_first_compiled_call(bound):
    """A fresh backend, the first compiled step at a short max: the allocation and its full view are one table,
    rewritten to the bound's pages, and the scratch stored at that width; every later step slices it without a
    host read. Eager runs on its own state; the outputs and the stored table's cells within each row's pages are
    eager's."""
    pages = -(-bound // PS)
    compiled_state, eager_state = Scratch(), Scratch()
    compiled, backend = compile_traced(grown_step(compiled_state), dynamic=False, max_context_len=bound,
                                       static_escapes=True)
    eager = grown_step(eager_state)
    vectors = [[1, 1, 1], [bound, 3, 0], [bound - PS, PS + 1, 7], [PS, bound // 2, 1], [0, 0, 0], [2, 3],
               [1, 2, 3, 4, 5], [bound, 1, 1, 1, bound - 1], [7, 7]]  # five rows: the scratch regrown
    for n, lengths in enumerate(vectors):
        got, want = compiled(*realistic_inputs(lengths, bound, n)), eager(*realistic_inputs(lengths, bound, n))
        torch.testing.assert_close(got, want)
        assert compiled_state.buf.shape[1] == pages, "the scratch did not leave at the static width"
        for b, length in enumerate(lengths):
            used = -(-length // PS)
            assert torch.equal(compiled_state.stored[b, :used], eager_state.stored[b, :used])
    reports = backend.reports
    assert len(reports) == 6 and all(not r.kept and [i.rule for i in r.rewritten] == ["allocated_table"] for r in reports), \
        "\n".join(map(str, reports))
    assert "allocated table -> width" in reports[0].rewritten[0].reason  # the first call: the allocation
    assert all("sliced table -> width" in r.rewritten[0].reason for r in reports[1:])  # then the stored scratch
    regrown = [r for r in reports if f"regrown width max(n, {pages}) is {pages}" in r.rewritten[0].reason]
    assert len(regrown) == 1, "\n".join(map(str, reports))  # five rows: `max(n, buf.shape[1])` covered


def test_under_cudagraphs_the_graph_that_allocates_the_scratch_runs_without_them():
    """Found on the H200 (2026-12-05): the first call's graph stored its allocation as the scratch, an output in
    the CUDA-graph pool that the next replay overwrote ("accessing tensor output of CUDAGraphs that has been
    overwritten by a subsequent run"). A graph that allocates a scratch it stores (grown from None, or regrown
    for more rows) asks for no CUDA graphs, and says why; the graphs that slice the stored scratch keep them."""
    from compile_pass.pipeline import CUDAGRAPHS_SCRATCH

    bound = 4096
    compiled_state, eager_state = Scratch(), Scratch()
    compiled, backend = compile_traced(grown_step(compiled_state), dynamic=False, max_context_len=bound,
                                       static_escapes=True, cudagraphs=True)
    eager = grown_step(eager_state)
    for n, lengths in enumerate([[1, 1, 1], [bound, 3, 0], [1, 2, 3, 4, 5], [7, 7]]):  # five rows: regrown
        torch.testing.assert_close(compiled(*realistic_inputs(lengths, bound, n)),
                                   eager(*realistic_inputs(lengths, bound, n)))
    allocating = ["allocated table -> width" in r.rewritten[0].reason or "regrown width" in r.rewritten[0].reason
                  for r in backend.reports]
    assert allocating == [True, False, True, False], "\n".join(map(str, backend.reports))
    for allocates, state in zip(allocating, backend.states):
        assert (CUDAGRAPHS_SCRATCH in state.notes) is allocates, state.notes
        assert ("triton.cudagraphs" in state.patches) is not allocates, state.patches


def test_a_regrown_width_narrower_than_the_bound_is_widened_to_it():
    """`max(n, C)` with C below the bound's pages (4 < 8) is at most 8 for every n within the bound, not C: the
    allocation gets the static width 8 (a temporary here: nothing else sees its width), eager's values."""
    def step(q, k, v, r2t, rpi, seq_lens):
        bs, n = seq_lens.shape[0], (seq_lens.max().item() + PS - 1) // PS
        table = torch.full((bs, max(n, 4)), -1, dtype=torch.int32)[:bs, :n]  # 4 < 8 pages
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    backend = _first_step_report(step)
    assert not backend.report.kept and "regrown width max(n, 4) is 8" in backend.report.rewritten[0].reason, \
        str(backend.report)


@pytest.mark.parametrize("use", ["returned", "summed", "as_int"])
def test_a_regrown_width_narrower_than_the_bound_used_otherwise_keeps_the_max(use):
    """Widened, `max(n, 4)` changes value: where it or its allocation is used for anything but the table (the
    allocation returned or read whole without static_escapes, the width itself returned), the max is kept."""
    def step(q, k, v, r2t, rpi, seq_lens):
        bs, n = seq_lens.shape[0], (seq_lens.max().item() + PS - 1) // PS
        cols = max(n, 4)
        buf = torch.full((bs, cols), -1, dtype=torch.int32)
        table = buf[:bs, :n]
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
        out = ATTN(q, k, v, table, seq_lens.to(torch.int32))
        if use == "returned":
            return out, buf
        if use == "summed":
            return out, buf.sum(dim=1)
        return out, torch.full((1,), cols)

    backend = _first_step_report(step)
    assert backend.report.kept and not backend.report.rewritten, str(backend.report)


# An eager step before the first compiled one left the scratch 2 pages wide: with 2 rows (fewer than the compiled
# batch: the grow branch is decided by the rows) or with 7 (as many as the batches: decided by the width, a branch
# on the max whose outcome differs inside [0, bound]).
NARROW_STARTS = {"rows": [100, 1], "width": [100, 1, 1, 1, 1, 1, 1]}


def _narrow_vectors(bound):
    edge = 2 * PS  # the largest max the narrow scratch holds
    return [[1, 1, 1], [edge, 5, 0], [edge + 1, 1, 1], [bound, 3, 0], [edge, edge, edge], [0, 0, 0],
            [bound - PS, PS + 1, 7], [2, 3], [1, 2, 3, 4, 5, 6, 7], [edge + 1, 7, 7], [7, 7, 7]]


def _narrow_pair(bound, step_of, start="width"):
    compiled_state, eager_state = Scratch(), Scratch()
    for state in (compiled_state, eager_state):
        step_of(state)(*realistic_inputs(NARROW_STARTS[start], bound, 99))
    assert compiled_state.buf.shape[1] == 2
    return compiled_state, eager_state


@pytest.mark.parametrize("start", sorted(NARROW_STARTS))
@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "automatic"])
@pytest.mark.parametrize("bound", [4096, 32768])
def test_a_scratch_left_narrower_reaches_the_static_width_in_the_first_compiled_call(bound, dynamic, start):
    """Issue 45 item 5: the first compiled step meets the scratch an eager step left 2 pages wide, at a max the
    narrow scratch holds (eager reuses it) and then past it. Under static_escapes the first compiled call stores the
    scratch at the bound's pages whatever the max (the grow branch's two outcomes: trace_signature.regrown_scratch;
    a scratch regrown for more rows: `max(n, 2)` widened), no graph break, no host read; the outputs and the
    stored table's cells within each row's pages are eager's, for maxima on both sides of the branch's edge."""
    pages = -(-bound // PS)
    compiled_state, eager_state = _narrow_pair(bound, grown_step, start)
    seen = len(compile_pass._compat.graph_break_reasons())
    compiled, backend = compile_traced(grown_step(compiled_state), dynamic=dynamic, max_context_len=bound,
                                       static_escapes=True, checked=True)
    eager = grown_step(eager_state)
    for n, lengths in enumerate(_narrow_vectors(bound)):
        got, want = compiled(*realistic_inputs(lengths, bound, n)), eager(*realistic_inputs(lengths, bound, n))
        torch.testing.assert_close(got, want)
        assert compiled_state.buf.shape[1] == pages and compiled_state.buf.dtype == eager_state.buf.dtype
        for b, length in enumerate(lengths):
            used = -(-length // PS)
            assert torch.equal(compiled_state.stored[b, :used], eager_state.stored[b, :used])
    assert compile_pass._compat.graph_break_reasons()[seen:] == []
    reports = backend.reports
    assert all(not r.kept and [i.rule for i in r.rewritten] == ["allocated_table"] for r in reports), \
        "\n".join(map(str, reports))
    assert f"regrown width max(n, 2) is {pages}" in reports[0].rewritten[0].reason, str(reports[0])


def test_a_check_the_other_outcome_contradicts_gives_eager_values():
    """The user's `torch._check(m > 2 * PS)` after the grow branch: the other outcome's trace (m <= 128) fails on
    it, and the branch is left to Dynamo (found by a helper's programs, 2026-12-05: every valid call raised)."""
    bound = 4096

    def checked_step(state):
        def step(q, k, v, r2t, rpi, seq_lens):
            bs, m = seq_lens.shape[0], seq_lens.max().item()
            n = (m + PS - 1) // PS
            buf = state.buf
            if buf.shape[1] < n:
                buf = torch.full((buf.shape[0], max(n, buf.shape[1])), -1, dtype=torch.int32)
                state.buf = buf
            torch._check(m > 2 * PS)  # the caller's promise: long contexts only
            table = buf[:bs, :n]
            WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
            return ATTN(q, k, v, table, seq_lens.to(torch.int32))

        return step

    compiled_state, eager_state = _narrow_pair(bound, grown_step)
    compiled, _ = compile_traced(checked_step(compiled_state), dynamic=False, max_context_len=bound,
                                 static_escapes=True, checked=True)
    eager = checked_step(eager_state)
    for n, lengths in enumerate([[2 * PS + 1, 1, 1], [bound, 1, 1], [300, 200, 1]]):
        torch.testing.assert_close(compiled(*realistic_inputs(lengths, bound, n)),
                                   eager(*realistic_inputs(lengths, bound, n)))


def test_without_static_escapes_a_scratch_left_narrower_breaks_at_its_branch():
    """The regrown scratch leaves wider than eager's: without static_escapes the branch is not settled (a graph
    break at the user's line, eager's values and eager's scratch)."""
    bound = 4096
    compiled_state, eager_state = _narrow_pair(bound, grown_step)
    seen = len(compile_pass._compat.graph_break_reasons())
    compiled, backend = compile_traced(grown_step(compiled_state), dynamic=False, max_context_len=bound,
                                       checked=True)
    eager = grown_step(eager_state)
    for n, lengths in enumerate(_narrow_vectors(bound)[:4]):
        torch.testing.assert_close(compiled(*realistic_inputs(lengths, bound, n)),
                                   eager(*realistic_inputs(lengths, bound, n)))
        assert compiled_state.buf.shape == eager_state.buf.shape
    assert any(where.endswith("paged_steps.py:47") for _, where in compile_pass._compat.graph_break_reasons()[seen:])


def _variant_step(state, variant):
    """grown_scratch_step with one difference between the grow branch's outcomes that is not where the scratch's
    cells live: each must keep the two outcomes apart (eager's values, eager's state)."""
    def step(q, k, v, r2t, rpi, seq_lens):
        bs = seq_lens.shape[0]
        n = (seq_lens.max().item() + PS - 1) // PS
        buf = state.buf
        if buf is None or buf.shape[0] < bs or buf.shape[1] < n:
            rows = bs if buf is None else max(bs, buf.shape[0])
            cols = n if buf is None else max(n, buf.shape[1])
            dtype = torch.int64 if variant == "dtype" and buf is not None else torch.int32
            buf = torch.full((rows, cols), -1, dtype=dtype)
            state.buf = buf
            if variant == "counter":
                state.grown = getattr(state, "grown", 0) + 1
            if variant == "stored_twice":
                state.spare = buf
        elif variant == "reuse_stores":
            state.reused = True
        previous = state.stored  # the last step's table: a view of the scratch eager writes again
        table = buf[:bs, :n]
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
        state.stored = table
        out = ATTN(q, k, v, table[:bs], seq_lens.to(torch.int32))
        if variant == "stale":  # the scratch's own cells past the table: eager's stale ones, or the fill
            return out, state.buf[:, -1].sum()
        if variant == "previous_view":  # found by a helper's programs (2026-12-05): eager's write shows through it
            # its first page (within every row's pages: the vectors of this variant have no empty row)
            return out, previous[:, :1].clone() if previous is not None else out
        return out

    return step


@pytest.mark.parametrize("variant", ["counter", "stored_twice", "reuse_stores", "dtype", "stale", "previous_view"])
def test_outcomes_that_differ_in_more_than_the_scratch_are_not_one_computation(variant):
    """Under static_escapes, the grow branch's outcomes are related only where they differ in where the scratch's
    cells live: another side effect in one outcome (a counter, the scratch stored twice, a flag), another dtype,
    the stale cells read, or a view of the scratch read (another input sharing its memory) keep them apart:
    eager's values and state, whatever the max."""
    bound = 4096
    compiled_state, eager_state = _narrow_pair(bound, lambda st: _variant_step(st, variant))
    compiled, backend = compile_traced(_variant_step(compiled_state, variant), dynamic=False,
                                       max_context_len=bound, static_escapes=True, checked=True)
    eager = _variant_step(eager_state, variant)
    vectors = [v for v in _narrow_vectors(bound) if variant != "previous_view" or min(v) > 0]
    for n, lengths in enumerate(vectors):
        torch.testing.assert_close(compiled(*realistic_inputs(lengths, bound, n)),
                                   eager(*realistic_inputs(lengths, bound, n)))
        for name in ("grown", "reused"):
            assert getattr(compiled_state, name, None) == getattr(eager_state, name, None), name
        assert compiled_state.buf.shape == eager_state.buf.shape and compiled_state.buf.dtype == eager_state.buf.dtype
        if variant == "stored_twice":
            assert compiled_state.spare is compiled_state.buf


def test_a_regrown_scratch_read_elsewhere_keeps_its_values():
    """The regrown allocation `(bs, max(n, 8))` returned whole (its -1 tail included) and sliced for the writer:
    rewritten, and every cell of it is eager's (its width is 8 for every max within the bound)."""
    def step(q, k, v, r2t, rpi, seq_lens):
        bs, n = seq_lens.shape[0], (seq_lens.max().item() + PS - 1) // PS
        buf = torch.full((bs, max(n, MCL // PS)), -1, dtype=torch.int32)
        table = buf[:bs, :n]
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32)), buf.sum(dim=1)

    backend = _first_step_report(step)
    assert not backend.report.kept and "regrown width max(n, 8) is 8" in backend.report.rewritten[0].reason, \
        str(backend.report)


def _first_step_report(step, **options):
    backend = Rewriting(max_context_len=MCL, **options)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for lengths in ([5, 130, 64], [512, 1, 0]):
        with compile_pass._compat.capture_scalar_outputs():
            got = compiled(*make_inputs(lengths))
        torch.testing.assert_close(got, step(*make_inputs(lengths)))
    return backend


def test_a_view_of_fewer_rows_than_the_allocation_is_a_second_table():
    def step(q, k, v, r2t, rpi, seq_lens):
        bs, n = seq_lens.shape[0], (seq_lens.max().item() + PS - 1) // PS
        buf = torch.full((bs + 1, n), -1, dtype=torch.int32)
        table = buf[:bs, :n]  # not all of buf: rows past bs stay -1, but the view is not the allocation
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    assert kept_codes(_first_step_report(step)) == [("width_use", "allocated_table")]


def test_the_allocation_passed_to_its_writer_beside_its_full_view_keeps_the_max():

    def step(q, k, v, r2t, rpi, seq_lens):
        bs, n = seq_lens.shape[0], (seq_lens.max().item() + PS - 1) // PS
        buf = torch.full((bs, n), -1, dtype=torch.int32)
        table = buf[:bs, :n]
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
        WRITER(r2t, rpi, seq_lens, buf, buf.stride(0), PS)  # the allocation written again, directly
        return ATTN(q, k, v, table, seq_lens.to(torch.int32))

    codes = kept_codes(_first_step_report(step))
    assert codes and codes[0][1] == "allocated_table" and codes[0][0] in ("table_written", "table_argument"), codes


def test_a_full_view_that_escapes_without_static_escapes_keeps_the_max():
    def step(q, k, v, r2t, rpi, seq_lens):
        bs, n = seq_lens.shape[0], (seq_lens.max().item() + PS - 1) // PS
        table = torch.full((bs, n), -1, dtype=torch.int32)[:bs, :n]
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), PS)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32)), table

    backend = Rewriting(max_context_len=MCL)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    with compile_pass._compat.capture_scalar_outputs():
        compiled(*make_inputs([5, 130, 64]))
    assert kept_codes(backend) == [("escapes", "allocated_table")], str(backend.report)
    backend = Rewriting(max_context_len=MCL, static_escapes=True)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    with compile_pass._compat.capture_scalar_outputs():
        got, table = compiled(*make_inputs([5, 130, 64]))
    want, want_table = step(*make_inputs([5, 130, 64]))
    torch.testing.assert_close(got, want)
    assert table.shape[1] == MCL // PS and torch.equal(table[:, : want_table.shape[1]], want_table)
    assert not backend.report.kept, str(backend.report)

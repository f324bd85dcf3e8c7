"""The "Bad lengths" contract (README.md and docs/api.md, one table; issue 28): what a length outside [0, bound]
or an out-of-range request index does, in every op and every rule.

Op rows run on the path this process takes (the vectorized torch path on CPU) and, in a subprocess with
TRITON_INTERPRET=1, through the Triton kernels (test_this_file_under_the_interpreter). Rule rows compile with the
pass-only backend (tests/passlib.py) and then call the compiled step with the bad input at the same shapes. A rule
row that the rules do not meet yet is `xfail(strict=True, reason="rule side pending")`: it flips when they do.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compile_pass
from compile_pass import _compat
from conftest_helpers import interpreting
from passlib import Rewriting, make_fb, make_qkv, run

HERE = Path(__file__).resolve().parent
PAGED = torch.ops.syncfree.paged_decode
pending = pytest.mark.xfail(strict=True, reason="rule side pending")


# -- the ops -------------------------------------------------------------------------------------------------
def paged_reference(q, k_cache, v_cache, page_table, lengths, scale):
    """A plain loop in float64: row b attends keys t < L_b = clamp(lengths[b], 0, W * page_size), key t being
    slot t % page_size of page page_table[b, t // page_size]; a key whose page id is outside [0, num_pages) is
    skipped; query i sits at L_b - Sq + i; a query that sees no key gets zeros."""
    batch, sq, hq, dim = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    width = page_table.shape[1]
    out = torch.zeros(batch, sq, hq, dim, dtype=torch.float64)
    for b in range(batch):
        length = min(max(int(lengths[b]), 0), width * page_size)
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(sq):
                keys = [t for t in range(length) if t <= length - sq + i
                        and 0 <= int(page_table[b, t // page_size]) < num_pages]
                if not keys:
                    continue
                ks = torch.stack([k_cache[int(page_table[b, t // page_size]), t % page_size, kh] for t in keys])
                vs = torch.stack([v_cache[int(page_table[b, t // page_size]), t % page_size, kh] for t in keys])
                scores = (ks.double() @ q[b, i, h].double()) * scale
                out[b, i, h] = torch.softmax(scores, 0) @ vs.double()
    return out


PAGED_CASES = {
    # lengths, page-table entries to spoil ((row, column, value)), Sq, page_size
    "negative and zero": ([-3, 0, 5], (), 1, 4),
    "past the table": ([9, 100, 12], (), 1, 4),
    "shorter than the queries": ([2, 0, 7], (), 3, 4),
    "page ids outside the pool": ([12, 7, 10], ((0, 1, -1), (1, 0, 10 ** 6), (2, 2, 24)), 1, 4),
    "odd page size": ([-1, 11, 40], (), 2, 3),
}


def paged_inputs(lengths, spoil, sq, page_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, width, num_pages = len(lengths), 3, 24
    q = torch.randn(batch, sq, 4, 8, generator=gen)
    k = torch.randn(num_pages, page_size, 2, 8, generator=gen)
    v = torch.randn(num_pages, page_size, 2, 8, generator=gen)
    table = torch.randperm(num_pages, generator=gen)[: batch * width].view(batch, width).to(torch.int32)
    for row, col, value in spoil:
        table[row, col] = value
    return q, k, v, table, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("case", sorted(PAGED_CASES))
def test_paged_decode_clamps_lengths_and_skips_pages_it_does_not_have(case):
    q, k, v, table, lens = paged_inputs(*PAGED_CASES[case])
    want = paged_reference(q, k, v, table, lens, 1 / math.sqrt(q.shape[-1]))
    got = PAGED(q, k, v, table, lens)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    compiled = torch.compile(lambda *a: PAGED(*a), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, table, lens), got)  # eager and compiled alike


def test_paged_decode_empty_rows_are_zeros():
    q, k, v, table, lens = paged_inputs([-5, 0, 4], (), 2, 4)
    out = PAGED(q, k, v, table, lens)
    assert out[:2].eq(0).all() and out[2].abs().sum() > 0
    assert PAGED(q, k[:0], v[:0], table, lens).eq(0).all()  # a pool without pages: every row is empty


def test_paged_decode_fake_gives_the_real_shape_dtype_and_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, table, lens = paged_inputs([-3, 100, 5], (), 1, 4)
    real = PAGED(q, k, v, table, lens)
    with FakeTensorMode() as mode:
        fake = PAGED(*(mode.from_tensor(t) for t in (q, k, v, table, lens)))
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


def page_table_inputs():
    gen = torch.Generator().manual_seed(3)
    r2t = torch.randint(0, 1000, (4, 12), generator=gen, dtype=torch.int32)
    return r2t, torch.tensor([2, 0, 3]), torch.tensor([5, -4, 12])


def test_page_table_negative_length_is_an_empty_row_and_checked_raises_past_the_capacity():
    """The op's `checked` asserts the upper end only: the lengths a rule passes it are the consumer's, and
    `seq_lens - k` of a padded row is negative there (an empty row, as eager reads it)."""
    r2t, rpi, lens = page_table_inputs()
    out = torch.ops.syncfree.page_table(r2t, rpi, lens, 4, 3)
    torch.testing.assert_close(out[0, :2], (r2t[2, 0:8:4] // 4))
    torch.testing.assert_close(out[2], (r2t[3, 0:12:4] // 4))
    again = torch.ops.syncfree.page_table(r2t, rpi, lens, 4, 3, checked=True)  # a negative length: no assertion
    torch.testing.assert_close(again[[0, 2]][:, :2], out[[0, 2]][:, :2])  # the live columns
    buffer = torch.full((3, 3), -9, dtype=torch.int32)
    torch.ops.syncfree.page_table_(buffer, r2t, rpi, lens, 4, checked=True)
    assert buffer[1].eq(-9).all()  # the empty row writes nothing
    with pytest.raises(RuntimeError, match="static bound"):
        torch.ops.syncfree.page_table(r2t, rpi, torch.tensor([5, 0, 13]), 4, 3, checked=True)
    with pytest.raises(RuntimeError, match="static bound"):
        torch.ops.syncfree.page_table_(buffer, r2t, rpi, torch.tensor([5, 0, 13]), 4, checked=True)


def test_page_table_out_of_range_index_raises_under_checked_whatever_the_length():
    r2t, _, _ = page_table_inputs()
    rpi, lens = torch.tensor([2, 4, 1]), torch.tensor([5, 0, 3])  # index 4 of 4 rows, on a zero-length row
    torch.ops.syncfree.page_table(r2t, rpi, lens, 4, 3)  # unchecked: reads nothing through it
    with pytest.raises(RuntimeError, match="req_pool_indices"):
        torch.ops.syncfree.page_table(r2t, rpi, lens, 4, 3, checked=True)


def test_kv_indices_writes_nothing_for_negative_lengths_and_nothing_outside_the_buffer():
    r2t = torch.arange(40, dtype=torch.int32).view(4, 10)
    lens = torch.tensor([3, -2, 10])
    indptr = torch.tensor([0, 3, 3, 13])
    out = torch.full((8,), -7, dtype=torch.int32)
    torch.ops.syncfree.kv_indices(out, r2t, torch.tensor([1, 2, 3]), lens, indptr)
    assert out[:3].tolist() == [10, 11, 12] and out[3:].tolist() == [30, 31, 32, 33, 34]  # row 2 cut at 8


# -- the rules ---------------------------------------------------------------------------------------------
MCL = 32


def page_table_step(fb, q, k, v):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
    return PAGED(q, k, v, table, fb.seq_lens, max_seqlen_k=m)


def page_table_args(lengths, index=None):
    fb = make_fb(lengths)
    if index is not None:
        fb.req_pool_indices[index[0]] = index[1]
    return (fb, *make_qkv(len(lengths)))


def compiled_step(step, args, **options):
    out, backend, compiled = run(step, *args, **options)
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)
    return compiled


def call(compiled, *args):
    with _compat.capture_scalar_outputs():
        return compiled(*args)


def _tests_of(name: str):
    """Another test file's steps and inputs (test_flat_kv_indices registers its reader through an indptr on import;
    test_allocated_table makes its Triton writer traceable under the interpreter)."""
    import importlib
    import pathlib
    import sys

    # by the name pytest's importlib mode gives the file (tests.rules.<name>), so that it is imported once
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.append(root)
    return importlib.import_module(f"tests.rules.{name}")


def rule_case(rule: str):
    """(step, arguments it compiles with, arguments with other lengths, options) of a step that `rule` rewrites."""
    if rule == "page_table":
        return page_table_step, page_table_args([3, 9, 5]), page_table_args, {"max_context_len": MCL}
    if rule == "flat_kv_indices":
        flat = _tests_of("test_flat_kv_indices")
        return flat.step, flat.args_of([3, 9, 5]), flat.args_of, {"max_context_len": flat.MCL}
    ext = _tests_of("test_indptr_bound")
    q, k, v, pages, lens, _ = good = ext.case([3, 1, 4])
    return ext._pad_form, good, lambda extend: (q, k, v, pages, lens, torch.tensor(extend)), \
        {"max_context_len": ext.MCL}


OUTSIDE = {"page_table": [[3, 40, 5], [3, -1, 5]], "flat_kv_indices": [[3, 65, 5], [3, -1, 5]],
           "indptr_bound": [[3, 30, 4], [3, -1, 4]]}
PENDING: set = set()  # every rule asserts [0, bound] on the lengths the max covers


@pytest.mark.parametrize("rule,lengths", [
    pytest.param(r, v, id=f"{r}, {w}", marks=[pending] if (r, w) in PENDING else [])
    for r, vs in OUTSIDE.items() for v, w in zip(vs, ("past the bound", "negative"))])
def test_checked_raises_for_a_length_outside_the_bound(rule, lengths):
    step, good, with_lengths, options = rule_case(rule)
    compiled = compiled_step(step, good, **options)
    with pytest.raises(RuntimeError, match="outside|exceeds"):
        call(compiled, *with_lengths(lengths))


def test_page_table_rule_checked_raises_for_a_negative_page_count():
    """A page-level table (`req_to_page[rpi, :cdiv(m, ps)]`): the op gets page counts, and a length of -1 gives a
    count of 0, which the op's own check accepts: the rule's assertion must cover [0, bound] itself."""
    def step(fb, q, k, v):
        m = fb.seq_lens.max().item()
        pages = fb.req_to_token[:, ::4] // 4
        table = pages[fb.req_pool_indices, : (m + 3) // 4]
        return PAGED(q, k, v, table, fb.seq_lens, max_seqlen_k=m)

    compiled = compiled_step(step, page_table_args([3, 9, 5]), max_context_len=MCL)
    with pytest.raises(RuntimeError):
        call(compiled, *page_table_args([3, -1, 5]))


def narrowed_step(fb, q, k, v):
    """The consumer reads the lengths narrowed to int32 (`seq_lens.int()`, as SGLang's kernels take them)."""
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
    return PAGED(q, k, v, table, fb.seq_lens.int(), max_seqlen_k=m)


WRAP = 1 << 32  # an int64 length of k + WRAP or k - WRAP narrows to the int32 value k


@pytest.mark.parametrize("lengths", [[MCL - WRAP], [5 + WRAP], [5, 3 - WRAP, 7], [MCL, MCL - WRAP, 1]],
                         ids=["negative, wraps to the bound", "past the bound, wraps to 5", "one row wraps",
                              "a row wraps to the max of the others"])
def test_checked_raises_for_a_wide_length_that_narrows_into_the_range(lengths):
    """The range is asserted on the values the max was taken over, before the consumer's int64 -> int32
    narrowing: a length outside [0, bound] whose int32 value lies inside it raises too (found by the trace-time
    generator with new seeds: the assertion on the narrowed values let -2**32 + bound through)."""
    compiled = compiled_step(narrowed_step, page_table_args([3, 9, 5]), max_context_len=MCL)
    with pytest.raises(RuntimeError, match=rf"outside \[0, {MCL}\]"):
        call(compiled, *page_table_args(lengths))


def test_unchecked_narrowing_is_compared_in_int64():
    """checked=False keeps the proof's own premise, that the narrowed lengths are within the max of the wide ones.
    The max is a 0-dim int64 tensor, which type promotion would cast to the lengths' int32 (wrapping -2**32 + 32
    to 32, the very value it is compared with): the comparison is made in int64, and the step raises."""
    compiled = compiled_step(narrowed_step, page_table_args([3, 9, 5]), max_context_len=MCL, checked=False)
    with pytest.raises(RuntimeError, match="do not fit int32"):
        call(compiled, *page_table_args([MCL - WRAP]))
    for lengths in ([0, 0, 0], [MCL, 1, 2], [7, MCL, 0]):  # within the bound: eager's values
        torch.testing.assert_close(call(compiled, *page_table_args(lengths)), narrowed_step(*page_table_args(lengths)))


def test_page_table_rule_checked_raises_for_an_out_of_range_index_on_a_zero_length_row():
    compiled = compiled_step(page_table_step, page_table_args([3, 9, 5]), max_context_len=MCL)
    with pytest.raises(RuntimeError, match="req_pool_indices"):
        call(compiled, *page_table_args([3, 0, 5], index=(1, 6)))


@pending
def test_flat_kv_indices_rule_checked_raises_for_an_out_of_range_index_on_a_zero_length_row():
    step, good, with_lengths, options = rule_case("flat_kv_indices")
    compiled = compiled_step(step, good, **options)
    fb, values = with_lengths([3, 0, 5])
    fb.req_pool_indices[1] = 6
    with pytest.raises(RuntimeError):
        call(compiled, fb, values)


UNCHECKED = {"page_table": [([3, 40, 5], None), ([3, -1, 5], None), ([3, 0, 5], (1, 6)), ([3, 9, 5], (1, 100))],
             "indptr_bound": [([3, 1, 30], None), ([3, -1, 4], None)]}


@pytest.mark.parametrize("rule,lengths,index", [(r, v, i) for r, cases in UNCHECKED.items() for v, i in cases])
def test_unchecked_reads_nothing_out_of_bounds(rule, lengths, index):
    """checked=False: no assertion, and nothing out of bounds (on CPU an out-of-bounds index raises IndexError,
    so running through is the evidence); the values of the bad rows are unspecified."""
    step, good, with_lengths, options = rule_case(rule)
    compiled = compiled_step(step, good, **options, checked=False)
    args = page_table_args(lengths, index) if index else with_lengths(lengths)
    assert call(compiled, *args).shape == call(compiled, *good).shape


@pending
def test_flat_kv_indices_rule_unchecked_reads_nothing_out_of_bounds():
    """checked=False and a total past B x bound: the reader through the indptr must not read past the static
    buffer (today the test reader, which checks its reads, raises)."""
    step, good, with_lengths, options = rule_case("flat_kv_indices")
    compiled = compiled_step(step, good, max_context_len=8, checked=False)
    call(compiled, *with_lengths([3, 60, 5]))


needs_interpreter = pytest.mark.skipif(not interpreting(), reason="runs in a subprocess with TRITON_INTERPRET=1 "
                                                                  "(test_this_file_under_the_interpreter)")


def _allocated_compiled(**options):
    alloc = _tests_of("test_allocated_table")
    backend = Rewriting(max_context_len=alloc.MCL, **options)
    compiled = torch.compile(alloc.flashmla_step, backend=backend, fullgraph=True)
    with alloc.dynamo_sees_triton(), _compat.capture_scalar_outputs():
        compiled(*alloc.make_inputs([5, 130, 64]))
    assert backend.report.rewritten, str(backend.report)
    return alloc, compiled


@needs_interpreter
def test_allocated_table_rule_checked_raises_for_a_length_past_the_bound():
    alloc, compiled = _allocated_compiled()
    with alloc.dynamo_sees_triton(), _compat.capture_scalar_outputs(), pytest.raises(RuntimeError):
        compiled(*alloc.make_inputs([5, 600, 64], width=1024))


@needs_interpreter
def test_allocated_table_rule_checked_raises_for_a_negative_length():
    alloc, compiled = _allocated_compiled()
    with alloc.dynamo_sees_triton(), _compat.capture_scalar_outputs(), pytest.raises(RuntimeError):
        compiled(*alloc.make_inputs([5, -1, 64]))


@needs_interpreter
def test_allocated_table_rule_unchecked_runs_bad_lengths_in_bounds():
    alloc, compiled = _allocated_compiled(checked=False)
    with alloc.dynamo_sees_triton(), _compat.capture_scalar_outputs():
        for lengths in ([5, -1, 64], [5, 600, 64]):
            compiled(*alloc.make_inputs(lengths, width=1024))


# -- the same file through the Triton kernels ----------------------------------------------------------------
def test_this_file_under_the_interpreter():
    if interpreting():
        return
    triton = pytest.importorskip("triton")
    numpy = pytest.importorskip("numpy")
    found = [int(p) for p in re.findall(r"\d+", triton.__version__)[:2]]
    if found < [3, 7] and [int(p) for p in re.findall(r"\d+", numpy.__version__)[:2]] >= [2, 4]:
        pytest.skip(f"triton {triton.__version__}'s interpreter rejects numpy {numpy.__version__}")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging",
                           "-k", "paged_decode or page_table_negative or out_of_range_index_raises_under or "
                           "kv_indices_writes or allocated_table", str(Path(__file__))],
                          env=env, capture_output=True, text=True, timeout=600, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert int(re.search(r"(\d+) passed", proc.stdout).group(1)) >= 10, proc.stdout[-2000:]

"""Issue 18's defects, each as a program that the previous release rewrote wrongly (or failed to compile):
what the pass does not recognise keeps the max, and the compiled step equals eager. Reason CODES are asserted,
not prose. The pass runs on Dynamo graphs without Inductor (passlib.run), so this file is fast.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from passlib import make_fb, run

MCL = 64
SUM = torch.ops.syncfree_test.bounded_sum


def codes(backend) -> list[str]:
    return [i.reason_code for i in backend.report.kept]


def same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
        return
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    torch.testing.assert_close(a, b)


def check_kept(step, fb_factory, code, **options):
    """Compile on one batch, compare with eager on it and on two more, and require the max kept with `code`."""
    fb = fb_factory([3, 9, 5])
    ref_fb = fb_factory([3, 9, 5])
    out, backend, compiled = run(step, fb, max_context_len=MCL, **options)
    same(out, step(ref_fb))
    assert fb.seq_lens.tolist() == ref_fb.seq_lens.tolist()
    assert torch.equal(fb.req_to_token, ref_fb.req_to_token)
    assert not backend.report.rewritten, str(backend.report)
    assert code in codes(backend), str(backend.report)
    for lengths in ([7, 1, 30], [0, 12, 2]):
        a, b = fb_factory(lengths), fb_factory(lengths)
        with compile_pass._compat.capture_scalar_outputs():
            same(compiled(a), step(b))
    return backend


# -- 1. writes the proof did not see ---------------------------------------------------------------------
def _dunder_iadd(fb):
    m = fb.seq_lens.max().item()
    t = fb.req_to_token[fb.req_pool_indices, :m]
    fb.seq_lens.__iadd__(20)
    return SUM(t, fb.seq_lens, 1, m + 32)


def _tensor_iadd(fb):
    m = fb.seq_lens.max().item()
    t = fb.req_to_token[fb.req_pool_indices, :m]
    torch.Tensor.__iadd__(fb.seq_lens, 20)
    return SUM(t, fb.seq_lens, 1, m + 32)


def _dunder_ixor_table(fb):
    m = fb.seq_lens.max().item()
    t = fb.req_to_token[fb.req_pool_indices, :m]
    fb.req_to_token.__ixor__(5)
    fb.req_to_token.__ilshift__(1)
    return SUM(t, fb.seq_lens, 1, m)


def _numpy_inplace(fb):
    m = fb.seq_lens.max().item()
    t = fb.req_to_token[fb.req_pool_indices, :m]
    a = fb.seq_lens.numpy()
    a += 20
    return SUM(t, fb.seq_lens, 1, m + 32)


def _numpy_fill(fb):
    m = fb.seq_lens.max().item()
    t = fb.req_to_token[fb.req_pool_indices, :m]
    a = fb.seq_lens.numpy()
    a.fill(8)
    return SUM(t, fb.seq_lens, 1, m)


@torch._dynamo.allow_in_graph
def _writes_its_argument(lens):
    lens.add_(30)
    return lens.sum()


def _allow_in_graph_writer(fb):
    m = fb.seq_lens.max().item()
    t = fb.req_to_token[fb.req_pool_indices, :m]
    total = _writes_its_argument(fb.seq_lens)
    return SUM(t, fb.seq_lens, 1, m + 40), total


def _clamp_out_through_the_packet(fb):
    m = fb.seq_lens.max().item()
    t = fb.req_to_token[fb.req_pool_indices, :m]
    torch.ops.aten.clamp(fb.seq_lens, 40, 60, out=fb.seq_lens)
    return SUM(t, fb.seq_lens, 1, 64)


def _add_packet(fb):
    m = fb.seq_lens.max().item()
    t = fb.req_to_token[fb.req_pool_indices, :m]
    torch.ops.aten.add_(fb.seq_lens, 1)
    return SUM(t, fb.seq_lens, 1, m + 1)


@pytest.mark.parametrize("step", [_dunder_iadd, _tensor_iadd, _dunder_ixor_table, _numpy_inplace, _numpy_fill,
                                  _allow_in_graph_writer, _clamp_out_through_the_packet, _add_packet],
                         ids=lambda f: f.__name__.strip("_"))
def test_an_unseen_write_keeps_the_max(step):
    backend = check_kept(step, make_fb, "written")
    assert not backend.report.fell_back


# -- 2. the chained gather's window starts at the row gather ----------------------------------------------
def _write_between_row_gather_and_slice(fb):
    m = fb.seq_lens.max().item()
    rows = fb.req_to_token[fb.req_pool_indices]
    fb.req_to_token[:, :8] += 1000
    return SUM(rows[:, :m], fb.seq_lens, 1, m)


def _indices_written_between(fb):
    m = fb.seq_lens.max().item()
    rows = fb.req_to_token[fb.req_pool_indices]
    fb.req_pool_indices.add_(1).remainder_(6)
    return SUM(rows[:, :m], fb.seq_lens, 1, m)


@pytest.mark.parametrize("step", [_write_between_row_gather_and_slice, _indices_written_between],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_write_after_the_row_gather_keeps_the_max(step):
    check_kept(step, make_fb, "written")


# -- 3. facts cover what the consumer returns -------------------------------------------------------------
_lib = torch.library.Library("syncfree_overloads", "DEF")  # noqa: TOR901
_lib.define("rowsum(Tensor page_table, Tensor lens, int page_size, SymInt max_seqlen_k) -> Tensor")
_lib.define("rowsum.flipped(Tensor lens, Tensor page_table, int page_size, SymInt max_seqlen_k) -> Tensor")
_lib.define("colmask(Tensor page_table, Tensor lens, int page_size) -> Tensor")


def _rowsum(page_table, lens, page_size, max_seqlen_k):
    """Sums each row's live pages, in the table's own dtype (so an int64 table gives int64)."""
    n = (lens.clamp(min=0) + page_size - 1) // page_size
    live = torch.arange(page_table.shape[1])[None, :] < n[:, None]
    return torch.where(live, page_table, 0).sum(1).to(page_table.dtype)


def _colmask(page_table, lens, page_size):
    n = (lens.clamp(min=0) + page_size - 1) // page_size
    return (torch.arange(page_table.shape[1])[None, :] < n[:, None]).to(torch.int32)


_lib.impl("rowsum", _rowsum, "CPU")
_lib.impl("rowsum.flipped", lambda lens, t, ps, m: _rowsum(t, lens, ps, m), "CPU")
_lib.impl("colmask", _colmask, "CPU")
torch.library.register_fake("syncfree_overloads::rowsum", lambda t, lens, ps, m: t.new_empty((t.shape[0],)),
                            lib=_lib)
torch.library.register_fake("syncfree_overloads::rowsum.flipped", lambda lens, t, ps, m: t.new_empty((t.shape[0],)),
                            lib=_lib)
torch.library.register_fake("syncfree_overloads::colmask", lambda t, lens, ps: t.new_empty(t.shape,
                                                                                            dtype=torch.int32),
                            lib=_lib)
compile_pass.register_self_guarding_consumer(torch.ops.syncfree_overloads.rowsum.default, page_table="page_table",
                                             lengths="lens", upper_bounds=("max_seqlen_k",))
compile_pass.register_self_guarding_consumer("syncfree_overloads::colmask", page_table="page_table", lengths="lens")


def test_facts_belong_to_one_overload():
    assert "syncfree_overloads::rowsum.default" in compile_pass.registered_consumers()
    assert "syncfree_overloads::rowsum.flipped" not in compile_pass.registered_consumers()

    def registered(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_overloads.rowsum.default(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens,
                                                           1, m)

    def other_overload(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_overloads.rowsum.flipped(fb.seq_lens, fb.req_to_token[fb.req_pool_indices, :m],
                                                           1, m)

    fb = make_fb([3, 9, 5])
    out, backend, _ = run(registered, fb, max_context_len=MCL)
    same(out, registered(make_fb([3, 9, 5])))
    assert backend.report.rewritten and not backend.report.kept
    check_kept(other_overload, make_fb, "not_a_consumer")


def test_a_consumer_whose_output_follows_the_width_keeps_the_max():
    def step(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_overloads.colmask(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1)

    check_kept(step, make_fb, "output_changes")


def _int64_fb(lengths):
    fb = make_fb(lengths)
    # Slot values with tags in the high bits: >= 2**31, so an int64 -> int32 cast changes them.
    fb.req_to_token = fb.req_to_token.to(torch.int64) + (7 << 33)
    return fb


def test_a_consumer_given_an_int64_table_keeps_the_max():
    """The page-table op builds int32; a consumer that eager gave int64 values (tags in the high bits) would see
    them truncated, so the max is kept and the consumer gets exactly what eager gave it."""
    def step(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_overloads.rowsum(fb.req_to_token[fb.req_pool_indices, :m:4] // 4, fb.seq_lens, 4,
                                                   m)

    backend = check_kept(step, _int64_fb, "wide_table")
    assert backend.report.kept[0].rule == "page_table"


def test_a_narrowing_cast_before_the_division_keeps_the_max():
    def step(fb):
        m = fb.seq_lens.max().item()
        return SUM(fb.req_to_token[fb.req_pool_indices, :m:4].to(torch.int32) // 4, fb.seq_lens, 4, m)

    check_kept(step, _int64_fb, "table_cast")


def test_a_narrowing_cast_after_the_division_is_the_ops_own_truncation():
    def step(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_overloads.rowsum((fb.req_to_token[fb.req_pool_indices, :m:4] // 4).to(torch.int32),
                                                   fb.seq_lens, 4, m)

    out, backend, compiled = run(step, _int64_fb([3, 9, 5]), max_context_len=MCL)
    assert backend.report.rewritten, str(backend.report)
    same(out, step(_int64_fb([3, 9, 5])))
    with compile_pass._compat.capture_scalar_outputs():
        same(compiled(_int64_fb([33, 1, 64])), step(_int64_fb([33, 1, 64])))


# -- 5. a dimension the user marked dynamic is never specialized -----------------------------------------
def test_a_token_table_width_marked_dynamic_is_not_specialized():
    def step(fb):
        m = fb.seq_lens.max().item()
        return SUM(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)

    fb = make_fb([3, 9, 5])
    torch._dynamo.mark_dynamic(fb.req_to_token, 1)
    out, backend, _ = run(step, fb, max_context_len=MCL)  # raised ConstraintViolationError before
    same(out, step(make_fb([3, 9, 5])))
    assert "dynamic_width" in codes(backend), str(backend.report)


# -- 6. what the report promises --------------------------------------------------------------------------
def test_an_empty_batch_after_a_full_one_raises_as_eager_does():
    def step(fb):
        m = fb.seq_lens.max().item()
        return SUM(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)

    from passlib import Rewriting

    backend = Rewriting(max_context_len=MCL)
    fn = torch.compile(step, backend=backend, fullgraph=True)
    with compile_pass._compat.capture_scalar_outputs():
        same(fn(make_fb([3, 9, 5])), step(make_fb([3, 9, 5])))
        with pytest.raises(Exception) as eager:
            step(make_fb([]))
        with pytest.raises(Exception) as compiled_error:
            fn(make_fb([]))
        same(fn(make_fb([4, 2, 8])), step(make_fb([4, 2, 8])))
    assert type(compiled_error.value) is type(eager.value) or isinstance(compiled_error.value, RuntimeError)
    assert any(i.reason_code == "empty_lengths" for r in backend.reports for i in r.kept)


def test_a_data_dependent_branch_is_counted_as_a_host_sync():
    def step(fb):
        if fb.seq_lens.max() > 3:  # a graph break: Python reads the comparison on the host
            return fb.seq_lens + 1
        return fb.seq_lens - 1

    torch._dynamo.reset()
    compiled = compile_pass.compile(step, max_context_len=MCL)
    torch.testing.assert_close(compiled(make_fb([3, 9, 5])), step(make_fb([3, 9, 5])))
    merged = compile_pass.SyncReport.merge(compile_pass.reports(compiled))
    breaks = [i for i in merged.kept if i.kind == "graph_break"]
    assert breaks and breaks[0].host_sync and breaks[0].reason_code == "graph_break"
    assert breaks[0].location.startswith("test_sound_by_construction.py:")
    assert merged.syncs_remaining >= 1


def test_without_capture_scalar_outputs_the_report_names_the_break_and_the_fix():
    def step(fb):
        m = fb.seq_lens.max().item()
        return SUM(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)

    torch._dynamo.reset()
    assert not torch._dynamo.config.capture_scalar_outputs
    compiled = torch.compile(step, backend="syncfree", options={"max_context_len": MCL})
    with pytest.warns(UserWarning, match="host sync"):
        compiled(make_fb([3, 9, 5]))
    report = compile_pass.last_report()
    assert any(i.kind in ("graph_break", "item") and "capture_scalar_outputs" in i.reason and i.host_sync
               for i in report.kept), str(report)
    assert "no sync point found" not in str(report)


def test_numpy_reads_are_write_free_but_numpy_writes_are_not():
    from compile_pass.mutations import PURE_NUMPY

    assert {"max", "amax", "item"} <= PURE_NUMPY and "fill" not in PURE_NUMPY and "iadd" not in PURE_NUMPY
    assert np is not None

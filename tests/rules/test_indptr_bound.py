"""The indptr-bound rule (issue 20, recipe 1): `m = int(extend_seq_lens.max())` passed as the upper bound of a
consumer that reads row b's queries at [qo_indptr[b], qo_indptr[b + 1]), qo_indptr the cumulative sum of the same
lengths, becomes a static bound. Each compiled step is compared with eager over many length vectors (pass-only
backend), kept variants assert their reason codes, one case runs through Inductor."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import compile_pass
from compile_pass import rules
from passlib import run

MCL = 24  # max_context_len
PS = 4
HQ, HKV, D = 4, 2, 8
EXT = torch.ops.syncfree.ragged_extend_attention


def case(extend, prefix=None, seed=0, dtype=torch.int64):
    """Rows with `extend[b]` new queries after `prefix[b]` cached keys: (q, k, v, table, cache_seqlens, ext)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(extend)
    rng = random.Random(seed)
    prefix = prefix if prefix is not None else [rng.randint(0, MCL - e) for e in extend]
    lens = torch.tensor([p + e for p, e in zip(prefix, extend)], dtype=torch.int32)
    width = MCL // PS
    pages = torch.randperm(batch * width + 2, generator=gen)[: batch * width].view(batch, width).to(torch.int32)
    k = torch.randn(batch * width + 2, PS, HKV, D, generator=gen)
    v = torch.randn(batch * width + 2, PS, HKV, D, generator=gen)
    q = torch.randn(sum(extend), HQ, D, generator=gen)
    return q, k, v, pages, lens, torch.tensor(extend, dtype=dtype)


def reference(q, k, v, pages, lens, ext):
    """A plain loop in float64: row b's queries attend to the keys up to their positions."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for b in range(lens.shape[0]):
        n, e = int(lens[b]), int(ext[b])
        t = torch.arange(n)
        keys = k[pages[b, t // PS].long(), t % PS].double()  # [n, Hkv, D]
        vals = v[pages[b, t // PS].long(), t % PS].double()
        for i in range(e):
            pos = n - e + i
            for h in range(HQ):
                kv = h // (HQ // HKV)
                s = (keys[: pos + 1, kv] @ q[start + i, h].double()) / D ** 0.5
                out[start + i, h] = torch.softmax(s, 0) @ vals[: pos + 1, kv]
        start += e
    return out


def vectors(count, batches=(3, 1, 4, 2), top=8, seed=0):
    rng = random.Random(seed)
    out = []
    for n in range(count):
        out.append([rng.randint(0, top) for _ in range(batches[n % len(batches)])])
    out[0][0] = top
    return out


def _pad_form(q, k, v, pages, lens, ext):
    qo = F.pad(torch.cumsum(ext, 0), (1, 0))
    m = int(ext.max())
    return EXT(q, k, v, pages, lens, qo, m)


def _cat_form(q, k, v, pages, lens, ext):
    qo = torch.cat([torch.zeros(1, dtype=ext.dtype), ext.cumsum(0)])
    return EXT(q, k, v, pages, lens, qo, ext.max().item())


class Metadata:
    """SGLang's persistent qo_indptr buffer, filled per step."""

    def __init__(self):
        self.qo_indptr = torch.zeros(9, dtype=torch.int32)
        self.max_extend_len = None


META = Metadata()


def _buffer_form(q, k, v, pages, lens, ext):
    bs = ext.shape[0]
    qo = META.qo_indptr
    qo[1 : bs + 1] = torch.cumsum(ext, dim=0)
    qo = qo[: bs + 1]
    m = int(ext.max())
    return EXT(q, k, v, pages, lens, qo, max_extend_len=m)


FORMS = {"pad": _pad_form, "cat": _cat_form, "buffer": _buffer_form}


def compare(fn, count=6, top=8, extra=(), **options):
    """Compiled (pass-only backend, fresh per vector so every batch size is traced) vs eager; the reports."""
    reports = []
    for n, extend in enumerate(vectors(count, top=top)):
        args = case(extend, seed=n)
        want = fn(*args, *extra)
        torch._dynamo.reset()
        got, backend, _ = run(fn, *args, *extra, max_context_len=MCL, **options)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        reports.append(backend.report)
    return reports


def rewritten(report):
    return not report.kept and report.rewritten and report.syncs_remaining == 0


# -- the op itself --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extend", [[3, 1, 4], [0, 2], [5], [1, 0, 0, 2]])
def test_the_op_against_a_float64_loop(extend):
    q, k, v, pages, lens, ext = case(extend, seed=len(extend))
    qo = F.pad(torch.cumsum(ext, 0), (1, 0))
    for width in (max(extend), max(extend) + 3, MCL):  # any upper bound gives the same output
        got = EXT(q, k, v, pages, lens, qo, width)
        torch.testing.assert_close(got.double(), reference(q, k, v, pages, lens, ext), rtol=1e-5, atol=1e-5)


def test_the_op_leaves_queries_past_a_too_small_bound_at_zero():
    """As SGLang's extend kernel launches max_len_extend query blocks: a smaller value computes fewer queries."""
    q, k, v, pages, lens, ext = case([4, 2], seed=3)
    qo = F.pad(torch.cumsum(ext, 0), (1, 0))
    got = EXT(q, k, v, pages, lens, qo, 2)
    want = reference(q, k, v, pages, lens, ext)
    assert torch.count_nonzero(got[:2]) == 0  # row 0's first two queries: not launched
    torch.testing.assert_close(got[2:].double(), want[2:], rtol=1e-5, atol=1e-5)


def test_registration_checks_its_arguments():
    with pytest.raises(ValueError, match="'qo' is not an argument"):
        compile_pass.register_indptr_bound_consumer("syncfree::ragged_extend_attention", indptr="qo",
                                                    upper_bounds=("max_extend_len",))
    with pytest.raises(TypeError, match="tuple of argument names"):
        compile_pass.register_indptr_bound_consumer("syncfree::ragged_extend_attention", indptr="qo_indptr",
                                                    upper_bounds="max_extend_len")
    with pytest.raises(ValueError, match="at least one"):
        compile_pass.register_indptr_bound_consumer("syncfree::ragged_extend_attention", indptr="qo_indptr",
                                                    upper_bounds=())


def test_the_rule_is_registered_before_the_page_table_rule():
    names = [r.name for r in rules.registered_rules()]
    assert names.index("indptr_bound") < names.index("page_table")


# -- rewritten ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_indptr_spelling_is_rewritten_and_equals_eager(form):
    reports = compare(FORMS[form])
    for r in reports:
        assert rewritten(r), r
        assert f"max_extend_len -> {MCL}" in str(r) and f"bound {MCL} (max_context_len={MCL})" in str(r), r
    if form == "buffer":  # entry 0 of a buffer is not in the graph: asserted on the device
        assert "[0] == 0 asserted on the device" in str(reports[0]), reports[0]


def test_the_declared_bound_of_the_extend_lengths_is_used():
    reports = compare(_pad_form, length_bounds={"ext": 8})
    assert all(rewritten(r) and "max_extend_len -> 8" in str(r) and "length_bounds['ext']=8" in str(r)
               for r in reports), reports


def test_int32_lengths_and_an_offset_bound():
    def step(q, k, v, pages, lens, ext):
        ext = ext.to(torch.int32)
        qo = F.pad(torch.cumsum(ext, 0, dtype=torch.int32), (1, 0))
        return EXT(q, k, v, pages, lens, qo, int(ext.max()) + 2)

    reports = compare(step, length_bounds={"ext": 8})
    assert all(rewritten(r) and "max_extend_len -> 10" in str(r) for r in reports), reports


def test_the_graph_holds_no_host_read_and_a_device_check():
    args = case([3, 1, 4])
    torch._dynamo.reset()
    _, backend, _ = run(_buffer_form, *args, max_context_len=MCL)
    targets = backend.targets()
    assert "item" not in targets and torch.ops.aten._assert_async.msg in targets, targets


def test_static_escapes_returns_the_static_bound():
    def step(q, k, v, pages, lens, ext):
        qo = F.pad(torch.cumsum(ext, 0), (1, 0))
        m = int(ext.max())
        return EXT(q, k, v, pages, lens, qo, m), m

    args = case([3, 1, 4])
    torch._dynamo.reset()
    (out, m), backend, _ = run(step, *args, max_context_len=MCL, static_escapes=True)
    assert rewritten(backend.report) and m == MCL
    torch._dynamo.reset()
    _, backend, _ = run(step, *args, max_context_len=MCL)
    assert [i.reason_code for i in backend.report.kept] == ["escapes"]


# -- the device checks --------------------------------------------------------------------------------------
def test_a_length_past_the_bound_raises_on_the_device():
    args = case([3, 1, 4])
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="outside"):
        run(_pad_form, *args, max_context_len=MCL, length_bounds={"ext": 3})


def test_a_buffer_whose_first_entry_is_not_zero_raises():
    """The graph does not show buf[0]: eager with buf[0] = 1 gives row 0 one query fewer than its length says,
    and the static bound would change what the consumer computes, so the step stops instead."""
    args = case([3, 1, 4])
    torch._dynamo.reset()
    try:
        META.qo_indptr[0] = 1
        with pytest.raises(RuntimeError, match=r"\[0\] is not 0"):
            run(_buffer_form, *args, max_context_len=MCL)
    finally:
        META.qo_indptr[0] = 0


# -- kept -----------------------------------------------------------------------------------------------------
def kept_code(fn, *extra, **options):
    want = fn(*case([3, 1, 4]), *extra)  # fresh inputs for each run: a step may write them
    torch._dynamo.reset()
    got, backend, _ = run(fn, *case([3, 1, 4]), *extra, max_context_len=MCL, **options)
    torch.testing.assert_close(got, want)
    return [i.reason_code for i in backend.report.kept]


def test_a_reader_through_another_indptr_keeps_the_max():
    def step(q, k, v, pages, lens, ext, other):
        qo = F.pad(torch.cumsum(other, 0), (1, 0))
        return EXT(q, k, v, pages, lens, qo, int(ext.max()))

    assert kept_code(step, torch.tensor([3, 1, 4])) == ["indptr_differs"]


def test_an_indptr_of_longer_rows_keeps_the_max():
    def step(q, k, v, pages, lens, ext):
        qo = F.pad(torch.cumsum(ext + 1, 0), (1, 0))
        return EXT(torch.cat([q, q[:3]]), k, v, pages, lens, qo, int(ext.max()))

    assert kept_code(step) == ["lengths_exceed"]


def test_a_write_into_the_indptr_buffer_before_the_reader_keeps_the_max():
    def step(q, k, v, pages, lens, ext):
        bs = ext.shape[0]
        qo = META.qo_indptr
        qo[1 : bs + 1] = torch.cumsum(ext, dim=0)
        qo[2] += 1
        return EXT(q, k, v, pages, lens, qo[: bs + 1], int(ext.max()))

    assert kept_code(step) == ["written"]


def test_a_write_into_the_lengths_after_the_max_keeps_it():
    def step(q, k, v, pages, lens, ext):
        m = int(ext.max())
        ext.add_(1)  # every row one query longer than the max said
        qo = F.pad(torch.cumsum(ext, 0), (1, 0))
        return EXT(torch.cat([q, q[:3]]), k, v, pages, lens, qo, m)

    assert kept_code(step) == ["written"]


def test_a_buffer_slice_past_the_written_rows_keeps_the_max():
    def step(q, k, v, pages, lens, ext):
        bs = ext.shape[0]
        qo = META.qo_indptr
        qo[1 : bs + 1] = torch.cumsum(ext, dim=0)
        return EXT(q, k, v, pages, lens[:bs].repeat(2)[: bs + 1], qo[: bs + 2], int(ext.max()))

    args = case([3, 1, 4])
    args = (args[0], args[1], args[2], torch.cat([args[3], args[3][:1]]), args[4], args[5])
    want = step(*args)
    torch._dynamo.reset()
    got, backend, _ = run(step, *args, max_context_len=MCL)
    torch.testing.assert_close(got, want)
    assert [i.reason_code for i in backend.report.kept] == ["indptr_differs"]


def test_the_max_used_as_a_size_keeps_it():
    def step(q, k, v, pages, lens, ext):
        qo = F.pad(torch.cumsum(ext, 0), (1, 0))
        m = int(ext.max())
        return EXT(q, k, v, pages, lens, qo, m) + torch.zeros(m * 0 + 1)[0]

    assert kept_code(step)[0] in ("arithmetic", "not_a_consumer")


def test_an_unregistered_reader_keeps_the_max():
    compile_pass.unregister_indptr_bound_consumer("syncfree::ragged_extend_attention")
    try:
        assert kept_code(_pad_form) == ["not_a_consumer"]
    finally:
        from compile_pass.kernels import INDPTR_BOUND

        compile_pass.register_indptr_bound_consumer("syncfree::ragged_extend_attention",
                                                    **INDPTR_BOUND["syncfree::ragged_extend_attention"])


# -- through Inductor ---------------------------------------------------------------------------------------
def test_through_inductor_equal_to_eager_over_changing_lengths():
    torch._dynamo.reset()
    step = compile_pass.compile(_buffer_form, max_context_len=MCL, length_bounds={"ext": 8})
    for n, extend in enumerate(vectors(4)):
        args = case(extend, seed=n)
        want = _buffer_form(*args)
        got = step(*args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    merged = compile_pass.SyncReport.merge(list(compile_pass.reports(step)))
    assert not merged.kept and merged.rewritten, merged


@torch.library.custom_op("syncfree_indptr_test::shaped_by_bound", mutates_args=())
def shaped_by_bound(q: torch.Tensor, qo_indptr: torch.Tensor, max_extend_len: int) -> torch.Tensor:
    return q.new_zeros((max_extend_len,))  # an output shaped by the upper bound: the bound must stay exact


@shaped_by_bound.register_fake
def _(q, qo_indptr, max_extend_len):
    return q.new_empty((max_extend_len,))


def test_an_output_shaped_by_the_bound_keeps_the_max_however_the_bound_is_passed():
    """The fake-tensor check of the consumer's outputs sets the bound by name: passed by position too (it was set
    only when passed by keyword, and a positional bound went unchecked)."""
    compile_pass.register_indptr_bound_consumer("syncfree_indptr_test::shaped_by_bound", indptr="qo_indptr",
                                                upper_bounds=("max_extend_len",))

    def positional(q, k, v, pages, lens, ext):
        qo = F.pad(torch.cumsum(ext, 0), (1, 0))
        return torch.ops.syncfree_indptr_test.shaped_by_bound(q, qo, int(ext.max()))

    def keyword(q, k, v, pages, lens, ext):
        qo = F.pad(torch.cumsum(ext, 0), (1, 0))
        return torch.ops.syncfree_indptr_test.shaped_by_bound(q, qo, max_extend_len=int(ext.max()))

    try:
        assert kept_code(positional) == ["output_changes"]
        assert kept_code(keyword) == ["output_changes"]
    finally:
        compile_pass.unregister_indptr_bound_consumer("syncfree_indptr_test::shaped_by_bound")

"""A slice by the batch size that covers its whole buffer (issue 45, "reach at a full batch").

SGLang's CUDA-graph buffers have max_bs rows and a step reads them through a slice by its batch size: FlashMLA's
replay draft extend `cuda_graph_draft_extend_seq_lens_k[:bs].copy_(seq_lens)` then the kernel reads
`cuda_graph_draft_extend_seq_lens_k[:bs]` (the copy relation, proof.ProofContext.copied_into), Triton's draft
extend `qo_indptr[1:bs + 1] = cumsum(extend_seq_lens)` then the kernel reads `qo_indptr[:bs + 1]` (the indptr rule,
rules/indptr_bound.py). At bs == max_bs the slice is the whole buffer: normalize.is_identity_slice (its stop equals
the buffer's first size for every value of the symbols, `known_equal`) let strip_kept_values pass it as a value-kept
identity, down to the buffer itself, where both proofs expect the slice (`buf[index]`): the max was kept
(lengths_differ, indptr_differs). Dynamo keeps the slice node (`buf[slice(None, 64, None)]`); the proofs now run on
it exactly as on a slice of part of the buffer.

Each program runs at realistic bounds (max_context_len 4096 to 131072, page sizes 16 to 64, batches 1 to 64), at a
batch as large as its buffer and at smaller ones (one graph per batch size, as SGLang's CUDA-graph runner captures,
and the automatic dynamic graph), compiled through the pass (passlib.compile_traced) and compared with eager over
length vectors that sweep [0, bound]; the report says rewritten, the consumer received the static bound and no host
read is left. The kept forms (a read of the whole buffer where the write covers fewer rows, a buffer the copy or
the cumsum did not fill, a write after it, the buffer read without a slice) assert their reason codes, and equal
eager too.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

import compile_pass
import consumers_for_tests  # noqa: F401  (syncfree_test::bounded_sum, a self-guarding consumer)
from passlib import FB, compile_traced, host_reads, length_vectors

SUM = torch.ops.syncfree_test.bounded_sum
SEEN_BOUNDS = consumers_for_tests.SEEN_BOUNDS


# -- an indptr-bound consumer: row b's entries [indptr[b], indptr[b + 1]) of `values`, at most max_len of them ------
SEEN_MAX_LEN: list[int] = []


@torch.library.custom_op("syncfree_fullbatch::row_prefix_sum", mutates_args=())
def row_prefix_sum(values: torch.Tensor, indptr: torch.Tensor, max_len: int) -> torch.Tensor:
    """Row b sums its first min(n_b, max_len) entries, n_b = max(indptr[b + 1] - indptr[b], 0), as SGLang's extend
    kernel launches max_len query blocks per row: any max_len >= max_b n_b gives the same values, a smaller one
    fewer. Raises where a real kernel would read out of bounds."""
    SEEN_MAX_LEN.append(max_len)
    ip = indptr.to(torch.int64)
    n = (ip[1:] - ip[:-1]).clamp(min=0, max=max_len)
    live = n > 0
    if bool(((ip[:-1] < 0) & live).any()) or bool(((ip[:-1] + n > values.numel()) & live).any()):
        raise RuntimeError(f"a row reads past values ({values.numel()} entries): indptr {ip.tolist()[:8]}...")
    prefix = F.pad(values.to(torch.int64).cumsum(0), (1, 0))
    start = ip[:-1].clamp(0, values.numel())
    return torch.where(live, prefix[(start + n).clamp(max=values.numel())] - prefix[start], 0)


@row_prefix_sum.register_fake
def _(values, indptr, max_len):
    return values.new_empty((indptr.shape[0] - 1,), dtype=torch.int64)


ROWSUM = torch.ops.syncfree_fullbatch.row_prefix_sum


@pytest.fixture(scope="module", autouse=True)
def _facts():
    compile_pass.register_indptr_bound_consumer(ROWSUM, indptr="indptr", upper_bounds=("max_len",))
    yield
    compile_pass.unregister_indptr_bound_consumer(ROWSUM)


# -- inputs ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ExtendFB:
    extend_seq_lens: torch.Tensor


@dataclasses.dataclass
class Replay:
    """A CUDA-graph runner's persistent buffer of max_bs rows (FlashMLA's cuda_graph_draft_extend_seq_lens_k)."""

    seq_lens_k: torch.Tensor


@dataclasses.dataclass
class Meta:
    """The backend's persistent qo_indptr of max_bs + 1 entries (SGLang's Triton backend)."""

    qo_indptr: torch.Tensor


_TABLES: dict = {}


def token_table(rows: int, bound: int, ps: int) -> torch.Tensor:
    """int32 [rows, bound]: row r's token t lives in slot t % ps of a page drawn at random (built once)."""
    key = (rows, bound, ps)
    if key not in _TABLES:
        gen = torch.Generator().manual_seed(rows * 7 + ps)
        pages = torch.randperm(rows * bound // ps, generator=gen).view(rows, -1)
        tok = torch.arange(bound)
        _TABLES[key] = (pages[:, tok // ps] * ps + tok % ps).to(torch.int32)
    return _TABLES[key]


def fb_of(lengths, table: torch.Tensor, seed: int) -> FB:
    rpi = torch.randperm(table.shape[0], generator=torch.Generator().manual_seed(seed))[: len(lengths)]
    lens = torch.tensor(lengths, dtype=torch.int64)
    return FB(table, rpi, lens, lens.clone())


def sweep(batch: int, bound: int, seed: int, count: int = 6) -> list[list[int]]:
    """Length vectors of `batch` rows in [0, bound]: the bound with zeros, the bound - 1, all zeros, ones (the
    least non-empty max), then random ones with a row at an edge."""
    first = ([bound] + [0] * (batch - 1), [bound - 1] * batch, [0] * batch, [1] + [0] * (batch - 1))
    return length_vectors(batch, count, seed, top=bound, first=first)


def rewritten(backend) -> bool:
    return bool(backend.reports) and all(r.rewritten and not r.kept and r.syncs_remaining == 0
                                         for r in backend.reports) and not host_reads(backend)


def codes(backend) -> list[str]:
    return [i.reason_code for r in backend.reports for i in r.kept]


def shown(backend) -> str:
    return "\n".join(str(r) for r in backend.reports)


# -- the copy relation: FlashMLA's replay draft extend ----------------------------------------------------------------
def copy_step(ps: int, mirror: bool = True):
    def step(fb, rp):
        bs = fb.seq_lens.shape[0]
        m = (fb.seq_lens_cpu[:bs] if mirror else fb.seq_lens).max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:ps] // ps
        rp.seq_lens_k[:bs].copy_(fb.seq_lens)  # the replay's refresh of the kernel's static buffer
        seq_lens_k = rp.seq_lens_k[:bs]
        return SUM(table, seq_lens_k, ps, m)

    return step


def run_copy(step, max_bs: int, bound: int, ps: int, batches, dynamic=False, checked=True, count=6,
             buffer_dtype=torch.int32, fresh=False):
    """Compile `step` once, run every batch's sweep through it and eagerly (the buffers compared after each step
    too); returns the backend. `fresh`: a zeroed buffer before every step (rows past the batch hold 0)."""
    table = token_table(max_bs + 8, bound, ps)
    call, backend = compile_traced(step, dynamic=dynamic, max_context_len=bound, checked=checked)
    got_buf = torch.zeros(max_bs, dtype=buffer_dtype)
    want_buf = got_buf.clone()
    for i, batch in enumerate(batches):
        for n, lengths in enumerate(sweep(batch, bound, seed=bound + ps + batch + i, count=count)):
            if fresh:
                got_buf.zero_(), want_buf.zero_()
            del SEEN_BOUNDS[:]
            got = call(fb_of(lengths, table, n), Replay(got_buf))
            seen = list(SEEN_BOUNDS)
            want = step(fb_of(lengths, table, n), Replay(want_buf))
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda s: f"batch {batch} {lengths}: {s}")
            assert torch.equal(got_buf, want_buf), lengths
            if rewritten(backend):  # the consumer received the static bound, not the max
                assert seen == [bound], (seen, lengths)
    return backend


# (bound, page size, max_bs): every bound, page sizes 16 to 64, buffers of 1, 8, 17 and 64 rows
COPY_CASES = [(4096, 16, 64), (8192, 32, 8), (32768, 64, 1), (131072, 32, 64), (131072, 64, 17)]


@pytest.mark.parametrize("bound,ps,max_bs", COPY_CASES, ids=[f"{b}-p{p}-bs{m}" for b, p, m in COPY_CASES])
def test_copy_relation_at_a_full_batch_and_below(bound, ps, max_bs):
    """One graph per batch size (SGLang's CUDA-graph capture): the full batch (`buf[:bs]` is the whole buffer) and
    smaller ones are rewritten, and equal eager over [0, bound]."""
    batches = sorted({max_bs, max(max_bs // 2, 1), 1}, reverse=True)
    backend = run_copy(copy_step(ps), max_bs, bound, ps, batches)
    assert len(backend.reports) == len(batches) and rewritten(backend), shown(backend)


@pytest.mark.parametrize("checked", [True, False])
def test_copy_relation_full_batch_checked_or_not_and_without_the_mirror(checked):
    """The max over seq_lens itself (no mirror), checked or not, int64 buffer (no narrowing) and int32."""
    for dtype in (torch.int64, torch.int32):
        torch._dynamo.reset()
        backend = run_copy(copy_step(32, mirror=False), 64, 8192, 32, [64, 5], checked=checked, count=4,
                           buffer_dtype=dtype)
        assert len(backend.reports) == 2 and rewritten(backend), shown(backend)


def test_copy_relation_automatic_dynamic_then_the_full_batch_again():
    """Automatic dynamic: the full batch first (a static graph), then smaller batches (one dynamic graph, `buf[:s0]`),
    then the full batch again through the dynamic graph: every graph rewritten, every step equal to eager."""
    backend = run_copy(copy_step(64), 64, 32768, 64, [64, 9, 2, 64], dynamic=None, count=4)
    assert len(backend.reports) == 2 and rewritten(backend), shown(backend)


# -- the copy relation: what stays kept -------------------------------------------------------------------------------
N = 8  # the buffer's rows in the kept cases


def whole_buffer_read(ps):
    """The copy writes rows [0, bs), the consumer reads the whole buffer: rows past bs hold what it held."""
    def step(fb, rp):
        bs = fb.seq_lens.shape[0]
        m = fb.seq_lens_cpu[:bs].max().item()
        rp.seq_lens_k[:bs].copy_(fb.seq_lens)
        table = fb.req_to_token[:N, :m:ps] // ps
        return SUM(table, rp.seq_lens_k[:N], ps, m)

    return step


def test_a_whole_buffer_read_after_a_copy_of_fewer_rows_keeps_the_max():
    """Below the full batch (static or symbolic bs) the read `buf[:N]` is not the copy's view `buf[:bs]`: kept,
    lengths_differ. At bs == N the two views are one (`buf[:8]` both): rewritten."""
    backend = run_copy(whole_buffer_read(16), N, 4096, 16, [3, 5], dynamic=None, count=4, fresh=True)
    assert len(backend.reports) == 2 and not any(r.rewritten for r in backend.reports), shown(backend)
    assert codes(backend) == ["lengths_differ"] * 2, shown(backend)
    torch._dynamo.reset()
    backend = run_copy(whole_buffer_read(16), N, 4096, 16, [N], count=4, fresh=True)
    assert rewritten(backend), shown(backend)


def copied_other_values(ps):
    def step(fb, rp):
        bs = fb.seq_lens.shape[0]
        m = fb.seq_lens_cpu[:bs].max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:ps] // ps
        rp.seq_lens_k[:bs].copy_(fb.seq_lens // 2)  # not the values the max was taken over
        return SUM(table, rp.seq_lens_k[:bs], ps, m)

    return step


def written_after_the_copy(ps):
    def step(fb, rp):
        bs = fb.seq_lens.shape[0]
        m = fb.seq_lens_cpu[:bs].max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:ps] // ps
        rp.seq_lens_k[:bs].copy_(fb.seq_lens)
        rp.seq_lens_k[:1].add_(0)  # any write after the copy: the proof does not look at values written
        return SUM(table, rp.seq_lens_k[:bs], ps, m)

    return step


def copied_then_read_without_a_slice(ps):
    def step(fb, rp):
        bs = fb.seq_lens.shape[0]
        m = fb.seq_lens_cpu[:bs].max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:ps] // ps
        rp.seq_lens_k[:bs].copy_(fb.seq_lens)
        return SUM(table, rp.seq_lens_k, ps, m)  # the buffer itself: another view than the copy's (not recognised)

    return step


def copied_into_the_buffer_itself(ps):
    def step(fb, rp):
        bs = fb.seq_lens.shape[0]
        m = fb.seq_lens_cpu[:bs].max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:ps] // ps
        rp.seq_lens_k.copy_(fb.seq_lens)  # the copy's view is the buffer, the read `buf[:bs]`: not one index
        return SUM(table, rp.seq_lens_k[:bs], ps, m)

    return step


@pytest.mark.parametrize("make,code", [(copied_other_values, "lengths_differ"), (written_after_the_copy, "written"),
                                       (copied_then_read_without_a_slice, "lengths_differ"),
                                       (copied_into_the_buffer_itself, "lengths_differ")],
                         ids=["other_values", "written_after", "read_without_a_slice", "copied_into_the_buffer"])
def test_copy_relation_kept_at_a_full_batch(make, code):
    backend = run_copy(make(32), 16, 8192, 32, [16], count=4)
    assert codes(backend) == [code], shown(backend)
    assert not any(r.rewritten for r in backend.reports) and host_reads(backend), shown(backend)


# -- the indptr rule: SGLang's Triton draft extend ---------------------------------------------------------------------
def indptr_step(fb, meta, values):
    bs = fb.extend_seq_lens.shape[0]
    meta.qo_indptr[1 : bs + 1] = torch.cumsum(fb.extend_seq_lens, dim=0)
    qo_indptr = meta.qo_indptr[: bs + 1]
    m = int(fb.extend_seq_lens.max())
    return ROWSUM(values, qo_indptr, m)


def values_for(max_bs: int, bound: int) -> torch.Tensor:
    """The ragged input, room for max_bs rows of the bound (one size: no recompile per step)."""
    return torch.randint(-50, 50, (max_bs * bound + 3,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(max_bs + bound))


def run_indptr(step, max_bs: int, bound: int, batches, dynamic=False, checked=True, count=6, fresh=False,
               lengths_dtype=torch.int32):
    """As run_copy, for a step that fills `meta.qo_indptr` (max_bs + 1 entries, int32, entry 0 = 0)."""
    call, backend = compile_traced(step, dynamic=dynamic, max_context_len=bound, checked=checked)
    got_meta = Meta(torch.zeros(max_bs + 1, dtype=torch.int32))
    want_meta = Meta(got_meta.qo_indptr.clone())
    values = values_for(max_bs, bound)
    for i, batch in enumerate(batches):
        for n, lengths in enumerate(sweep(batch, bound, seed=bound + batch + i, count=count)):
            if fresh:
                got_meta.qo_indptr.zero_(), want_meta.qo_indptr.zero_()
            del SEEN_MAX_LEN[:]
            got = call(ExtendFB(torch.tensor(lengths, dtype=lengths_dtype)), got_meta, values)
            seen = list(SEEN_MAX_LEN)
            want = step(ExtendFB(torch.tensor(lengths, dtype=lengths_dtype)), want_meta, values)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda s: f"batch {batch} {lengths}: {s}")
            assert torch.equal(got_meta.qo_indptr, want_meta.qo_indptr), lengths
            if rewritten(backend):
                assert seen == [bound], (seen, lengths)
    return backend


# (bound, max_bs)
INDPTR_CASES = [(4096, 64), (8192, 8), (32768, 1), (131072, 64), (131072, 17)]


@pytest.mark.parametrize("bound,max_bs", INDPTR_CASES, ids=[f"{b}-bs{m}" for b, m in INDPTR_CASES])
def test_indptr_buffer_at_a_full_batch_and_below(bound, max_bs):
    """`qo_indptr[:bs + 1]` the whole buffer (bs == max_bs) and a part of it, one graph per batch size: rewritten
    (entry 0 asserted 0 on the device), equal to eager over [0, bound]."""
    batches = sorted({max_bs, max(max_bs // 2, 1), 1}, reverse=True)
    backend = run_indptr(indptr_step, max_bs, bound, batches)
    assert len(backend.reports) == len(batches) and rewritten(backend), shown(backend)
    assert all("[0] == 0 asserted on the device" in i.reason for r in backend.reports for i in r.rewritten)


@pytest.mark.parametrize("checked", [True, False])
def test_indptr_buffer_full_batch_checked_or_not_int64_lengths(checked):
    backend = run_indptr(indptr_step, 32, 8192, [32, 7], checked=checked, count=4, lengths_dtype=torch.int64)
    assert len(backend.reports) == 2 and rewritten(backend), shown(backend)


def test_indptr_buffer_automatic_dynamic_then_the_full_batch_again():
    backend = run_indptr(indptr_step, 64, 4096, [64, 9, 2, 64], dynamic=None, count=4)
    assert len(backend.reports) == 2 and rewritten(backend), shown(backend)


# -- the indptr rule: what stays kept ---------------------------------------------------------------------------------
def whole_indptr_read(fb, meta, values):
    """The cumsum fills entries [1, bs + 1), the consumer reads all N + 1: entries past bs hold what they held."""
    bs = fb.extend_seq_lens.shape[0]
    meta.qo_indptr[1 : bs + 1] = torch.cumsum(fb.extend_seq_lens, dim=0)
    return ROWSUM(values, meta.qo_indptr[: N + 1], int(fb.extend_seq_lens.max()))


def test_a_whole_indptr_read_after_a_cumsum_of_fewer_rows_keeps_the_max():
    """Below the full batch (static or symbolic bs): kept, indptr_differs (other rows than the lengths written);
    at bs == N the slice `[:N + 1]` is the one the cumsum fills: rewritten."""
    backend = run_indptr(whole_indptr_read, N, 4096, [3, 5], dynamic=None, count=4, fresh=True)
    assert len(backend.reports) == 2 and not any(r.rewritten for r in backend.reports), shown(backend)
    assert codes(backend) == ["indptr_differs"] * 2, shown(backend)
    torch._dynamo.reset()
    backend = run_indptr(whole_indptr_read, N, 4096, [N], count=4, fresh=True)
    assert rewritten(backend), shown(backend)


def not_a_cumsum(fb, meta, values):
    bs = fb.extend_seq_lens.shape[0]
    meta.qo_indptr[1 : bs + 1] = fb.extend_seq_lens  # the lengths, not their running sum
    return ROWSUM(values, meta.qo_indptr[: bs + 1], int(fb.extend_seq_lens.max()))


def not_written(fb, meta, values):
    bs = fb.extend_seq_lens.shape[0]
    return ROWSUM(values, meta.qo_indptr[: bs + 1], int(fb.extend_seq_lens.max()))  # whatever the buffer holds


def written_after_the_cumsum(fb, meta, values):
    bs = fb.extend_seq_lens.shape[0]
    meta.qo_indptr[1 : bs + 1] = torch.cumsum(fb.extend_seq_lens, dim=0)
    qo_indptr = meta.qo_indptr[: bs + 1]
    qo_indptr[1:2].add_(0)  # any write after the cumsum
    return ROWSUM(values, qo_indptr, int(fb.extend_seq_lens.max()))


def read_without_a_slice(fb, meta, values):
    bs = fb.extend_seq_lens.shape[0]
    meta.qo_indptr[1 : bs + 1] = torch.cumsum(fb.extend_seq_lens, dim=0)
    return ROWSUM(values, meta.qo_indptr, int(fb.extend_seq_lens.max()))  # the buffer itself: not recognised


@pytest.mark.parametrize("step,code", [(not_a_cumsum, "indptr_differs"), (not_written, "indptr_differs"),
                                       (written_after_the_cumsum, "written"),
                                       (read_without_a_slice, "indptr_differs")],
                         ids=["not_a_cumsum", "not_written", "written_after", "read_without_a_slice"])
def test_indptr_buffer_kept_at_a_full_batch(step, code):
    backend = run_indptr(step, 16, 8192, [16], count=4, fresh=True)
    assert codes(backend) == [code], shown(backend)
    assert not any(r.rewritten for r in backend.reports) and host_reads(backend), shown(backend)

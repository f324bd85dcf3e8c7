"""The page-table rule (rules/page_table.py): its forms (every gather spelling, offsets, tolist and CPU-mirror
maxes, gpt-fast's `block_table[:B, :n]`, lengths spelled `seq_lens - 1 + 1`, per-site bounds (`length_bounds`),
identity slices) and its refusals, each kept with eager's result. Each compiled step is compared with eager
(pass-only backend: no Inductor)."""

from __future__ import annotations

import pytest
import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from consumers_for_tests import SEEN_BOUNDS
from passlib import make_fb, make_qkv, run

MCL = 64
SUM = torch.ops.syncfree_test.bounded_sum
LENGTH_SETS = ([3, 9, 5], [1, 17, 64], [12, 12, 0])


def item_targets(backend):
    return [t for t in backend.targets() if t == "item"]


def has_page_table_op(backend):
    return any(t in (torch.ops.syncfree.page_table.default, torch.ops.syncfree.page_table)
               for t in backend.targets())


SPELLINGS = {
    "[rpi, :m]": (1, lambda r2t, rpi, m: r2t[rpi, :m]),
    "[rpi, :m:ps] // ps": (4, lambda r2t, rpi, m: r2t[rpi, :m:4] // 4),
    "[rpi, :m][:, ::ps] // ps": (4, lambda r2t, rpi, m: r2t[rpi, :m][:, ::4] // 4),
    "(.. // ps).int()": (4, lambda r2t, rpi, m: (r2t[rpi, :m:4] // 4).int()),
    "torch.div floor .to": (4, lambda r2t, rpi, m: torch.div(r2t[rpi, :m:4], 4, rounding_mode="floor")
                            .to(torch.int32)),
    "[rpi, :m:ps].long() // ps": (4, lambda r2t, rpi, m: r2t[rpi, :m:4].long() // 4),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_each_gather_spelling_is_rewritten(name):
    ps, gather = SPELLINGS[name]

    def step(fb):
        m = fb.seq_lens.max().item()
        table = gather(fb.req_to_token, fb.req_pool_indices, m)
        return torch.ops.syncfree_test.bounded_sum(table, fb.seq_lens, ps, m)

    for lengths in LENGTH_SETS:
        fb = make_fb(lengths)
        SEEN_BOUNDS.clear()
        out, backend, _ = run(step, fb, max_context_len=MCL)
        torch.testing.assert_close(out, step(fb))
        assert SEEN_BOUNDS[0] == MCL  # the upper bound became the static bound
        assert item_targets(backend) == [] and has_page_table_op(backend)
        report = backend.report
        assert [i.kind for i in report.rewritten] == ["item"] and report.kept == []
        assert f"width {-(-MCL // ps)}" in report.rewritten[0].reason
        torch._dynamo.reset()


def test_offset_bound_and_paged_decode_consumer():
    def step(q, k, v, fb):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, : m + 1 : 4] // 4
        out = torch.ops.syncfree.paged_decode(q, k, v, table.to(torch.int32), fb.seq_lens.to(torch.int32))
        tokens = fb.req_to_token[fb.req_pool_indices, :m]
        return out, torch.ops.syncfree_test.bounded_sum(tokens, fb.seq_lens, 1, m + 3)

    fb = make_fb([3, 9, 60])
    q, k, v = make_qkv(3)
    SEEN_BOUNDS.clear()
    (out, sums), backend, _ = run(step, q, k, v, fb, max_context_len=MCL)
    ref, ref_sums = step(q, k, v, fb)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(sums, ref_sums)
    assert SEEN_BOUNDS[0] == MCL + 3
    reason = backend.report.rewritten[0].reason
    # m + 1 would need 17 pages of 4, but the token table holds 64 tokens: never wider than eager's gather
    assert "width 16 (page_size 4)" in reason and f"max_seqlen_k -> {MCL + 3}" in reason


def test_tolist_max_and_cpu_mirror_max_are_rewritten():
    def step(fb):
        m = max(fb.seq_lens.tolist())
        m2 = fb.seq_lens_cpu.max().item()
        a = torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m:4] // 4, fb.seq_lens, 4, m)
        b = torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m2], fb.seq_lens, 1, m2)
        return a + b

    fb = make_fb([3, 9, 40])
    out, backend, _ = run(step, fb, max_context_len=MCL)
    torch.testing.assert_close(out, step(fb))
    assert sorted(i.kind for i in backend.report.rewritten) == ["cpu_mirror", "tolist"]
    assert item_targets(backend) == []


def _unsafe_cases():
    def returns_max(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m), m

    def returns_table(fb):
        m = fb.seq_lens.max().item()
        return fb.req_to_token[fb.req_pool_indices, :m:4] // 4

    def sizes_a_tensor(fb):
        m = fb.seq_lens.max().item()
        return torch.zeros(m) + fb.seq_lens.sum()

    def arithmetic(fb):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m]
        return torch.ops.syncfree_test.bounded_sum(table, fb.seq_lens, 1, m * 2)

    def unregistered(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.unguarded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)

    def other_lengths(fb):
        m = fb.seq_lens.max().item()
        lens = fb.seq_lens // 2
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], lens, 1, m)

    def no_floordiv(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m:4], fb.seq_lens, 4, m)

    def unmasked_sum(fb):
        m = fb.seq_lens.max().item()
        return fb.req_to_token[fb.req_pool_indices, :m].float().sum()

    def bound_in_wrong_slot(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :20], fb.seq_lens, m, 64)

    return {
        "returns_max": (returns_max, "returned to the caller"),
        "returns_table": (returns_table, "returned to the caller"),
        "sizes_a_tensor": (sizes_a_tensor, "neither a page-table bound nor an upper-bound argument"),
        "arithmetic": (arithmetic, "arithmetic that is not a bound"),
        "unregistered": (unregistered, "not a registered self-guarding consumer"),
        "other_lengths": (other_lengths, "does not hold the values the max was taken over"),
        "no_floordiv": (no_floordiv, "divides by 1"),
        "unmasked_sum": (unmasked_sum, "not a self-guarding consumer"),
        "bound_in_wrong_slot": (bound_in_wrong_slot, "not an upper-bound argument"),
    }


@pytest.mark.parametrize("name", list(_unsafe_cases()))
def test_unsafe_uses_are_kept_with_eager_results(name):
    fn, reason = _unsafe_cases()[name]
    fb = make_fb([3, 9, 20])
    out, backend, _ = run(fn, fb, max_context_len=MCL)
    expect = fn(fb)
    if isinstance(expect, tuple):
        torch.testing.assert_close(out[0], expect[0])
        assert out[1] == expect[1]
    else:
        torch.testing.assert_close(out, expect)
    report = backend.report
    assert report.rewritten == [] and len(report.kept) == 1, str(report)
    item = report.kept[0]
    assert reason in item.reason, item.reason
    assert item.location.startswith("test_page_table.py:") and item.host_sync
    assert item_targets(backend) == ["item"]


def test_missing_max_context_len_keeps_and_says_which_option():
    fn, _ = _unsafe_cases()["arithmetic"]

    def step(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)

    fb = make_fb([3, 9])
    out, backend, _ = run(step, fb)
    torch.testing.assert_close(out, step(fb))
    assert "options['max_context_len'] is missing" in backend.report.kept[0].reason


def test_option_page_size_must_match_the_gather():
    def step(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m:4] // 4, fb.seq_lens, 4, m)

    _, backend, _ = run(step, make_fb([3, 9]), max_context_len=MCL, page_size=16)
    assert "differs from options['page_size']=16" in backend.report.kept[0].reason


def test_mirror_upload_feeding_a_rewritten_consumer_reads_the_twin():
    """`seq_lens_cpu.to(device)` as a rewritten consumer's lengths becomes the device twin (meta stands in for
    CUDA here; the GPU test does it on CUDA)."""

    def step(fb):
        m = fb.seq_lens_cpu.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m]
        # The twin must reach the graph (here through a second use) for the pass to read it.
        return torch.ops.syncfree_test.bounded_sum(table, fb.seq_lens_cpu.to("meta"), 1, m), fb.seq_lens + 1

    fb = make_fb([3, 9])
    fb.seq_lens = fb.seq_lens.to("meta")
    fb.req_to_token, fb.req_pool_indices = fb.req_to_token.to("meta"), fb.req_pool_indices.to("meta")
    (out, _), backend, _ = run(step, fb, max_context_len=MCL)
    assert out.device.type == "meta" and out.shape == (2,)
    assert [i.kind for i in backend.report.rewritten] == ["cpu_mirror"]
    assert "device twin fb.seq_lens" in backend.report.rewritten[0].reason
    used = {n.name for g in backend.graphs for n in g.graph.nodes if n.op == "placeholder" and n.users}
    assert "l_fb_seq_lens_cpu" not in used


def test_checked_option_trips_the_device_assertion_past_the_bound():
    def step(fb):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
        return torch.ops.syncfree_test.bounded_sum(table, fb.seq_lens, 4, m)

    compiled = torch.compile(step, backend="syncfree", options={"max_context_len": 16, "checked": True},
                             fullgraph=True)
    with compile_pass._compat.capture_scalar_outputs():
        torch.testing.assert_close(compiled(make_fb([3, 16])), step(make_fb([3, 16])))  # at the bound: fine
        with pytest.raises(RuntimeError, match="static bound"):
            compiled(make_fb([3, 40]))  # past it: the assertion (async on a GPU) fires


def test_upper_bound_of_a_consumer_without_lengths_is_kept():
    compile_pass.register_self_guarding_consumer("syncfree_test::unguarded_sum", upper_bounds=("max_seqlen_k",))
    try:
        def step(fb):
            m = fb.seq_lens.max().item()
            return torch.ops.syncfree_test.unguarded_sum(fb.req_to_token[fb.req_pool_indices, :20], fb.seq_lens, 1, m)

        fb = make_fb([3, 9])
        out, backend, _ = run(step, fb, max_context_len=MCL)
        torch.testing.assert_close(out, step(fb))
        assert "without a lengths argument" in backend.report.kept[0].reason
    finally:
        compile_pass.unregister_self_guarding_consumer("syncfree_test::unguarded_sum")


# -- newer forms: gpt-fast's block table, lengths spelled otherwise, per-site bounds -----------------------


def compare(step, args_of, vectors, **options):
    out, backend, compiled = run(step, *args_of(vectors[0]), max_context_len=MCL, **options)
    torch.testing.assert_close(out, step(*args_of(vectors[0])))
    for lengths in vectors[1:]:
        with compile_pass._compat.capture_scalar_outputs():
            torch.testing.assert_close(compiled(*args_of(lengths)), step(*args_of(lengths)))
    return backend


def test_block_table_rows_by_a_slice_gpt_fast():
    """gpt-fast's block table: rows [0, B) by a slice and a page count, not an index tensor."""
    ps = 4

    def step(q, k, v, block_table, lens):
        m = lens.max().item()
        n = (m + ps - 1) // ps
        bt = block_table[: lens.shape[0], :n]
        return torch.ops.syncfree.paged_decode(q, k, v, bt, lens.to(torch.int32))

    gen = torch.Generator().manual_seed(3)
    block_table = torch.randperm(6 * 16, generator=gen).view(6, 16).to(torch.int32)

    def args(lengths):
        q, k, v = make_qkv(len(lengths), page_size=ps, num_pages=96)
        return q, k, v, block_table, torch.tensor(lengths)

    backend = compare(step, args, [[3, 9, 5], [30, 1, 0], [64, 2, 7], [12, 12, 12]])
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)
    assert "width 16" in backend.report.rewritten[0].reason


def test_lengths_spelled_minus_one_plus_one():
    def step(fb):
        m = fb.seq_lens.max().item()
        lens = fb.seq_lens - 1 + 1
        return SUM(fb.req_to_token[fb.req_pool_indices, :m], lens, 1, m)

    backend = compare(step, lambda v: (make_fb(v),), [[3, 9, 5], [0, 64, 1]])
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)


def test_lengths_below_the_values_the_max_covers_are_fine():
    def step(fb):
        m = fb.seq_lens.max().item()
        return SUM(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens - 2, 1, m)

    backend = compare(step, lambda v: (make_fb(v),), [[3, 9, 5], [0, 64, 1]])
    assert backend.report.rewritten, str(backend.report)


class VerifyBatch:
    def __init__(self, lengths, verify):
        fb = make_fb(lengths)
        self.req_to_token, self.req_pool_indices, self.seq_lens = fb.req_to_token, fb.req_pool_indices, fb.seq_lens
        self.verify_lens = torch.tensor(verify, dtype=torch.int64)


def _verify_step(b):
    lens = b.seq_lens + b.verify_lens  # a max over this reaches max_context_len + the draft tokens
    m = lens.max().item()
    return SUM(b.req_to_token[b.req_pool_indices, :m], lens, 1, m)


def test_a_max_over_a_sum_needs_a_declared_bound_for_the_other_operand():
    backend = compare(_verify_step, lambda v: (VerifyBatch(v, [4, 0, 2]),), [[3, 9, 5], [60, 1, 2]])
    assert [i.reason_code for i in backend.report.kept] == ["unbounded_operand"], str(backend.report)
    assert "length_bounds" in backend.report.kept[0].reason


def test_the_per_site_bound_adds_the_declared_bound():
    backend = compare(_verify_step, lambda v: (VerifyBatch(v, [4, 0, 2]),), [[3, 9, 5], [60, 1, 2], [58, 64, 0]],
                      length_bounds={"verify_lens": 4})
    (item,) = backend.report.rewritten
    assert "bound 68 (max_context_len=64 + length_bounds['verify_lens']=4)" in item.reason, item.reason
    assert "max_seqlen_k -> 68" in item.reason


def test_the_device_check_holds_lengths_to_the_per_site_bound():
    """checked (the default): a sum past max_context_len + the declared bound raises on the device."""
    out, backend, compiled = run(_verify_step, VerifyBatch([3, 9, 5], [4, 0, 2]), max_context_len=MCL,
                                 length_bounds={"verify_lens": 4})
    assert backend.report.rewritten
    with compile_pass._compat.capture_scalar_outputs(), pytest.raises(RuntimeError, match="static bound"):
        compiled(VerifyBatch([66, 1, 2], [4, 0, 2]))


# -- identity slices: `t[:B]` with B the rows of t is t itself (SGLang's seq_lens_cpu[:bs], block_kv_indices[:bs])
PS = 4


def _block_table_args(lengths, rows=None):
    gen = torch.Generator().manual_seed(5)
    block_table = torch.randperm(8 * 16, generator=gen).view(8, 16).to(torch.int32)
    q, k, v = make_qkv(len(lengths), page_size=PS, num_pages=128)
    return q, k, v, block_table, torch.tensor(lengths)


def test_identity_slices_of_the_lengths_and_of_the_table_are_seen_through():
    def step(q, k, v, block_table, lens):
        bs = lens.shape[0]
        m = lens[:bs].max().item()  # the whole tensor: bs is its size
        n = (m + PS - 1) // PS
        bt = block_table[:bs, :n]
        return torch.ops.syncfree.paged_decode(q, k, v, bt[:bs], lens.to(torch.int32))

    backend = compare(step, _block_table_args, [[3, 9, 5], [30, 1, 0], [64, 2, 7]])
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)


def test_a_shorter_prefix_of_the_lengths_keeps_the_max():
    """The max over lens[:2] of 3 rows does not bound row 2, which the consumer reads: kept, never rewritten."""
    def step(q, k, v, block_table, lens):
        m = lens[:2].max().item()
        n = (m + PS - 1) // PS
        bt = block_table[: lens.shape[0], :n]
        return torch.ops.syncfree.paged_decode(q, k, v, bt, lens.to(torch.int32))  # reads row 2 by its length

    backend = compare(step, _block_table_args, [[3, 9, 5], [30, 1, 60], [64, 2, 7]])
    assert [i.reason_code for i in backend.report.kept] == ["lengths_differ"], str(backend.report)


def test_a_shorter_row_slice_of_the_table_is_not_an_identity():
    """`bt[:2]` of a 3-row table is two rows: it is not the table, so the table reaches something that is not a
    consumer and the max is kept."""
    def step(q, k, v, block_table, lens):
        m = lens.max().item()
        n = (m + PS - 1) // PS
        bt = block_table[: lens.shape[0], :n]
        return torch.ops.syncfree.paged_decode(q[:2], k, v, bt[:2], lens[:2].to(torch.int32))

    backend = compare(step, _block_table_args, [[3, 9, 5], [30, 1, 0]])
    assert [i.reason_code for i in backend.report.kept] == ["table_use"], str(backend.report)


def test_identity_slice_recognises_only_whole_prefixes():
    from compile_pass.normalize import is_identity_slice

    seen = {}

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target.__name__ == "getitem":
                seen[str(n.args[1])] = is_identity_slice(n)
        return gm.forward

    def f(x):
        return x[:3] + 1, x[0:3] * 2, x[:2], x[1:3], x[:3:2], x[:]

    torch.compile(f, backend=backend, fullgraph=True)(torch.arange(3))
    assert seen == {"slice(None, 3, None)": True, "slice(0, 3, None)": True, "slice(None, 2, None)": False,
                    "slice(1, 3, None)": False, "slice(None, 3, 2)": False, "slice(None, None, None)": True}, seen


# -- refusals by reason code: each step makes the rule keep the max with that code, and equals eager ----------
def _clamped_below_the_bound(fb):
    m = min(fb.seq_lens.max().item(), 10)  # min(m, 10) is not m for a max up to the bound: it must stay
    return SUM(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)


def _bound_minus_one(fb):
    m = fb.seq_lens.max().item()
    return SUM(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens - 1, 1, m - 1)


def _max_as_the_page_size(fb):
    m = fb.seq_lens.max().item()
    return SUM(fb.req_to_token[fb.req_pool_indices, :20], fb.seq_lens, m, MCL)


def _float_lengths(fb):
    m = fb.seq_lens.max().item()
    return SUM(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens.float(), 1, m)


def _page_count_rounded_down(fb):
    m = fb.seq_lens.max().item()
    return SUM(fb.req_to_token[: fb.seq_lens.shape[0], : m // PS], fb.seq_lens, PS, m)


def _float_token_table(fb):
    m = fb.seq_lens.max().item()
    return SUM(fb.req_to_token.float()[fb.req_pool_indices, :m], fb.seq_lens, 1, m)


def _width_read(fb):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m]
    return SUM(table, fb.seq_lens, 1, m) * table.shape[1]


def _width_checked(fb):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m]
    torch._check(table.shape[1] >= 2)  # a user's check on the width: true for some widths only
    return SUM(table, fb.seq_lens, 1, m)


def _strided_index_used_elsewhere(fb):
    m = fb.seq_lens.max().item()
    tokens = fb.req_to_token[fb.req_pool_indices, :m]
    columns = torch.arange(0, tokens.shape[1], PS)
    return SUM(tokens[:, columns] // PS, fb.seq_lens, PS, m), columns.sum()


def _more_table_rows_than_lengths(fb):
    m = fb.seq_lens.max().item()
    rows = fb.req_pool_indices.repeat(3)  # 3 table rows for 1 length (the consumer broadcasts it)
    return SUM(fb.req_to_token[rows, :m], fb.seq_lens, 1, m)


def _table_only_returned(fb):
    m = fb.seq_lens.max().item()
    return fb.req_to_token[fb.req_pool_indices, :m:PS] // PS


def _list_element_used(fb):
    values = fb.seq_lens.tolist()
    m = max(values)
    return SUM(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m) + values[0]


def _only_checked(fb):
    m = fb.seq_lens.max().item()
    torch._check(m <= MCL)
    return fb.seq_lens * 2


# code -> (step, length vectors (the first compiles), options)
REFUSALS = {
    "compared": (_clamped_below_the_bound, [[3, 9, 5], [7, 1, 10]], {}),
    "subtracted": (_bound_minus_one, [[3, 9, 5], [7, 1, 30]], {}),
    "not_an_upper_bound": (_max_as_the_page_size, [[3, 9, 5], [7, 1, 30]], {}),
    "lengths_not_tensor": (_float_lengths, [[3, 9, 5], [7, 1, 30]], {}),
    "page_count": (_page_count_rounded_down, [[3, 9, 5], [7, 1, 30]], {}),
    "not_a_table": (_float_token_table, [[3, 9, 5], [7, 1, 30]], {}),
    "table_size_read": (_width_read, [[3, 9, 5], [7, 1, 30]], {}),
    "width_check": (_width_checked, [[3, 9, 5], [7, 2, 30]], {}),
    "strided_index": (_strided_index_used_elsewhere, [[3, 9, 5], [7, 1, 30]], {}),
    "mismatch": (_more_table_rows_than_lengths, [[9], [30]], {}),
    "no_consumer": (_table_only_returned, [[3, 9, 5], [7, 1, 30]], {"static_escapes": True}),
    "element_use": (_list_element_used, [[3, 9, 5], [7, 1, 30]], {}),
    "nothing_to_rewrite": (_only_checked, [[3, 9, 5], [7, 1, 30]], {}),
}


@pytest.mark.parametrize("code", sorted(REFUSALS))
def test_a_refused_use_keeps_the_max_with_its_code(code):
    step, vectors, options = REFUSALS[code]
    backend = compare(step, lambda v: (make_fb(v),), vectors, **options)
    assert [i.reason_code for i in backend.report.kept] == [code], str(backend.report)
    assert [i.rule for i in backend.report.kept] == ["page_table"] and not backend.report.rewritten


@pytest.fixture
def unguarded_with_an_upper_bound_only():
    """syncfree_test::unguarded_sum registered with an upper bound, but no page-table or lengths argument."""
    compile_pass.register_self_guarding_consumer("syncfree_test::unguarded_sum", upper_bounds=("max_seqlen_k",))
    yield torch.ops.syncfree_test.unguarded_sum
    compile_pass.unregister_self_guarding_consumer("syncfree_test::unguarded_sum")


def test_an_upper_bound_without_lengths_is_kept_with_no_lengths_fact(unguarded_with_an_upper_bound_only):
    unguarded = unguarded_with_an_upper_bound_only

    def step(fb):
        m = fb.seq_lens.max().item()
        return unguarded(fb.req_to_token[fb.req_pool_indices, :20], fb.seq_lens, 1, m)

    backend = compare(step, lambda v: (make_fb(v),), [[3, 9, 5], [7, 1, 20]])
    assert [i.reason_code for i in backend.report.kept] == ["no_lengths_fact"], str(backend.report)


def test_a_table_into_a_consumer_without_a_table_argument_is_kept_with_table_argument(
        unguarded_with_an_upper_bound_only):
    unguarded = unguarded_with_an_upper_bound_only

    def step(fb):
        m = fb.seq_lens.max().item()
        return unguarded(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, MCL)

    backend = compare(step, lambda v: (make_fb(v),), [[3, 9, 5], [7, 1, 30]])
    assert [i.reason_code for i in backend.report.kept] == ["table_argument"], str(backend.report)


@torch.library.custom_op("syncfree_test::split_plan", mutates_args=())
def split_plan(lens: torch.Tensor, max_seqlen_k: int) -> torch.Tensor:
    """A scheduler-metadata producer (FA3's get_scheduler_metadata in miniature): a plan made for a bound."""
    return (lens.clamp(min=0) + max_seqlen_k).to(torch.int32)


@split_plan.register_fake
def _(lens, max_seqlen_k):
    return lens.new_empty(lens.shape, dtype=torch.int32)


def test_scheduler_metadata_used_elsewhere_is_kept_with_metadata_use():
    compile_pass.register_self_guarding_consumer("syncfree_test::split_plan", lengths="lens",
                                                 upper_bounds=("max_seqlen_k",), feeds_metadata="scheduler_metadata")
    try:
        def step(fb):
            m = fb.seq_lens.max().item()
            plan = torch.ops.syncfree_test.split_plan(fb.seq_lens, m)
            return SUM(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m), plan + 1  # not a consumer

        backend = compare(step, lambda v: (make_fb(v),), [[3, 9, 5], [7, 1, 30]])
        assert [i.reason_code for i in backend.report.kept] == ["metadata_use"], str(backend.report)
    finally:
        compile_pass.unregister_self_guarding_consumer("syncfree_test::split_plan")

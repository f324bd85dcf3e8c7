"""The pass on Dynamo graphs (no Inductor): rewrites, proofs, kept cases, reports."""

import pytest
import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from compile_pass import SyncRemainsError
from consumers_for_tests import SEEN_BOUNDS
from passlib import make_fb, make_qkv, run

MCL = 64
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
    assert item.location.startswith("test_pass.py:") and item.host_sync
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


def test_report_renders_and_serialises():
    fn, _ = _unsafe_cases()["returns_table"]
    _, backend, _ = run(fn, make_fb([3, 9]), max_context_len=MCL)
    text = str(backend.report)
    assert "kept" in text and "test_pass.py:" in text and "1 still a host sync" in text
    data = backend.report.to_dict()
    assert data["syncs_remaining"] == 1 and data["kept"][0]["kind"] == "item"


def test_strict_raises_listing_each_kept_line():
    fn, _ = _unsafe_cases()["returns_table"]
    compiled = compile_pass.compile(fn, max_context_len=MCL, strict=True, fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(make_fb([3, 9]))
    err = info.value
    while not isinstance(err, SyncRemainsError) and err.__cause__ is not None:
        err = err.__cause__
    assert isinstance(err, SyncRemainsError)
    assert "test_pass.py:" in str(err) and err.items[0].kind == "item"


def test_broken_pass_falls_back_to_the_untouched_graph(monkeypatch):
    from compile_pass.sync_pass import SyncPass

    def broken(self, gm):
        raise RuntimeError("deliberately broken")

    monkeypatch.setattr(SyncPass, "__call__", broken)
    fn, _ = _unsafe_cases()["returns_max"]
    fb = make_fb([3, 9])
    compiled = torch.compile(fn, backend="syncfree", options={"max_context_len": MCL}, fullgraph=True)
    with compile_pass._compat.capture_scalar_outputs(), pytest.warns(UserWarning, match="deliberately broken"):
        out = compiled(fb)
    torch.testing.assert_close(out[0], fn(fb)[0])
    report = compile_pass.last_report()
    assert report.fell_back and "deliberately broken" in report.notes[0]
    torch._dynamo.reset()
    strict = torch.compile(fn, backend="syncfree", options={"max_context_len": MCL, "strict": True})
    with compile_pass._compat.capture_scalar_outputs(), pytest.raises(Exception, match="deliberately broken"):
        strict(fb)


def test_without_capture_scalar_outputs_the_report_names_the_graph_break():
    def step(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)

    fb = make_fb([3, 9])
    assert not compile_pass._compat.capture_scalar_outputs_enabled()
    reports = []
    import compile_pass.backend as backend_module

    original = backend_module.set_last_report
    try:
        backend_module.set_last_report = lambda r: (reports.append(r), original(r))
        with pytest.warns(UserWarning):
            out = torch.compile(step, backend="syncfree", options={"max_context_len": MCL})(fb)
    finally:
        backend_module.set_last_report = original
    torch.testing.assert_close(out, step(fb))
    first = reports[0]
    assert any("capture_scalar_outputs" in n for n in first.notes)
    assert first.kept and "graph break at .item()" in first.kept[0].reason


def test_option_validation_names_the_option():
    from compile_pass.options import SyncfreeOptions

    for bad, name in (({"max_context_len": 0}, "max_context_len"), ({"page_size": "4"}, "page_size"),
                      ({"strict": "yes"}, "strict"), ({"cpu_mirrors": {"a": 1}}, "cpu_mirrors")):
        with pytest.raises((TypeError, ValueError), match=name):
            SyncfreeOptions.from_dict(bad)
    with pytest.raises(ValueError, match="max_context_len"):
        compile_pass.compile(lambda x: x, max_context_len=-1)


def test_registry_rejects_unknown_argument_names():
    with pytest.raises(ValueError, match="lengths='seqlens'"):
        compile_pass.register_self_guarding_consumer("syncfree::paged_decode", page_table="page_table",
                                                     lengths="seqlens")
    with pytest.raises(ValueError, match="not a registered torch op"):
        compile_pass.register_self_guarding_consumer("nope::missing", upper_bounds=())
    with pytest.raises(TypeError):
        compile_pass.register_self_guarding_consumer(len)


def test_uuid_changes_with_every_option():
    from compile_pass.options import SyncfreeOptions
    from compile_pass.post_grad_check import SyncFreeCheck

    variants = [{}, {"max_context_len": 64}, {"max_context_len": 128}, {"page_size": 16}, {"strict": True},
                {"checked": False}, {"cudagraphs": True}, {"cpu_mirrors": {"a_cpu": "a"}},
                {"max_autotune": True}]
    uuids = {SyncFreeCheck(SyncfreeOptions.from_dict(v).fingerprint()).uuid() for v in variants}
    assert len(uuids) == len(variants)
    same = SyncFreeCheck(SyncfreeOptions.from_dict({"max_context_len": 64}).fingerprint()).uuid()
    assert same in uuids  # deterministic


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
    assert "device twin l_fb_seq_lens" in backend.report.rewritten[0].reason
    used = {n.name for g in backend.graphs for n in g.graph.nodes if n.op == "placeholder" and n.users}
    assert "l_fb_seq_lens_cpu" not in used


def test_mirror_upload_elsewhere_is_not_renamed():
    """A mirror is trusted only for the rewrite that needs it: other uploads stay (shapes may even differ)."""

    def step(fb, positions_cpu, positions):
        return fb.seq_lens_cpu.to("meta") + fb.seq_lens.sum(), positions_cpu.to("meta") * 2

    fb = make_fb([3, 9])
    fb.seq_lens = fb.seq_lens.to("meta")
    positions_cpu, positions = torch.arange(3), torch.arange(4).to("meta")
    (a, b), backend, _ = run(step, fb, positions_cpu, positions, max_context_len=MCL)
    assert a.shape == (2,) and b.shape == (3,)  # eager's shapes: nothing was swapped for its "twin"
    assert backend.report.rewritten == []
    assert all("is copied to meta" in i.reason for i in backend.report.kept) and len(backend.report.kept) == 2


def test_used_host_copy_is_kept_and_reported():
    def step(x):
        return x.cpu() * 2

    out, backend, _ = run(step, torch.arange(3.0), max_context_len=MCL)
    assert torch.equal(out, torch.arange(3.0) * 2)
    kept = backend.report.kept
    assert [i.kind for i in kept] == ["cpu_copy"] and "host copy is used" in kept[0].reason


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


def test_a_rewrite_that_leaves_a_host_read_is_not_counted_as_removed(monkeypatch):
    """The report counts what is really left: were the proof to miss a second use of a list element, the
    `.item()` that stays is reported, and strict would see it."""
    from compile_pass.rules import host_max

    monkeypatch.setattr(host_max, "check_list_elements", lambda read: None)

    def step(fb):
        values = fb.seq_lens.tolist()
        m = max(values)
        t = fb.req_to_token[fb.req_pool_indices, :m]
        return torch.ops.syncfree_test.bounded_sum(t, fb.seq_lens, 1, m) + values[0]

    fb = make_fb([3, 9, 5])
    out, backend, _ = run(step, fb, max_context_len=MCL)
    torch.testing.assert_close(out, step(fb))
    report = backend.report
    assert report.rewritten and report.syncs_remaining == 1
    assert report.kept[0].reason == "kept: still in the graph after the rewrite"
    assert item_targets(backend) == ["item"]

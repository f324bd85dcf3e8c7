"""The driver (sync_pass.py) and what it hands the backend: the report (rendered, serialised, strict), the
fallback to the untouched graph, graph breaks, mirror uploads and host copies it keeps, reads left after a
rewrite; the rule registry and the consumer registry. Pass-only backend unless a test says otherwise."""

import pytest
import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from compile_pass import SyncRemainsError, rules
from compile_pass.options import OptionError, SyncfreeOptions
from passlib import make_fb, run

MCL = 64


def item_targets(backend):
    return [t for t in backend.targets() if t == "item"]


def returns_max(fb):
    m = fb.seq_lens.max().item()
    return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m), m


def returns_table(fb):
    m = fb.seq_lens.max().item()
    return fb.req_to_token[fb.req_pool_indices, :m:4] // 4


def test_report_renders_and_serialises():
    fn = returns_table
    _, backend, _ = run(fn, make_fb([3, 9]), max_context_len=MCL)
    text = str(backend.report)
    assert "kept" in text and "test_driver.py:" in text and "1 still a host sync" in text
    data = backend.report.to_dict()
    assert data["syncs_remaining"] == 1 and data["kept"][0]["kind"] == "item"


def test_strict_raises_listing_each_kept_line():
    fn = returns_table
    compiled = compile_pass.compile(fn, max_context_len=MCL, strict=True, fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(make_fb([3, 9]))
    err = info.value
    while not isinstance(err, SyncRemainsError) and err.__cause__ is not None:
        err = err.__cause__
    assert isinstance(err, SyncRemainsError)
    assert "test_driver.py:" in str(err) and err.items[0].kind == "item"


def test_broken_pass_falls_back_to_the_untouched_graph(monkeypatch):
    from compile_pass.sync_pass import SyncPass

    def broken(self, gm):
        raise RuntimeError("deliberately broken")

    monkeypatch.setattr(SyncPass, "__call__", broken)
    fn = returns_max
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


def test_registry_rejects_unknown_argument_names():
    with pytest.raises(ValueError, match="lengths='seqlens'"):
        compile_pass.register_self_guarding_consumer("syncfree::paged_decode", page_table="page_table",
                                                     lengths="seqlens")
    with pytest.raises(ValueError, match="not a registered torch op"):
        compile_pass.register_self_guarding_consumer("nope::missing", upper_bounds=())
    with pytest.raises(TypeError):
        compile_pass.register_self_guarding_consumer(len)


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


# -- what the driver keeps, by reason code ------------------------------------------------------------------
def kept_codes(fn, *args, **options):
    out, backend, _ = run(fn, *args, max_context_len=MCL, **options)
    return out, backend, [i.reason_code for i in backend.report.kept]


def test_a_host_read_no_rule_matches_is_kept_with_no_rule():
    def smallest(fb):
        return fb.seq_lens * fb.seq_lens.min().item()  # a min, not a max or a sum: no rule applies

    fb = make_fb([3, 9, 5])
    out, backend, codes = kept_codes(smallest, fb)
    torch.testing.assert_close(out, smallest(fb))
    assert codes == ["no_rule"] and backend.report.kept[0].rule == "", str(backend.report)


def test_a_used_host_copy_and_a_mirror_upload_carry_their_codes():
    def copies(fb):
        return fb.seq_lens_cpu.to("meta") + fb.seq_lens.sum(), fb.req_pool_indices.cpu() + 1

    fb = make_fb([3, 9])
    fb.seq_lens = fb.seq_lens.to("meta")
    (_, host), backend, codes = kept_codes(copies, fb)
    assert torch.equal(host, fb.req_pool_indices + 1)
    assert sorted(zip(codes, (i.kind for i in backend.report.kept))) == \
        [("host_copy_used", "cpu_copy"), ("mirror_upload", "cpu_mirror")], str(backend.report)


def test_two_maxes_whose_plans_share_a_consumer_keep_the_second_with_overlap():
    def two_maxes(fb):
        m1 = fb.seq_lens.max().item()
        m2 = fb.seq_lens.max().item()  # its plan edits the consumer that m1's plan rebuilds the table for
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m1], fb.seq_lens, 1, m2)

    out, backend, codes = kept_codes(two_maxes, make_fb([3, 9, 5]))
    torch.testing.assert_close(out, two_maxes(make_fb([3, 9, 5])))
    assert codes == ["overlap"] and len(backend.report.rewritten) == 1, str(backend.report)


def test_a_rewrite_that_leaves_its_read_in_the_graph_is_kept_with_still_in_graph(monkeypatch):
    """Were a rule's rewrite to leave the host read where it was, the driver's recount keeps it (a rewrite that
    does nothing stands in for that bug)."""
    from compile_pass.rules.page_table import PageTableMax

    monkeypatch.setattr(PageTableMax, "rewrite", lambda self, plan, graph, options: "did nothing")
    def bounded(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)

    out, backend, codes = kept_codes(bounded, make_fb([3, 9, 5]))
    torch.testing.assert_close(out, bounded(make_fb([3, 9, 5])))
    assert codes == ["still_in_graph"] and item_targets(backend) == ["item"], str(backend.report)


# -- the rule registry -------------------------------------------------------------------------------------


def test_rules_are_registered_with_their_options():
    names = [r.name for r in rules.registered_rules()]
    assert names[:3] == ["allocated_table", "indptr_bound", "page_table"]  # the narrower rules first: the first match proves
    assert "length_bounds" in rules.declared_options()
    assert len(rules.rules_fingerprint()) == 64
    opts = SyncfreeOptions.from_dict({"max_context_len": 8, "length_bounds": {"verify_lens": 3}})
    assert opts.rule_option("length_bounds") == (("verify_lens", 3),)
    assert opts.to_dict()["length_bounds"] == {"verify_lens": 3}
    with pytest.raises(OptionError, match="length_bounds"):
        SyncfreeOptions.from_dict({"length_bounds": {"verify_lens": -1}})
    with pytest.raises(OptionError, match="did you mean 'length_bounds'"):
        SyncfreeOptions.from_dict({"length_bound": {"verify_lens": 3}})


def test_every_kept_reason_code_is_declared():
    from compile_pass.proof import REASONS, Unsafe

    # a ValueError, not an assert: `python -O` would strip an assert and let an undeclared code through
    with pytest.raises(ValueError, match="undeclared reason code 'not_a_code'"):
        Unsafe("not_a_code", "x")
    assert {"written", "output_changes", "wide_table", "dynamic_width", "unbounded_operand",
            "metadata_use", "graph_break"} <= set(REASONS)


def test_reason_codes_live_beside_their_owner_and_refuse_duplicates():
    from compile_pass import proof
    from compile_pass.rules import allocated_table, flat_buffer, host_max, page_table

    owners = proof.REASON_OWNERS
    assert owners["wide_table"] == "page_table" and "wide_table" in page_table.REASONS
    assert owners["writer_grid"] == "allocated_table" and "writer_grid" in allocated_table.REASONS
    assert owners["buffer_use"] == "flat_buffer" and "buffer_use" in flat_buffer.REASONS
    assert owners["subtracted"] == "host_max" and "subtracted" in host_max.REASONS
    assert owners["written"] == "pass"
    before = dict(proof.REASONS)
    with pytest.raises(proof.DuplicateReason, match="'written' of my_rule is already declared by pass"):
        proof.declare_reasons("my_rule", {"my_new_code": "fine", "written": "again"})
    assert proof.REASONS == before  # nothing of a refused table is half-registered
    with pytest.raises(ValueError):
        proof.declare_reasons("my_rule", {"not an identifier": "x"})


def test_the_rule_order_is_the_list_in_one_place():
    assert [r.name for r in rules.registered_rules()] == list(rules.RULE_ORDER)

    class Stray:
        name = "not_listed"
        options: dict = {}

    with pytest.raises(RuntimeError, match="not listed in compile_pass.rules.RULE_ORDER"):
        rules.register_rule(Stray)


def test_no_rule_module_imports_another_rule():
    """Rules share through their family's module (host_max) and the vocabulary, never through each other."""
    import ast
    import pathlib

    folder = pathlib.Path(rules.__file__).parent
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                imported.add(node.module.split(".")[0])
            if isinstance(node, ast.ImportFrom) and node.level == 1 and not node.module:
                imported |= {a.name for a in node.names}
        assert not imported & (set(rules.RULE_ORDER) - {path.stem}), f"{path.name} imports {imported}"


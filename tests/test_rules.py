"""The rule engine and the page-table rule's newer forms: gpt-fast's `block_table[:B, :n]`, lengths spelled
`seq_lens - 1 + 1`, per-site bounds (`length_bounds`), and the registry itself. Each compiled step is compared
with eager on several length vectors (pass-only backend: no Inductor)."""

from __future__ import annotations

import pytest
import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from compile_pass import rules
from compile_pass.options import OptionError, SyncfreeOptions
from passlib import make_fb, make_qkv, run

MCL = 64
SUM = torch.ops.syncfree_test.bounded_sum


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

"""SGLang 0.5.23's FlashAttentionBackend (the PyPI wheel, unmodified) compiled through the syncfree backend on CPU.

Each path builds the backend over SGLang's own pools with a fake ModelRunner, builds a ForwardBatch, and compiles
`Engine.step` = `backend.init_forward_metadata(fb)` + two layers of `forward_decode` / `forward_extend` (KV write
included) with `compile_pass.compile(step, max_context_len=256, ...)`. It runs over changing lengths and batch
sizes, and every result must equal the same step run eagerly on an identical batch. The native kernels are CPU
stand-ins (standins/sgl_kernel) that raise where FA3 would read out of bounds.

The ragged target verify runs SGLang's `build_ragged_target_verify_geometry` unmodified: its
`RaggedTargetVerifyGeometry` (a msgspec.Struct) is traced as a plain container (issue 30, no shim), so the max
reaches the pass: `ragged_verify` (no bound declared for verify_lens) is kept (`unbounded_operand`),
`ragged_verify_traceable` (`length_bounds={"verify_lens": 4}`) is rewritten with bound 260; through
`torch.compile(backend="syncfree")` alone Dynamo still breaks at the Struct and the note names the change.

EXPECTED is the end state per path; the entries in NEEDS_RULE are not met yet and xfail with the rule they wait
for (flip them when the rule lands: strict xfail, so a pass turns red).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import harness as H

EAGLE = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=3,
             speculative_num_draft_tokens=4)
SE = {"static_escapes": True}

PATHS = {
    # FA3 normal decode with SGLang's defaults: mirror published (seq_lens_cpu), scheduler precompute on.
    "fa3_decode": H.Path("fa3_decode", "decode"),
    "fa3_decode_static_escapes": H.Path("fa3_decode_static_escapes", "decode", options=SE),
    # EAGLE draft decode, step 1 of 3 (cache_seqlens = seq_lens + 2, max + 2); no scheduler metadata.
    "draft_decode": H.Path("draft_decode", "draft_decode", spec=EAGLE, step_id=1, num_steps=3, options=SE),
    # EAGLE target verify, 4 draft tokens (forward_extend).
    "target_verify": H.Path("target_verify", "target_verify", spec=EAGLE, draft_tokens=4, options=SE),
    # DRAFT_EXTEND_V2, 4 tokens per request, host extend_seq_lens_cpu.
    "draft_extend": H.Path("draft_extend", "draft_extend", spec=EAGLE, draft_tokens=4, options=SE),
    # DFLASH target verify, block of 8.
    "dflash_verify": H.Path("dflash_verify", "dflash_verify",
                            spec=dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=8),
                            draft_tokens=8, options=SE),
    # Ragged target verify (device-only RaggedVerifyLayout): max over cache_seqlens.max().item() on the device.
    # build_ragged_target_verify_geometry's msgspec.Struct is SGLang's own (no shim): traced as a container.
    # Without a bound for verify_lens the max over seq_lens + verify_lens has no static bound: kept.
    "ragged_verify": H.Path("ragged_verify", "ragged_verify", spec=EAGLE, draft_tokens=4, options=SE),
    # The max is over seq_lens + verify_lens: the per-site bound is max_context_len + verify_lens's bound.
    "ragged_verify_traceable": H.Path("ragged_verify_traceable", "ragged_verify", spec=EAGLE, draft_tokens=4,
                                      options={**SE, "length_bounds": {"verify_lens": 4}}),
}

# path -> (status, words one reason must contain)
EXPECTED = {
    "fa3_decode": ("kept", "stored on an object"),  # FA3 keeps forward_metadata on itself
    "fa3_decode_static_escapes": ("rewritten", None),
    "draft_decode": ("rewritten", None),
    "target_verify": ("rewritten", None),
    "draft_extend": ("rewritten", None),
    "dflash_verify": ("rewritten", None),
    "ragged_verify": ("kept", "has no declared bound"),  # reaches the pass (the Struct is traced); no bound declared
    "ragged_verify_traceable": ("rewritten", "bound 260 (max_context_len=256 + length_bounds['verify_lens']=4)"),
}
NEEDS_RULE: dict = {}

_OUTCOMES: dict = {}


def outcome(name):
    if name not in _OUTCOMES:
        torch._dynamo.reset()
        _OUTCOMES[name] = H.run_path(PATHS[name], vectors=2)
    return _OUTCOMES[name]


@pytest.mark.parametrize("name", sorted(PATHS))
def test_equal_to_eager(sglang_fa3, name):
    result = outcome(name)  # run_path asserts equality per length vector
    assert len(result.errors) == 2 and max(result.errors) <= 1e-5


@pytest.mark.parametrize("name", sorted(PATHS))
def test_report(sglang_fa3, name):
    result = outcome(name)
    status, words = EXPECTED[name]
    shown = "\n".join(str(r) for r in result.reports) + f"\ngraph breaks: {result.graph_breaks}"
    if name in NEEDS_RULE and result.status != status:
        pytest.xfail(NEEDS_RULE[name])
    assert result.status == status, shown
    if words:
        assert any(words in r for r in result.reasons + result.graph_breaks) or words in shown, shown
    if status == "rewritten":
        assert all(r.syncs_remaining == 0 and not r.kept for r in result.reports), shown


def test_fa3_default_decode_rewrites_the_scheduler_metadata_with_the_table(sglang_fa3):
    """The joint rewrite: get_scheduler_metadata's max_seqlen_k becomes the static table's key capacity, which
    is the key range FA3's fwd derives from the static page table (page_table.size(1) * page_size)."""
    result = outcome("fa3_decode_static_escapes")
    assert result.status == "rewritten", result.reasons
    text = "\n".join(str(r) for r in result.reports)
    assert "max_seqlen_k -> 256" in text and "width 16 (page_size 16)" in text, text


def test_ragged_verify_without_a_bound_for_verify_lens_keeps_the_max(sglang_fa3):
    """A max over seq_lens + verify_lens reaches max_context_len + draft tokens: without a declared bound for
    verify_lens no static bound is known, and the max is kept (reason code unbounded_operand); SGLang's
    RaggedTargetVerifyGeometry (a msgspec.Struct) no longer breaks the graph before it."""
    result = outcome("ragged_verify")
    assert result.status == "kept" and not result.graph_breaks, result.reasons
    assert any(i.reason_code == "unbounded_operand" for r in result.reports for i in r.kept)


def test_ragged_verify_reaches_the_pass_without_a_shim_and_is_one_graph(sglang_fa3):
    """Issue 30: the unmodified ragged verify with verify_lens bounded: no graph break (the Struct is built in
    the graph and read field by field), one report per compile, the max rewritten at SGLang's own line."""
    result = outcome("ragged_verify_traceable")
    assert result.status == "rewritten" and not result.graph_breaks, result.reasons
    assert all(len(r.rewritten) >= 1 and not r.kept for r in result.reports)


def test_ragged_verify_report_names_the_change_that_makes_the_geometry_traceable(sglang_fa3):
    """Through torch.compile(fn, backend="syncfree") the backend sees only what Dynamo traced: Dynamo cannot build
    RaggedTargetVerifyGeometry (a msgspec.Struct) there, and the report's note at the line where it breaks says
    the one change: compile through compile_pass.compile (or the same fields as a dataclass or NamedTuple)."""
    import compile_pass

    torch._dynamo.reset()
    engine = H.Engine(PATHS["ragged_verify_traceable"])
    seen = len(compile_pass.reports())
    step = torch.compile(engine.step, backend="syncfree", options={"max_context_len": H.MAX_CONTEXT, **SE})
    lengths = H.length_vectors(PATHS["ragged_verify_traceable"], 1)[0]
    fb, hidden = engine.make_batch(lengths)
    want = engine.step(fb, hidden)
    fb, hidden = engine.make_batch(lengths)
    torch.testing.assert_close(step(fb, hidden), want, rtol=1e-5, atol=1e-5)
    notes = [n for r in compile_pass.reports()[seen:] for n in r.notes]
    assert any("user-defined class construction" in n and "compile_pass.compile" in n
               and "dataclass or NamedTuple" in n for n in notes), notes

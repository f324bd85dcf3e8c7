"""Engine-shaped decode steps (tests/engines/): each compiled on CPU and compared with eager on several length
vectors, with the outcome each style must get (rewritten, kept with its reason, or nothing to do). The same
steps run on an H200 with CUDA graphs in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

import compile_pass
from engines import all_cases, case_lengths, sglang_fa3
from engines.common import MAX_CONTEXT
from passlib import Rewriting, host_reads

CASES = all_cases()


def test_at_least_twelve_engine_steps():
    assert len(CASES) >= 12


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_step_on_cpu(name):
    case = CASES[name]
    step, make_args = case.build("cpu", case.page_size)
    backend = Rewriting(max_context_len=MAX_CONTEXT, **case.options)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for n, lengths in enumerate(case_lengths(case, 3, 4, hash(name) % 1000)):
        args = make_args(lengths, seed=n)
        want = step(*args)
        with compile_pass._compat.capture_scalar_outputs():
            got = compiled(*args)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{name} {lengths}")
    assert len(backend.graphs) == 1  # no recompiles across lengths
    report = backend.report
    if case.expect == "rewritten":
        assert report.rewritten and report.syncs_remaining == 0 and not report.kept, str(report)
        assert host_reads(backend.graphs) == []
    elif case.expect == "kept":
        assert report.kept and all(any(w in i.reason for w in case.words) for i in report.kept), str(report)
    else:
        assert not report.rewritten and not report.kept and host_reads(backend.graphs) == [], str(report)


def test_stored_metadata_leaves_at_the_static_width_only_with_the_option():
    case = CASES["sglang_stored_metadata_static"]
    step, make_args = case.build("cpu", case.page_size)
    (fb,) = make_args([5, 40, 17])
    backend_obj = next(c.cell_contents for c in step.__closure__
                       if isinstance(c.cell_contents, sglang_fa3.FlashAttentionStyleBackend))
    step(fb)
    assert backend_obj.forward_metadata.page_table.shape[1] == -(-40 // 16)  # eager: sized by the max
    assert backend_obj.forward_metadata.max_seq_len_k == 40
    compiled = torch.compile(step, backend=Rewriting(max_context_len=MAX_CONTEXT, static_escapes=True),
                             fullgraph=True)
    with compile_pass._compat.capture_scalar_outputs():
        compiled(fb)
    assert backend_obj.forward_metadata.page_table.shape[1] == MAX_CONTEXT // 16  # the static width
    assert backend_obj.forward_metadata.max_seq_len_k == MAX_CONTEXT
    assert backend_obj.strided_indices.tolist() == list(range(0, MAX_CONTEXT, 16))


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["sglang_decode_ps16", "sglang_target_verify", "vllm_host_copy_upper_bound",
                                  "dflash_verify_mirror_argument"])
def test_engine_step_through_inductor(name):
    from compile_pass._compat import run_and_get_code

    case = CASES[name]
    step, make_args = case.build("cpu", case.page_size)
    compiled = compile_pass.compile(step, max_context_len=MAX_CONTEXT, fullgraph=True, strict=True,
                                    **case.options)
    for n, lengths in enumerate(case_lengths(case, 3, 3, 11)):
        args = make_args(lengths, seed=n)
        got, codes = run_and_get_code(compiled, *args)
        torch.testing.assert_close(got, step(*args), rtol=1e-4, atol=1e-4)
        if n == 0:
            assert codes and not any(".item()" in c or "_local_scalar_dense" in c for c in codes)
    report = compile_pass.last_report()
    assert report.post_grad["local_scalar_dense"] == 0 and report.post_grad["unbacked_symbols"] == []

"""With the .so's schemas verbatim (sgl_kernel_exact::*), two things stop the compile before the pass can act.
These tests pin what happens today; when the project handles them, they fail and should be turned around."""

from __future__ import annotations

import pytest
import torch

import harness as H


@pytest.fixture
def exact(sglang_fa3):
    import sgl_kernel.flash_attn as fa

    fa.OPS_NAMESPACE = "sgl_kernel_exact"
    import compile_pass

    entry = compile_pass.register_self_guarding_consumer(
        "sgl_kernel_exact::fwd", page_table="page_table", lengths="seqused_k", upper_bounds=("max_seqlen_k",),
        page_size_of=("k", 1))
    torch._dynamo.reset()
    yield
    fa.OPS_NAMESPACE = "sgl_kernel"
    compile_pass.unregister_self_guarding_consumer(entry.name)
    torch._dynamo.reset()


def test_unbacked_max_cannot_enter_get_scheduler_metadatas_int_argument(exact):
    with pytest.raises(Exception, match=r"get_scheduler_metadata\(\) Expected a value of type .{1,4}int.{1,4} for argument .{1,4}max_seqlen_k"):
        H.run_path(H.Path("exact_decode", "decode", options={"static_escapes": True}), vectors=1)


def test_inductor_refuses_fwds_aliased_return(exact):
    spec = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=3,
                speculative_num_draft_tokens=4)
    with pytest.raises(Exception, match="alias annotations"):
        H.run_path(H.Path("exact_draft_decode", "draft_decode", spec=spec, step_id=1, num_steps=3,
                          options={"static_escapes": True}), vectors=1)

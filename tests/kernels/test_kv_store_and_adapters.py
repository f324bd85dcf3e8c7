import sys
import types

import pytest
import torch

import compile_pass
from kernel_cases import make_case
from reference import attention_f64


def test_store_kv_writes_only_the_given_slots():
    k_pool = torch.zeros(2, 4, 2, 1, 3)
    v_pool = torch.zeros(2, 4, 2, 1, 3)
    loc = torch.tensor([5, 0])
    k = torch.arange(6.0).view(2, 1, 3)
    torch.ops.syncfree.store_kv(k_pool, v_pool, 1, loc, k, -k)
    assert torch.equal(k_pool[1, 2, 1, 0], k[0, 0]) and torch.equal(k_pool[1, 0, 0, 0], k[1, 0])
    assert torch.equal(v_pool[1, 2, 1, 0], -k[0, 0])
    assert k_pool[0].abs().sum() == 0 and k_pool.abs().sum() == k.abs().sum()
    torch.library.opcheck(torch.ops.syncfree.store_kv.default, (k_pool, v_pool, 0, loc, k, k))


@pytest.mark.parametrize("bad,name", [(dict(layer=2), "layer"), (dict(k=torch.zeros(3, 1, 3)), "k"),
                                      (dict(loc=torch.zeros(2)), "loc")])
def test_store_kv_bad_input(bad, name):
    args = dict(k_pool=torch.zeros(2, 4, 2, 1, 3), v_pool=torch.zeros(2, 4, 2, 1, 3), layer=0,
                loc=torch.tensor([1, 2]), k=torch.zeros(2, 1, 3), v=torch.zeros(2, 1, 3))
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=name):
        torch.ops.syncfree.store_kv(**args)


@pytest.fixture
def fake_fa4(monkeypatch):
    """A stand-in FA4 module that records its arguments and computes the reference attention."""
    calls = []

    def flash_attn_varlen_func(q, k, v, **kwargs):
        calls.append(kwargs)
        table = kwargs["page_table"].clamp(max=k.shape[0] - 1)
        return attention_f64(q, k, v, table, kwargs["seqused_k"]).to(q.dtype), None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = flash_attn_varlen_func
    package = types.ModuleType("flash_attn")
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return calls


def test_fa4_adapter_maps_arguments(fake_fa4):
    q, k, v, table, lens = make_case(2, 1, 4, 2, 8, 4, [5, 9])
    out = torch.ops.syncfree.fa4_paged(q, k, v, table.long(), lens.long(), max_seqlen_k=64, causal=True,
                                       softmax_scale=0.5)
    call = fake_fa4[0]
    assert call["max_seqlen_k"] == 64 and call["causal"] is True and call["softmax_scale"] == 0.5
    assert call["seqused_k"].dtype == torch.int32 and call["page_table"].dtype == torch.int32
    assert torch.equal(call["page_table"], table.int())
    torch.testing.assert_close(out, torch.ops.syncfree.paged_decode(q, k, v, table, lens), atol=1e-5, rtol=0)


def test_fa4_adapter_traces_and_the_pass_rewrites_into_it(fake_fa4):
    from passlib import make_fb, make_qkv, run

    def step(q, k, v, fb):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
        return torch.ops.syncfree.fa4_paged(q, k, v, table.to(torch.int32), fb.seq_lens.to(torch.int32),
                                            max_seqlen_k=m, causal=True)

    fb = make_fb([3, 9, 20])
    q, k, v = make_qkv(3)
    out, backend, _ = run(step, q, k, v, fb, max_context_len=64)
    torch.testing.assert_close(out, step(q, k, v, fb), atol=1e-5, rtol=0)
    assert "max_seqlen_k -> 64" in backend.report.rewritten[0].reason
    assert fake_fa4[0]["max_seqlen_k"] == 64 and fake_fa4[0]["page_table"].shape[1] == 16


def test_fa_kvcache_adapter_maps_fa2_block_table(monkeypatch):
    calls = []

    def flash_attn_with_kvcache(q, k, v, **kwargs):
        calls.append(kwargs)
        return attention_f64(q, k, v, kwargs["block_table"], kwargs["cache_seqlens"]).to(q.dtype)

    fa2 = types.ModuleType("flash_attn")
    fa2.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # no FA3
    q, k, v, table, lens = make_case(2, 1, 4, 2, 8, 4, [5, 9], poison=False)
    out = torch.ops.syncfree.fa_with_kvcache(q, k, v, lens, table, max_seqlen_k=16)
    assert set(calls[0]) == {"cache_seqlens", "block_table", "causal", "softmax_scale"}
    torch.testing.assert_close(out, torch.ops.syncfree.paged_decode(q, k, v, table, lens), atol=1e-5, rtol=0)


def test_adapters_say_clearly_when_flash_attn_is_missing(monkeypatch):
    for name in ("flash_attn", "flash_attn.cute", "flash_attn_interface"):
        monkeypatch.setitem(sys.modules, name, None)
    q, k, v, table, lens = make_case(1, 1, 2, 2, 8, 4, [5], poison=False)
    with pytest.raises(RuntimeError, match="needs FA4 .*flash-attn-4"):
        torch.ops.syncfree.fa4_paged(q, k, v, table, lens)
    with pytest.raises(RuntimeError, match="needs FA3 .* or FA2"):
        torch.ops.syncfree.fa_with_kvcache(q, k, v, lens, table)


def test_builtin_consumers_are_registered():
    entries = compile_pass.registered_consumers()
    assert entries["syncfree::fa4_paged.default"].upper_bounds == ("max_seqlen_k",)
    assert entries["syncfree::fa_with_kvcache.default"].lengths == "cache_seqlens"
    if hasattr(torch.ops, "torch_attn") and "torch_attn::_varlen_attn.default" in entries:
        assert entries["torch_attn::_varlen_attn.default"].upper_bounds == ("max_q", "max_k")

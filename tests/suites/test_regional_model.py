"""The reference decoder in regional mode (TinyLlamaConfig.regional: two torch.compiler.nested_compile_region
calls per layer, the KV write between them): the same numbers as the plain model, one traced body per region
stamped out for every layer, and the max rewritten through the real backend (Inductor)."""

import dataclasses

import pytest
import torch

import compile_pass
from compile_pass._compat import capture_scalar_outputs, run_and_get_code
from compile_pass.examples import TinyLlama, TinyLlamaConfig, make_batch
from compile_pass.testing import host_reads_in_code

LENGTHS = ([5, 17, 9], [40, 1, 128])


def _models():
    plain = TinyLlamaConfig(layers=2)
    regional = dataclasses.replace(plain, regional=True)
    return plain, TinyLlama(plain), regional, TinyLlama(regional)  # same seed: the same weights


def _pools(model, seed=0):
    k, v = model.new_kv_pool()
    gen = torch.Generator().manual_seed(seed)
    k.copy_(torch.randn(k.shape, generator=gen))
    v.copy_(torch.randn(v.shape, generator=gen))
    return k, v


def _region_calls(graph: torch.fx.Graph):
    calls = [n for n in graph.nodes
             if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]
    return calls, {n.args[0].target for n in calls}


def test_regional_eager_is_the_plain_model_exactly():
    _, plain, _, regional = _models()
    (k0, v0), (k1, v1) = _pools(plain), _pools(regional)
    for draft in (1, 3):
        for lengths in LENGTHS:
            fb = make_batch(plain.config, lengths, draft=draft)
            assert torch.equal(plain(fb, k0, v0), regional(fb, k1, v1))
            assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_regional_dynamo_traces_one_body_per_region():
    _, _, config, regional = _models()
    k, v = _pools(regional)
    seen = []

    def capture(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    with capture_scalar_outputs():
        torch.compile(lambda fb: regional(fb, k, v), backend=capture, fullgraph=True)(make_batch(config, [5, 9]))
    calls, bodies = _region_calls(seen[-1].graph)
    assert len(calls) == 2 * config.layers and len(bodies) == 2, (len(calls), bodies)
    stores = [n for n in seen[-1].graph.nodes if n.op == "call_function" and "store_kv" in str(n.target)]
    assert len(stores) == config.layers  # the KV write stays outside the regions


@pytest.mark.inductor
def test_regional_compiled_through_the_backend_matches_eager(monkeypatch):
    from compile_pass import pipeline

    passes = []
    run = pipeline.run
    monkeypatch.setattr(pipeline, "run", lambda gm, opts, *steps: passes.append(1) or run(gm, opts, *steps))
    _, plain, config, regional = _models()
    (k0, v0), (k1, v1) = _pools(plain), _pools(regional)

    def step(fb):
        return regional(fb, k1, v1)

    compiled = compile_pass.compile(step, max_context_len=config.max_context_len, fullgraph=True)
    for i, lengths in enumerate(LENGTHS):
        fb = make_batch(config, lengths)
        expect = plain(fb, k0, v0)
        got, codes = run_and_get_code(compiled, fb)
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(k1, k0)
        torch.testing.assert_close(v1, v0)
        if i == 0:
            report = compile_pass.last_report()
            assert len(report.rewritten) == 1 and report.syncs_remaining == 0, str(report)
            assert report.post_grad["local_scalar_dense"] == 0 and report.post_grad["unbacked_symbols"] == []
            assert codes and host_reads_in_code(codes) == 0
    assert len(compile_pass.reports(compiled)) == 1  # one graph for every length
    # no branch decides the max, so it gets no range while Dynamo traces: Dynamo hands the regions the width
    # symbol, the pass rewrites the max on the first trace, and the frame is traced once (no Retrace)
    assert len(passes) == 1


@pytest.mark.inductor
def test_regional_with_a_kv_tensor_per_layer_is_the_stacked_pool_and_one_body_per_region():
    """new_kv_pool(per_layer=True): the same numbers and the same KV writes as the stacked pool; every layer's
    call of a region has inputs of the same metadata (offset 0), so Dynamo installs one body per region, and
    the step compiles through the backend with the max rewritten."""
    _, plain, config, regional = _models()
    k0, v0 = _pools(plain)
    ks, vs = regional.new_kv_pool(per_layer=True)
    for i in range(config.layers):
        ks[i].copy_(k0[i:i + 1])
        vs[i].copy_(v0[i:i + 1])
    seen = []

    def capture(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    fb = make_batch(config, [5, 9])
    with capture_scalar_outputs():
        torch.compile(lambda fb: regional(fb, [k.clone() for k in ks], [v.clone() for v in vs]), backend=capture,
                      fullgraph=True)(fb)
    calls, bodies = _region_calls(seen[-1].graph)
    assert len(calls) == 2 * config.layers and len(bodies) == 2, (len(calls), bodies)
    compiled = compile_pass.compile(lambda fb: regional(fb, ks, vs), max_context_len=config.max_context_len,
                                    fullgraph=True)
    for lengths in LENGTHS:
        fb = make_batch(config, lengths)
        expect = plain(fb, k0, v0)
        torch.testing.assert_close(compiled(fb), expect, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.cat(ks), k0)
        torch.testing.assert_close(torch.cat(vs), v0)
    assert compile_pass.last_report().rewritten
    # The plain (whole-model) layers take a KV tensor per layer too: the same numbers and the same writes.
    pk, pv = plain.new_kv_pool(per_layer=True)
    for i in range(config.layers):
        pk[i].copy_(k0[i:i + 1])
        pv[i].copy_(v0[i:i + 1])
    fb = make_batch(config, LENGTHS[0], seed=3)
    stacked_k, stacked_v = k0.clone(), v0.clone()
    torch.testing.assert_close(plain(fb, pk, pv), plain(fb, stacked_k, stacked_v))
    torch.testing.assert_close(torch.cat(pk), stacked_k)
    torch.testing.assert_close(torch.cat(pv), stacked_v)


def test_regional_mode_needs_one_rank_and_paged_decode():
    with pytest.raises(ValueError, match="regional"):
        TinyLlama(TinyLlamaConfig(regional=True, attention="fa4"))
    with pytest.raises(ValueError, match="regional"):
        TinyLlama(TinyLlamaConfig(regional=True), tp_size=2)
    config = TinyLlamaConfig(regional=True)
    model = TinyLlama(config)
    with pytest.raises(ValueError, match="regional"):
        model(make_batch(config, [5, 9], draft=2), *model.new_kv_pool(), cold=True)

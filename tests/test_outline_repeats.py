"""compile_pass.outline_repeats: a whole graph's repeated stretches run as calls of one shared body.

Each test captures a Dynamo graph, outlines it and compares the outlined graph with the traced one on random
inputs, run eagerly and through AOTAutograd (aot_eager: the functionalization Inductor's input goes through), and
counts the calls and bodies. The backend option is tested through compile_pass.compile.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

import compile_pass
from compile_pass import _compat
from compile_pass import backend as backend_module
from compile_pass.options import OptionError, SyncfreeOptions
from compile_pass.outline_repeats import BODY_PREFIX, MIN_BODY_NODES, outline_repeats
from examples.tiny_llama import TinyLlama, TinyLlamaConfig, make_batch

HIDDEN = 8


def capture(fn, *args, dynamic=False):
    """The Dynamo graph of fn(*args), and the example inputs it was traced with."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    assert len(seen) == 1
    return seen[0]


def calls_and_bodies(gm):
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _compat.invoke_subgraph_op()]
    bodies = {getattr(gm, n.args[0].target) for n in calls}
    return calls, bodies


def aot_eager(gm, example_inputs):
    from torch._dynamo.backends.debugging import aot_eager as backend

    return backend(gm, example_inputs)


def clone_all(args):
    return [a.clone() if isinstance(a, torch.Tensor) else [t.clone() for t in a] for a in args]


def block(x, w, norm):
    """A layer-like stretch of write-free ops (more than MIN_BODY_NODES nodes)."""
    h = x.float().pow(2).mean(-1, keepdim=True)
    h = (x * torch.rsqrt(h + 1e-6)) * norm
    a, b = (h @ w).chunk(2, dim=-1)
    return x + F.silu(a) * b + torch.tanh(x) * 0.5


def stack(x, ws, norms, caches):
    """Layers with an in-place cache write between them (what cuts a decode step into stretches)."""
    for w, norm, cache in zip(ws, norms, caches):
        x = block(x, w, norm)
        cache.copy_(x)  # writes its argument: not outlinable, so each layer is its own stretch
    return x


def stack_inputs(layers=5, seed=0, stacked=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, HIDDEN, generator=gen)
    ws = [torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) for _ in range(layers)]
    norms = [torch.randn(HIDDEN, generator=gen) for _ in range(layers)]
    caches = list(torch.zeros(layers, 3, HIDDEN)) if stacked else [torch.zeros(3, HIDDEN) for _ in range(layers)]
    return x, ws, norms, caches


def run(fn, args):
    args = clone_all(args)
    out = fn(*args)
    return out, args


def assert_same_runs(gm, outlined, example_inputs, trials=5):
    """The outlined graph gives the traced graph's outputs and writes, eagerly and through AOTAutograd, on
    random inputs of the traced shapes."""
    through_aot = aot_eager(outlined, example_inputs)
    for trial in range(trials):
        gen = torch.Generator().manual_seed(100 + trial)
        inputs = [torch.randn(t.shape, generator=gen, dtype=t.dtype) if t.is_floating_point() else t.clone()
                  for t in example_inputs]
        expect, expect_inputs = run(gm, inputs)
        for candidate in (outlined, through_aot):
            got, got_inputs = run(candidate, inputs)
            torch.testing.assert_close(got, expect)
            for a, b in zip(got_inputs, expect_inputs):
                torch.testing.assert_close(a, b)


def test_repeated_layers_run_as_calls_of_one_body():
    x, ws, norms, caches = stack_inputs(layers=5)
    gm, example_inputs = capture(stack, x, ws, norms, caches)
    result = outline_repeats(gm)
    assert result.gm is not gm
    calls, bodies = calls_and_bodies(result.gm)
    assert len(calls) == 5 and len(bodies) == 1, (len(calls), bodies)
    assert {c.args[1] for c in calls} == {BODY_PREFIX + "0"}  # one identifier: AOT traces the body once
    assert (result.bodies, result.calls) == (1, 5)
    assert "5 repeated stretches" in result.note()
    assert not calls_and_bodies(gm)[0], "the graph given is not changed"
    # The cache writes stay in the outer graph, in order, between the calls.
    order = [n.target for n in result.gm.graph.nodes if n.op in ("call_function", "call_method")
             and (n.target is _compat.invoke_subgraph_op() or n.target == "copy_")]
    assert order == [_compat.invoke_subgraph_op(), "copy_"] * 5
    assert_same_runs(gm, result.gm, example_inputs)


def test_views_of_a_stacked_pool_differ_in_offset_and_share_no_body():
    """`pool[i]` of one stacked tensor: the same ops, but operands at different storage offsets (torch keys a
    region's body by them too), so nothing is shared, and nothing is outlined."""

    def layers(x, ws, norms, pool):
        for i, (w, norm) in enumerate(zip(ws, norms)):
            x = block(x, w, norm) + pool[i]  # the view pool[i] is an operand
            pool[i].copy_(x)
        return x

    x, ws, norms, _ = stack_inputs(layers=4)
    gm, _ = capture(layers, x, ws, norms, torch.randn(4, 3, HIDDEN))
    assert outline_repeats(gm).gm is gm
    # The same layers on a tensor per layer (offset 0 each) share one body.
    gm, example_inputs = capture(layers, x, ws, norms, [torch.randn(3, HIDDEN) for _ in range(4)])
    result = outline_repeats(gm)
    calls, bodies = calls_and_bodies(result.gm)
    assert len(calls) == 4 and len(bodies) == 1
    assert_same_runs(gm, result.gm, example_inputs)


def test_a_view_of_an_operand_is_computed_outside_the_body():
    """invoke_subgraph may not return an alias of an operand: the stretch's views of its operands (here x.t() and
    x[0], used after the stretch) run before the call, in the outer graph."""

    def layers(x, ws, norms, caches):
        rows = []
        for w, norm, cache in zip(ws, norms, caches):
            first = x[0]  # a view of the stretch's operand, used after the stretch
            x = block(x, w, norm) + x.t().t()
            rows.append(first)
            cache.copy_(x)
        return x, torch.stack(rows)

    args = stack_inputs(layers=3)
    gm, example_inputs = capture(layers, *args)
    result = outline_repeats(gm)
    calls, bodies = calls_and_bodies(result.gm)
    assert len(calls) == 3 and len(bodies) == 1
    body = next(iter(bodies))
    assert "t" in [n.target for n in body.graph.nodes if n.op == "call_method"], "a view used inside stays in"
    assert not any(n.target is getattr(__import__("operator"), "getitem") and n.args[1] == 0
                   and n.args[0].op == "placeholder" for n in body.graph.nodes if n.op == "call_function")
    assert_same_runs(gm, result.gm, example_inputs)


def test_a_stretch_whose_outputs_alias_each_other_is_not_outlined():
    def layers(x, ws, norms, caches):
        for w, norm, cache in zip(ws, norms, caches):
            h = block(x, w, norm) * 2
            a, b = h.chunk(2, dim=-1)  # two views of one tensor, both used after the stretch
            cache.copy_(torch.cat([b, a], dim=-1))
            x = x + torch.cat([a, b], dim=-1)
        return x

    gm, _ = capture(layers, *stack_inputs(layers=3))
    result = outline_repeats(gm)
    calls, _ = calls_and_bodies(result.gm)
    for call in calls:  # whatever is outlined returns no two views of one tensor
        outs = call.meta["example_value"]
        storages = [_compat.storage_id(t) for t in outs]
        assert len(set(storages)) == len(storages)
    chunks = [n for n in result.gm.graph.nodes if n.op == "call_method" and n.target == "chunk"]
    assert len(chunks) == 6 and not calls, "the aliasing stretches (a chunk in block, one after) stay as traced"


def test_random_ops_and_writes_stay_outside():
    def layers(x, ws, norms, caches):
        for w, norm, cache in zip(ws, norms, caches):
            x = block(x, w, norm)
            x = x + torch.rand_like(x) * 0  # random: its own stretch boundary
            x = block(x, w, norm)
            cache.add_(x)
        return x

    gm, _ = capture(layers, *stack_inputs(layers=3))
    result = outline_repeats(gm)
    calls, bodies = calls_and_bodies(result.gm)
    assert len(bodies) == 2 and len(calls) == 6  # before and after each random op
    for body in bodies:
        names = [str(n.target) for n in body.graph.nodes if n.op not in ("placeholder", "output")]
        assert not any("rand" in name or name.endswith("_") for name in names), names
    assert sum(1 for n in result.gm.graph.nodes if "rand_like" in str(n.target)) == 3


def test_graphs_left_as_traced():
    # symbolic sizes
    gm, _ = capture(stack, *stack_inputs(layers=3), dynamic=True)
    assert any(isinstance(_compat.example_value(n), torch.SymInt) for n in gm.graph.nodes) or any(
        not all(isinstance(s, int) for s in _compat.example_value(n).shape) for n in gm.graph.nodes
        if isinstance(_compat.example_value(n), torch.Tensor))
    assert outline_repeats(gm).gm is gm
    # a stretch that occurs once
    gm, _ = capture(stack, *stack_inputs(layers=1))
    assert outline_repeats(gm).gm is gm

    # bodies under MIN_BODY_NODES
    def small(x, caches):
        for cache in caches:
            x = torch.relu(x) + 1
            cache.copy_(x)
        return x

    gm, _ = capture(small, torch.randn(3), [torch.zeros(3) for _ in range(4)])
    assert sum(1 for n in gm.graph.nodes if n.op == "call_function") < 4 * MIN_BODY_NODES
    assert outline_repeats(gm).gm is gm

    # the user's own regions
    region = torch.compiler.nested_compile_region(block)

    def regional(x, ws, norms, caches):
        for w, norm, cache in zip(ws, norms, caches):
            x = region(x, w, norm)
            cache.copy_(x)
        return x

    gm, _ = capture(regional, *stack_inputs(layers=3))
    assert outline_repeats(gm).gm is gm


# -- generated programs ----------------------------------------------------------------------------------------
UNARY = [torch.tanh, torch.sigmoid, F.silu, torch.relu, lambda t: t * 0.5, lambda t: t.float(),
         lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), lambda t: t.flip(-1), lambda t: -t,
         lambda t: t.cumsum(-1) * 0.1, lambda t: t.softmax(-1)]
BINARY = [torch.add, torch.mul, torch.sub, torch.maximum, lambda a, b: a * 0.5 + b.abs()]


def random_block(rng: random.Random):
    """A random layer: a list of steps over a value stack, applied to (x, the layer's weight w)."""
    steps = []
    for _ in range(rng.randint(6, 14)):
        kind = rng.random()
        if kind < 0.45:
            steps.append(("unary", rng.randrange(len(UNARY))))
        elif kind < 0.8:
            steps.append(("binary", rng.randrange(len(BINARY))))
        elif kind < 0.9:
            steps.append(("matmul",))
        else:
            steps.append(("view",))  # a view of an intermediate or of the input (must not escape as an alias)
    return steps


def apply_block(steps, x, w):
    values = [x]
    for step in steps:
        if step[0] == "unary":
            values.append(UNARY[step[1]](values[-1]))
        elif step[0] == "binary":
            values.append(BINARY[step[1]](values[-1], values[len(values) // 2]))
        elif step[0] == "matmul":
            values.append(values[-1] @ w)
        else:
            values.append(values[-1].unsqueeze(0).squeeze(0))
    return values[-1] + x


@pytest.mark.parametrize("seed", range(24))
def test_generated_layer_stacks_give_the_traced_values(seed):
    rng = random.Random(seed)
    steps = random_block(rng)
    layers = rng.randint(2, 5)
    cut = rng.choice(["copy", "add_", "index_put"])

    def program(x, ws, caches):
        for w, cache in zip(ws, caches):
            x = apply_block(steps, x, w)
            if cut == "copy":
                cache.copy_(x)
            elif cut == "add_":
                cache.add_(x)
                x = x + cache  # reads the written cache: the write must stay between the stretches
            else:
                cache.index_put_((torch.tensor([0, 2]),), x[:2])
        return x

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 4, generator=gen)
    ws = [torch.randn(4, 4, generator=gen) * 0.5 for _ in range(layers)]
    caches = [torch.randn(4, 4, generator=gen) for _ in range(layers)]
    gm, example_inputs = capture(program, x, ws, caches)
    result = outline_repeats(gm)
    calls, bodies = calls_and_bodies(result.gm)
    assert len(calls) == 0 or 2 <= len(calls) <= 2 * layers, len(calls)
    assert len(bodies) <= 2
    for call in calls:
        outs = call.meta["example_value"]
        operand_storages = {_compat.storage_id(_compat.example_value(a)) for a in call.args[2:]}
        assert not {_compat.storage_id(t) for t in outs} & operand_storages
    assert_same_runs(gm, result.gm, example_inputs, trials=3)


# -- the backend option ----------------------------------------------------------------------------------------
def _small_llama(layers=3):
    config = TinyLlamaConfig(layers=layers)
    model = TinyLlama(config)
    ks, vs = model.new_kv_pool(per_layer=True)
    gen = torch.Generator().manual_seed(1)
    for t in ks + vs:
        t.copy_(torch.randn(t.shape, generator=gen))
    return config, model, ks, vs


def _graphs_given_to_inductor(monkeypatch, fail_when_outlined=False):
    """compile_fx replaced by the graph itself (no Inductor): the graphs the backend hands it."""
    given = []

    def fake_compile_fx(gm, example_inputs, patches):
        given.append(gm)
        if fail_when_outlined and calls_and_bodies(gm)[0]:
            raise RuntimeError("no lowering for this graph")
        return gm.forward

    monkeypatch.setattr(_compat, "compile_fx", fake_compile_fx)
    return given


@pytest.mark.parametrize("outline", [False, True])
def test_the_option_outlines_the_whole_models_layers_and_changes_no_decision(monkeypatch, outline):
    given = _graphs_given_to_inductor(monkeypatch)
    config, model, ks, vs = _small_llama(layers=4)
    k0, v0 = [t.clone() for t in ks], [t.clone() for t in vs]
    fn = compile_pass.compile(lambda fb: model(fb, ks, vs), max_context_len=config.max_context_len,
                              fullgraph=True, outline_repeats=outline)
    for seed, lengths in enumerate(([5, 17, 9], [40, 1, 128], [3, 3, 3])):
        fb = make_batch(config, lengths, seed=seed)
        torch.testing.assert_close(fn(fb), model(fb, k0, v0), atol=1e-4, rtol=1e-4)
        for a, b in zip(ks + vs, k0 + v0):
            torch.testing.assert_close(a, b)
    report = compile_pass.last_report()
    assert report.rewritten and not report.kept
    calls, bodies = calls_and_bodies(given[-1])
    if outline:
        # 4 layers: stretches layer i's attention + layer i+1's first half; the first one also holds the
        # page-table op the pass placed before its first consumer, so 2 of the 3 share the body.
        assert len(bodies) == 1 and len(calls) >= 2, (len(calls), bodies)
        assert any(n.startswith("outline_repeats:") for n in report.notes)
    else:
        assert not calls and not any("outline_repeats" in n for n in report.notes)


def test_the_option_changes_no_item_of_the_report(monkeypatch):
    _graphs_given_to_inductor(monkeypatch)
    config, model, ks, vs = _small_llama(layers=3)
    reports = []
    for outline in (False, True):
        torch._dynamo.reset()
        fn = compile_pass.compile(lambda fb: model(fb, ks, vs), max_context_len=config.max_context_len,
                                  fullgraph=True, outline_repeats=outline)
        fn(make_batch(config, [5, 17, 9]))
        d = compile_pass.last_report().to_dict()
        d["notes"] = [n for n in d["notes"] if not n.startswith("outline_repeats:")]
        d.pop("options")
        for key in ("pass_seconds", "backend_seconds"):
            d.pop(key, None)
        reports.append(d)
    assert reports[0] == reports[1]


def test_an_outlined_graph_that_fails_to_compile_is_compiled_as_traced(monkeypatch):
    given = _graphs_given_to_inductor(monkeypatch, fail_when_outlined=True)
    config, model, ks, vs = _small_llama(layers=4)
    k0, v0 = [t.clone() for t in ks], [t.clone() for t in vs]
    fn = compile_pass.compile(lambda fb: model(fb, ks, vs), max_context_len=config.max_context_len,
                              fullgraph=True, outline_repeats=True)
    fb = make_batch(config, [5, 17, 9])
    torch.testing.assert_close(fn(fb), model(fb, k0, v0), atol=1e-4, rtol=1e-4)
    notes = compile_pass.last_report().notes
    assert any("failed to compile" in n and "no lowering for this graph" in n for n in notes), notes
    assert not any(n.startswith("outline_repeats: ") and "compiled once" in n for n in notes)
    assert calls_and_bodies(given[0])[0] and not calls_and_bodies(given[-1])[0]


def test_the_option_must_be_a_bool():
    with pytest.raises(OptionError, match="outline_repeats"):
        compile_pass.compile(lambda x: x, max_context_len=8, outline_repeats="yes")
    with pytest.raises(OptionError, match="outline_repeats"):
        SyncfreeOptions.from_dict({"outline_repeats": 1})
    assert SyncfreeOptions.from_dict({}).outline_repeats is False


@pytest.mark.inductor
def test_whole_model_through_inductor_with_the_option():
    """The whole tiny model through Inductor with outline_repeats: eager's logits and KV writes, rewritten, the
    layers' stretches compiled as one body."""
    config, model, ks, vs = _small_llama(layers=4)
    k0, v0 = [t.clone() for t in ks], [t.clone() for t in vs]
    fn = compile_pass.compile(lambda fb: model(fb, ks, vs), max_context_len=config.max_context_len,
                              fullgraph=True, outline_repeats=True)
    for seed, lengths in enumerate(([5, 17, 9], [40, 1, 128])):
        fb = make_batch(config, lengths, seed=seed)
        torch.testing.assert_close(fn(fb), model(fb, k0, v0), atol=1e-4, rtol=1e-4)
        for a, b in zip(ks + vs, k0 + v0):
            torch.testing.assert_close(a, b)
    report = compile_pass.last_report()
    assert report.rewritten and not report.kept and not report.syncs_remaining
    assert any(n.startswith("outline_repeats:") and "compiled once" in n for n in report.notes), report.notes
    assert dataclasses.is_dataclass(report)

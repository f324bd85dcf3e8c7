"""Regional compilation (`torch.compiler.nested_compile_region` -> invoke_subgraph) seen through: the consumers
and the writes inside a region count as if inlined. Compiled vs eager over several length vectors."""

from __future__ import annotations

import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from passlib import make_fb, run

MCL = 64
SUM = torch.ops.syncfree_test.bounded_sum


@torch.compiler.nested_compile_region
def layer(x, table, lens, pool):
    pool.add_(1)  # the layer writes its own buffer (a KV pool, say): not the table, not the lengths
    return x + SUM(table, lens, 1, 64)


@torch.compiler.nested_compile_region
def layer_writing_lengths(x, table, lens, pool):
    lens.add_(0)  # an in-place write to the lengths before the consumer, inside the region
    return x + SUM(table, lens, 1, 64)


@torch.compiler.nested_compile_region
def layer_casting_lengths(x, table, lens):
    return x + SUM(table, lens.to(torch.int32), 1, 64)


def _stack(region):
    def step(x, fb, pool):
        m = fb.seq_lens.max().item()
        t = fb.req_to_token[fb.req_pool_indices, :m]
        for _ in range(3):
            x = region(x, t, fb.seq_lens, pool)
        return x
    return step


def _compare(step, make_args, vectors):
    out, backend, compiled = run(step, *make_args(vectors[0]), max_context_len=MCL)
    torch.testing.assert_close(out, step(*make_args(vectors[0])))
    for lengths in vectors[1:]:
        a, b = make_args(lengths), make_args(lengths)
        with compile_pass._compat.capture_scalar_outputs():
            torch.testing.assert_close(compiled(*a), step(*b))
        if isinstance(a[-1], torch.Tensor):
            torch.testing.assert_close(a[-1], b[-1])  # the pool each call leaves behind
    return backend


def _args(lengths):
    return torch.zeros(len(lengths)), make_fb(lengths), torch.zeros(4)


def test_a_layer_stack_under_nested_compile_region_is_rewritten():
    backend = _compare(_stack(layer), _args, [[3, 9, 5], [30, 1, 0], [64, 2, 7]])
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)
    graph = backend.graphs[-1].graph
    assert not [n for n in graph.nodes if n.op == "call_method" and n.target == "item"]
    assert sum(n.target is torch.ops.syncfree.page_table.default for n in graph.nodes) == 1
    # The width Dynamo passed into each call is static now and left the region: Inductor wants node operands.
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 3 and all(isinstance(a, torch.fx.Node) for c in calls for a in c.args[2:]), calls
    body = getattr(graph.owning_module, calls[0].args[0].target)
    assert len([n for n in body.graph.nodes if n.op == "placeholder"]) == len(calls[0].args) - 2


def test_casts_inside_the_region_are_seen_through():
    def step(x, fb):
        m = fb.seq_lens.max().item()
        t = fb.req_to_token[fb.req_pool_indices, :m]
        return layer_casting_lengths(layer_casting_lengths(x, t, fb.seq_lens), t, fb.seq_lens)

    backend = _compare(step, lambda v: (torch.zeros(len(v)), make_fb(v)), [[3, 9, 5], [64, 1, 0]])
    assert backend.report.rewritten, str(backend.report)


def test_a_region_that_writes_the_lengths_keeps_the_max():
    backend = _compare(_stack(layer_writing_lengths), _args, [[3, 9, 5], [30, 1, 0]])
    assert not backend.report.rewritten
    assert [i.reason_code for i in backend.report.kept] == ["written"], str(backend.report)


def test_a_region_writes_only_what_its_body_writes():
    from compile_pass.mutations import written_by

    seen = {}

    def capture(gm, example_inputs):
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
        seen["written"] = [[w.name for w in written_by(c)] for c in calls]
        return gm.forward

    with compile_pass._compat.capture_scalar_outputs():
        torch.compile(_stack(layer), backend=capture, fullgraph=True)(*_args([3, 9, 5]))
    assert seen["written"] and all(set(names) == {"l_pool_"} for names in seen["written"]), seen

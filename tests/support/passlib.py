"""Helpers for pass tests: run the compile's pipeline (compile_pass.pipeline: the trace-time steps and the rules)
on Dynamo graphs without Inductor (fast)."""

import dataclasses
import random

import torch
import torch.fx

import decision_log
from compile_pass import _compat, pipeline
from compile_pass import report as report_module
from compile_pass.backend import report_of
from compile_pass.input_guard import guard_disjoint_inputs
from compile_pass.options import SyncfreeOptions


@dataclasses.dataclass
class FB:
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor


def make_fb(lengths, page_size=4, reqs=6, width=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(reqs * width // page_size, generator=gen).view(reqs, -1)
    tok = torch.arange(width)
    r2t = (pages[:, tok // page_size] * page_size + tok % page_size).to(torch.int32)
    rpi = torch.randperm(reqs, generator=gen)[: len(lengths)]
    lens = torch.tensor(lengths, dtype=torch.int64)
    return FB(r2t, rpi, lens, lens.clone())


def make_qkv(batch, page_size=4, num_pages=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_pages = num_pages or 6 * 64 // page_size
    q = torch.randn(batch, 1, 4, 8, generator=gen)
    k = torch.randn(num_pages, page_size, 2, 8, generator=gen)
    v = torch.randn(num_pages, page_size, 2, 8, generator=gen)
    return q, k, v


class Rewriting:
    """The backend's path without Inductor: `pipeline.run` on Dynamo's graph (the ranges given while Dynamo traced
    taken out and settled, the rules, the compile's decisions), then the rewritten graph eagerly, behind the
    backend's input guard. Keeps graphs, reports and pipeline states. With `compile_traced` the ranges are given
    while Dynamo traces, as compile_pass.compile does; with `run` (plain torch.compile) they are not."""

    def __init__(self, **options):
        self.options = SyncfreeOptions.from_dict(options)
        self.graphs = []
        self.reports = []
        self.states = []

    def __call__(self, gm, example_inputs):
        original = _compat.copy_dynamo_graph_module(gm)
        state = pipeline.run(gm, self.options)
        report = report_of(state.result, self.options)
        self.graphs.append(gm)
        self.states.append(state)
        self.reports.append(report)
        if decision_log.path() is not None:  # SYNCFREE_DECISIONS_LOG: the pass-only reports count as the backend's
            with report_module._LOCK:
                report_module._ALL.append(report)
        return guard_disjoint_inputs(gm.forward, original, report.disjoint_inputs)  # as the backend does

    @property
    def report(self):
        return self.reports[-1]

    def targets(self):
        return [n.target for g in self.graphs for n in g.graph.nodes if n.op in ("call_function", "call_method")]


def run(fn, *args, **options):
    backend = Rewriting(**options)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    with _compat.capture_scalar_outputs():
        out = compiled(*args)
    return out, backend, compiled


def length_vectors(batch, count: int, seed: int, top: int = 64, *, low: int = 0, first=(), edge: bool = True,
                   top_first: bool = False) -> list[list[int]]:
    """The one generator of length vectors for the tests: `count` vectors of lengths in [low, top]. `batch` is a
    batch size, or a sequence of them taken in turn (the batch changes between steps). The `first` vectors as
    given (the one Dynamo traces with, corner cases), then random ones (random.Random(seed)), each with one row
    at an edge (low, low + 1, top, or any) unless `edge=False`; `top_first` puts the first row of the first
    vector at the bound. The same arguments give the same vectors."""
    rng = random.Random(seed)
    sizes = [batch] if isinstance(batch, int) else list(batch)
    out = [list(v) for v in first][:count]
    while len(out) < count:
        size = sizes[len(out) % len(sizes)]
        lengths = [rng.randint(low, top) for _ in range(size)]
        if edge:
            lengths[rng.randrange(size)] = rng.choice([low, low + 1, top, rng.randint(low, top)])
        out.append(lengths)
    if top_first and out:
        out[0][0] = top
    return out


def host_reads(graphs) -> list:
    """The host reads left in compiled graphs (`.item()`, a numpy max's item): the one counter of the tests.
    `graphs`: a GraphModule, a list of them, or a Rewriting backend (its graphs)."""
    if isinstance(graphs, Rewriting):
        graphs = graphs.graphs
    if isinstance(graphs, torch.fx.GraphModule):
        graphs = [graphs]
    return [n for g in graphs for n in g.graph.nodes
            if n.op in ("call_method", "call_function")
            and (n.target == "item" or getattr(n.target, "__name__", "") == "wrapped_item")]


TracedPassOnly = Rewriting  # the name the SGLang suites use: one harness


def compile_traced(fn, dynamic=None, **options):
    """(call, backend): `fn` compiled through TracedPassOnly, traced as compile_pass.compile traces it (the range
    of a declared max while Dynamo traces, the retrace where the pass keeps one). `call.policy` is the
    TracingPolicy: its `why` is what the report adds to the graph break of a branch not decided."""
    from compile_pass import tracing

    backend = TracedPassOnly(**options)
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    policy = tracing.TracingPolicy.from_options(backend.options, fn)

    def call(*args):
        with _compat.capture_scalar_outputs(), tracing.bounded_maxima(policy):
            return tracing.call_retracing(compiled, policy, *args)

    call.policy = policy
    return call, backend

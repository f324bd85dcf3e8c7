"""compile_pass.tracing: the range [0, bound] a max of declared lengths gets while Dynamo traces (issue 30).

A grow-on-demand scratch table (SGLang's FlashMLA idiom) branches on the max before it sizes the table; with the
range, a branch that is False for every value in [0, bound] no longer breaks the graph. What the range may be
given to, and that a kept max still checks it, is what these tests pin.
"""

from __future__ import annotations

import pytest
import torch

import compile_pass
from compile_pass import _compat, traceable, traced_ranges, tracing
from compile_pass.backend import run_sync_pass
from compile_pass.options import SyncfreeOptions

PS = 4


class Scratch:
    """A persistent table grown to the running max, as SGLang's `_eager_block_kv_indices`."""

    def __init__(self, width):
        self.buf = torch.full((4, width), -1, dtype=torch.int32)


def grow_step(scratch, seq_lens_cpu, r2t):
    m = seq_lens_cpu.max().item()
    n = (m + PS - 1) // PS
    buf = scratch.buf
    if buf.shape[1] < n:  # grow on demand: never taken once the buffer is as wide as the bound
        buf = torch.full((4, n), -1, dtype=torch.int32)
        scratch.buf = buf
    table = buf[:2, :n]
    table.copy_(r2t[:2, :n])
    return table.sum(), m


class Recorder:
    """A backend: the pass (run_sync_pass, as the syncfree backend runs it) on Dynamo's graph, then the graph."""

    def __init__(self, **options):
        self.options = SyncfreeOptions.from_dict({"max_context_len": 16, **options})
        self.graphs, self.results = [], []

    def __call__(self, gm, example_inputs):
        self.results.append(run_sync_pass(gm, self.options))
        self.graphs.append(gm)
        return gm.forward


def _run(fn, backend, *args, traced=True):
    compiled = torch.compile(fn, backend=backend)
    with _compat.capture_scalar_outputs(), (tracing.bounded_maxima(tracing.TracingPolicy(backend.options)) if traced
                                             else _nullcontext()):
        return compiled(*args)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _breaks(before: int) -> list[str]:
    return [reason for reason, _ in _compat.graph_break_reasons()[before:]]


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_grow_on_demand_branch_false_over_the_range_does_not_break():
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    lens = torch.tensor([9, 3])
    backend = Recorder()
    before = len(_compat.graph_break_reasons())
    got = _run(grow_step, backend, Scratch(16 // PS), lens, r2t)
    assert _breaks(before) == [] and len(backend.graphs) == 1
    assert got[1] == 9 and got[0] == grow_step(Scratch(4), lens, r2t)[0]


def test_without_the_range_the_branch_breaks():
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    backend = Recorder()
    before = len(_compat.graph_break_reasons())
    _run(grow_step, backend, Scratch(16 // PS), torch.tensor([9, 3]), r2t, traced=False)
    assert any("data-dependent" in r for r in _breaks(before))


def test_a_kept_max_checks_its_range_on_the_host():
    """The max escapes (returned): the pass keeps it, and the range it was traced with is asserted again."""
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    backend = Recorder()
    scratch = Scratch(16 // PS)
    compiled = torch.compile(grow_step, backend=backend)
    with _compat.capture_scalar_outputs(), tracing.bounded_maxima(tracing.TracingPolicy(backend.options)):
        compiled(scratch, torch.tensor([9, 3]), r2t)
        assert backend.results[0].kept
        code = backend.graphs[0].code
        assert "exceeds max_context_len=16" in code and "is negative" in code
        with pytest.raises(RuntimeError, match="exceeds max_context_len=16"):
            compiled(scratch, torch.tensor([17, 3]), r2t)


def test_the_pass_does_not_see_the_range_asserts():
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    seen = []

    class Look(Recorder):
        def __call__(self, gm, example_inputs):
            ranged = traced_ranges.ranged_items(gm.graph)
            before = sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten._assert_scalar.default)
            traced_ranges.strip_range_asserts(gm.graph)
            after = sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten._assert_scalar.default)
            seen.append((len(ranged), before, after, ranged[0].meta[traced_ranges.META] if ranged else None))
            return gm.forward

    _run(grow_step, Look(), Scratch(4), torch.tensor([9, 3]), r2t)
    assert seen == [(1, 2, 0, (16, "max_context_len=16"))]


def _max_of(x, r2t):
    m = x.max().item()
    if m > r2t.shape[1]:  # False for every value in [0, 16]: decided by the range where it is given one
        m = r2t.shape[1]
    return r2t[:, :m].sum()


@pytest.mark.parametrize("name, options, bound", [
    ("seq_lens", {}, 16),
    ("verify_lens", {"length_bounds": {"verify_lens": 3}}, 3),
    ("lens_host", {"cpu_mirrors": {"lens_host": "lens"}}, 16),
    ("widths", {}, None),  # not a lengths name: no range
])
def test_which_inputs_get_a_range(name, options, bound):
    backend = Recorder(**options)
    r2t = torch.ones(2, 16, dtype=torch.int32)

    def step(fb):
        return _max_of(getattr(fb, name), r2t)

    class FB:
        pass

    fb = FB()
    setattr(fb, name, torch.tensor([2, 3]))
    _run(step, backend, fb)
    ranged = [n.meta[traced_ranges.META][0] for g in backend.graphs for n in g.graph.nodes if traced_ranges.META in n.meta]
    assert ranged == ([bound] if bound is not None else [])


def test_a_max_of_an_intermediate_gets_no_range():
    backend = Recorder()
    r2t = torch.ones(2, 16, dtype=torch.int32)

    def step(seq_lens):
        return _max_of(seq_lens * 2, r2t)

    _run(step, backend, torch.tensor([2, 3]))
    assert not any(traced_ranges.META in n.meta for g in backend.graphs for n in g.graph.nodes)


def test_compile_gives_the_range_while_dynamo_traces():
    """compile_pass.compile (Inductor) traces the grow-on-demand step as one graph."""
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    before = len(_compat.graph_break_reasons())
    step = compile_pass.compile(grow_step, max_context_len=16)
    scratch = Scratch(4)
    got = step(scratch, torch.tensor([9, 3]), r2t)
    assert _breaks(before) == [] and int(got[1]) == 9
    assert len(compile_pass.reports(step)) == 1


# -- constructs that break the trace before any max: traced where sound, else the report names the one change ---
def test_a_disabled_kernel_wrapper_is_reported_with_the_change_that_keeps_one_graph():
    @torch.compiler.disable
    def kernel(x):
        return x * 2

    def step(x):
        return kernel(x + 1) - 1

    compiled = compile_pass.compile(step, max_context_len=16)
    compiled(torch.ones(3))
    notes = [n for r in compile_pass.reports(compiled) for n in r.notes]
    assert any("torch.library.custom_op" in n and "register_disabled_launcher" in n and "test_tracing.py:" in n
               for n in notes), notes


try:  # SGLang's KVIndexTable and RaggedTargetVerifyGeometry are msgspec.Structs
    import msgspec
except ImportError:  # pragma: no cover - msgspec comes with the SGLang set (make sglang-deps)
    msgspec = None
needs_msgspec = pytest.mark.skipif(msgspec is None, reason="msgspec is not installed")
_Struct = msgspec.Struct if msgspec is not None else object
_field = msgspec.field if msgspec is not None else (lambda **kw: None)
_FROZEN = dict(frozen=True, kw_only=True, tag=True, array_like=True) if msgspec is not None else {}


class StructTable(_Struct):
    ids: torch.Tensor
    stride: int
    extra: int = 7

    def scaled(self, k):
        return self.ids * (self.stride * k)

    @property
    def width(self):
        return self.ids.shape[0] * self.stride


class FrozenTable(_Struct, **_FROZEN):
    ids: torch.Tensor
    stride: int


class PostInitTable(_Struct):
    ids: torch.Tensor
    stride: int

    def __post_init__(self):
        self.stride = self.stride * 2


class FactoryTable(_Struct):
    ids: torch.Tensor
    seen: list = _field(default_factory=list)


class Holder:
    pass


def _one_graph(fn, *args):
    before = len(_compat.graph_break_reasons())
    compiled = compile_pass.compile(fn, max_context_len=16)
    got = compiled(*args)
    return got, _breaks(before), compiled


@needs_msgspec
def test_a_msgspec_struct_is_traced_as_a_plain_container_equal_to_eager():
    """Positional and keyword fields, a default, a method and a property are traced in one graph; the Struct that
    leaves the graph (returned, and stored twice on an object) is one real instance of the class with the same
    fields, as eager makes it."""
    holder = Holder()

    def step(x):
        t = StructTable(x + 1, stride=4)
        holder.a, holder.b = t, t
        return t.ids * t.stride + t.scaled(2) + t.width + t.extra, t

    (got, table), breaks, compiled = _one_graph(step, torch.ones(3))
    assert type(table) is StructTable and holder.a is table and holder.b is table
    want, eager_table = step(torch.ones(3))
    assert breaks == [] and len(compile_pass.reports(compiled)) == 1
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(table.ids, eager_table.ids)
    assert (table.stride, table.extra) == (eager_table.stride, eager_table.extra)


@needs_msgspec
def test_a_frozen_kw_only_tagged_array_like_struct_is_traced_and_setting_a_field_raises_as_in_eager():
    """frozen / kw_only / tag / array_like change encoding and setattr, not construction: traced. Setting a field
    of the frozen Struct breaks the graph there and raises what eager raises."""
    def read(x):
        t = FrozenTable(ids=x * 2, stride=3)
        return t.ids + t.stride, isinstance(t, FrozenTable), type(t) is FrozenTable

    got, breaks, _ = _one_graph(read, torch.ones(2))
    assert breaks == [] and got[1:] == (True, True)
    torch.testing.assert_close(got[0], read(torch.ones(2))[0])

    def write(x):
        t = FrozenTable(ids=x, stride=3)
        t.stride = 4
        return t.ids

    with pytest.raises(AttributeError):
        write(torch.ones(2))
    with pytest.raises(AttributeError):
        compile_pass.compile(write, max_context_len=16)(torch.ones(2))


class Counter(_Struct):
    ids: torch.Tensor
    n: int

    def bump(self):
        self.n += 1


@needs_msgspec
def test_setting_a_field_of_a_mutable_struct_breaks_there_and_equals_eager():
    """A field set (directly, through an alias, or in a method) is not modelled: the graph breaks there, Python
    sets it on the object built from the fields, and what follows reads the new value, as in eager."""
    def step(x):
        t = Counter(x, 1)
        alias = t
        alias.n = 5
        t.bump()
        return t.ids * t.n, t, alias

    got, breaks, _ = _one_graph(step, torch.ones(2))
    torch.testing.assert_close(got[0], torch.full((2,), 6.0))
    assert got[1] is got[2] and got[1].n == 6 and breaks


@needs_msgspec
def test_a_struct_used_across_a_graph_break_is_the_same_object():
    def step(x):
        t = StructTable(x, 2)
        torch._dynamo.graph_break()
        return t.ids * t.stride, t

    (got, table), breaks, _ = _one_graph(step, torch.ones(2))
    assert type(table) is StructTable and table.stride == 2 and table.extra == 7
    torch.testing.assert_close(got, torch.full((2,), 2.0))
    assert not any("msgspec" in b or "user-defined class" in b for b in breaks), breaks


@needs_msgspec
@pytest.mark.parametrize("cls, why", [(PostInitTable, "__post_init__"), (FactoryTable, "default_factory")])
def test_a_msgspec_struct_is_reported_with_the_change_that_makes_it_traceable(cls, why):
    """__post_init__ (the class's own code) or a default_factory for a field left out: not modelled. Dynamo
    breaks there as without the backend, the result equals eager, and the note at the user's line says why
    and what makes it traceable."""
    def step(x):
        t = cls(x + 1) if cls is FactoryTable else cls(x + 1, 3)
        return t.ids * 2

    got, breaks, compiled = _one_graph(step, torch.ones(3))
    torch.testing.assert_close(got, step(torch.ones(3)))
    assert any(traceable.STRUCT_REFUSED in b for b in breaks), breaks
    notes = [n for r in compile_pass.reports(compiled) for n in r.notes]
    assert any(n.startswith("test_tracing.py:") and why in n and "dataclass or NamedTuple" in n for n in notes), notes


@needs_msgspec
def test_struct_refusal_reads_the_class():
    assert traceable.struct_refusal(StructTable) is None and traceable.struct_refusal(FrozenTable) is None
    assert "__post_init__" in traceable.struct_refusal(PostInitTable)
    with pytest.raises(LookupError):
        traceable.struct_refusal(Holder)


@needs_msgspec
def test_a_struct_is_not_modelled_outside_compile_pass_compile():
    """torch.compile(backend="syncfree") hands the backend a graph Dynamo traced without it: the Struct breaks."""
    def step(x):
        return StructTable(x, 2).ids * 2

    before = len(_compat.graph_break_reasons())
    torch.compile(step, backend="syncfree", options={"max_context_len": 16})(torch.ones(2))
    assert any("user-defined class construction" in b for b in _breaks(before))


# -- torch.compiler.disable()d launchers, registered with the op they are ------------------------------------
def _launch(x, out, scale, flag=None, page_size=1):
    """A kernel launcher: writes out, returns nothing."""
    out.copy_(x * scale * page_size)


class Kernels:
    def __init__(self):
        self.launch = torch.compiler.disable(_launch)


KERNELS = Kernels()
LAUNCH_SCHEMA = "(Tensor x, Tensor(a!) out, float scale, SymInt page_size) -> ()"


_OPS: dict = {}  # an op is defined once per process


def _register(launcher_fn, name):
    if name in _OPS:
        return compile_pass.register_disabled_launcher(launcher_fn, _OPS[name])
    _OPS[name] = compile_pass.register_disabled_launcher(launcher_fn, name=name, schema=LAUNCH_SCHEMA)
    return _OPS[name]


@pytest.fixture
def launcher():
    op = _register(KERNELS.launch, "syncfree_test::launch")  # the wrapper: the launcher it disables is registered
    yield op
    compile_pass.unregister_disabled_launcher(_launch)


def _launch_step(x):
    out = torch.empty_like(x)
    KERNELS.launch(x + 1, out, 2.0)
    return out * 3


def _flag_step(x):
    out = torch.empty_like(x)
    KERNELS.launch(x + 1, out, 2.0, flag=True)
    return out * 3


def test_a_registered_launcher_is_traced_as_its_op(launcher):
    got, breaks, compiled = _one_graph(_launch_step, torch.ones(3))
    torch.testing.assert_close(got, _launch_step(torch.ones(3)))
    assert breaks == [] and len(compile_pass.reports(compiled)) == 1
    assert compile_pass.registered_launchers() == {_launch: launcher}


def test_a_launcher_call_with_an_argument_the_op_does_not_take_breaks_and_the_report_names_it(launcher):
    got, breaks, compiled = _one_graph(_flag_step, torch.ones(3))
    torch.testing.assert_close(got, _flag_step(torch.ones(3)))
    assert any(traceable.LAUNCHER_REFUSED + " (flag=)" in b for b in breaks), breaks
    notes = [n for r in compile_pass.reports(compiled) for n in r.notes]
    assert any(n.startswith("test_tracing.py:") and "add that argument to the op's schema" in n for n in notes)


def _scale_tensor_step(x):
    out = torch.empty_like(x)
    KERNELS.launch(x + 1, out, torch.tensor(2.0))
    return out * 3


def test_a_launcher_call_with_an_argument_of_another_kind_breaks_and_the_report_names_it(launcher):
    """scale is a float in the schema: a tensor there is not traced as the op (the break stands, eager runs)."""
    got, breaks, _ = _one_graph(_scale_tensor_step, torch.ones(3))
    torch.testing.assert_close(got, _scale_tensor_step(torch.ones(3)))
    assert any(traceable.LAUNCHER_REFUSED + " (scale=)" in b for b in breaks), breaks


def test_an_unregistered_launcher_still_breaks(launcher):
    compile_pass.unregister_disabled_launcher(KERNELS.launch)  # the wrapper names the same launcher
    _, breaks, _ = _one_graph(_launch_step, torch.ones(3))
    assert any("torch.compiler.disable" in b for b in breaks), breaks


def test_the_op_raises_when_the_launcher_returns_a_value(launcher):
    def returns(x, out, scale, flag=None, page_size=1):
        return x

    op = _register(returns, "syncfree_test::launch_returning")
    compile_pass.unregister_disabled_launcher(returns)
    with pytest.raises(RuntimeError, match="returned a value"):
        op(torch.ones(2), torch.ones(2), 1.0, 1)


@pytest.mark.parametrize("kwargs, words", [
    ({}, "give op="),
    ({"name": "noname", "schema": LAUNCH_SCHEMA}, "namespace::op"),
    ({"name": "syncfree_test::launch_bad", "schema": "(Tensor x, Tensor(a!) out) -> Tensor"}, "return nothing"),
    ({"op": torch.ops.aten.add}, "must have one overload"),
    ({"op": torch.ops.syncfree.page_table}, "no parameter of that name"),
])
def test_register_disabled_launcher_refuses_bad_declarations(kwargs, words):
    with pytest.raises(TypeError, match=words):
        compile_pass.register_disabled_launcher(_launch, **kwargs)
    assert _launch not in compile_pass.registered_launchers()


# -- a branch that differs inside the range: traced at the bound, asserted on the device, or traced again ------
def _branch_step(fb):
    m = fb.seq_lens.max().item()
    n = m + 4 if m < 8 else m  # False at the bound (64): the branch differs inside [0, 64]
    table = fb.req_to_token[fb.req_pool_indices, :n]
    return torch.ops.syncfree_test.bounded_sum(table, fb.seq_lens, 1, n)


def test_a_branch_that_differs_is_traced_at_the_bound_and_asserted_on_the_device():
    import consumers_for_tests  # noqa: F401  (syncfree_test::bounded_sum, a self-guarding consumer)
    from passlib import make_fb

    before = len(_compat.graph_break_reasons())
    step = compile_pass.compile(_branch_step, max_context_len=64, dynamic=False)
    for lengths in ([3, 9, 60], [8, 1, 2]):
        fb = make_fb(lengths)
        torch.testing.assert_close(step(fb), _branch_step(fb))
    assert _breaks(before) == []
    reports = compile_pass.reports(step)
    assert reports and all(r.rewritten and not r.kept for r in reports), [str(r) for r in reports]
    with pytest.raises(RuntimeError, match="traced with the outcome it has at the bound"):
        step(make_fb([3, 5, 7]))  # max 7 < 8: eager takes the other branch; the step raises instead of guessing


def test_a_kept_max_is_traced_again_without_the_branch_at_the_bound():
    import consumers_for_tests  # noqa: F401
    from passlib import make_fb

    def step(fb):
        return _branch_step(fb), fb.seq_lens.max().item() + 0  # the max also escapes: kept

    def escaping(fb):
        m = fb.seq_lens.max().item()
        n = m + 4 if m < 8 else m
        return fb.req_to_token[fb.req_pool_indices, :n].sum(), m  # no consumer: the pass keeps the max

    before = len(_compat.graph_break_reasons())
    compiled = compile_pass.compile(escaping, max_context_len=64)
    for lengths in ([3, 9, 60], [3, 5, 7]):
        fb = make_fb(lengths)
        got, want = compiled(fb), escaping(fb)
        assert int(got[0]) == int(want[0]) and int(got[1]) == want[1]
    assert any("data-dependent" in r for r in _breaks(before))  # traced again: the branch breaks, as eager

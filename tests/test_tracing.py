"""compile_pass.tracing: the range [0, bound] a max of declared lengths gets while Dynamo traces (issue 30).

A grow-on-demand scratch table (SGLang's FlashMLA idiom) branches on the max before it sizes the table; with the
range, a branch that is False for every value in [0, bound] no longer breaks the graph. What the range may be
given to, and that a kept max still checks it, is what these tests pin.
"""

from __future__ import annotations

import math

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


# -- a Struct whose class customises attribute access, truth, comparison, ...: refused (issue 45, item 2) -----------
# Each class below makes eager run its own code where the plain-container model would read a field or answer as
# `object` does. Compiled (compile_pass.compile) must equal eager: the class is refused at construction
# (STRUCT_REFUSED, the report names why) or the operation breaks the graph where it happens.
class GetAttributeTable(_Struct):
    ids: torch.Tensor
    stride: int

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        return value * 2 if name == "stride" else value


class GetAttrTable(_Struct):
    ids: torch.Tensor
    stride: int

    def __getattr__(self, name):
        return 5


class SetAttrTable(_Struct):
    ids: torch.Tensor
    stride: int

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value * 2 if name == "stride" else value)


class ShadowedFieldTable(StructTable):
    @property
    def stride(self):  # shadows the parent's field: eager reads this
        return 99


class RaisingPropertyTable(_Struct):
    ids: torch.Tensor
    stride: int

    @property
    def missing(self):
        raise AttributeError("missing")


class _Getter(property):
    def __get__(self, obj, owner=None):
        return self if obj is None else 42


class CustomPropertyTable(_Struct):
    ids: torch.Tensor
    stride: int

    @_Getter
    def width(self):
        return 1


class FalsyTable(_Struct):
    ids: torch.Tensor
    stride: int

    def __bool__(self):
        return False


class EmptyTable(_Struct):
    ids: torch.Tensor
    stride: int

    def __len__(self):
        return 0


class StaticTable(_Struct):
    ids: torch.Tensor
    stride: int

    @staticmethod
    def plus(x):
        return x + 1

    @classmethod
    def twice(cls, x):
        return x * 2


class AddingTable(_Struct):
    ids: torch.Tensor
    stride: int

    def __add__(self, other):
        return self.stride + other


STRUCT_BODIES = {
    "getattribute": (GetAttributeTable, lambda t: t.ids * t.stride),
    "getattr": (GetAttrTable, lambda t: t.ids * (2 if hasattr(t, "anything") else 3) + t.anything),
    "setattr": (SetAttrTable, lambda t: t.ids * t.stride),
    "shadowed_field": (ShadowedFieldTable, lambda t: t.ids * t.stride),
    "raising_property": (RaisingPropertyTable, lambda t: t.ids * (2 if hasattr(t, "missing") else 3)),
    "custom_property": (CustomPropertyTable, lambda t: t.ids * t.width),
    "bool": (FalsyTable, lambda t: t.ids * (2 if t else 3)),
    "len": (EmptyTable, lambda t: t.ids * (2 if t else 3)),
    "static_and_class_methods": (StaticTable, lambda t: t.plus(t.ids) + t.twice(t.ids)),
    "msgspec_eq": (StructTable, lambda t: t.ids * (2 if t == StructTable(t.ids, 3) else 3)),
    "msgspec_ne": (StructTable, lambda t: t.ids * (2 if t != StructTable(t.ids, 4) else 3)),
    "unhashable": (StructTable, lambda t: t.ids * len({t: 1})),
    "hashable_frozen": (FrozenTable, lambda t: t.ids * {t: 2}[t]),
    "add": (AddingTable, lambda t: t.ids * (t + 1)),
}
REFUSED_AT_CONSTRUCTION = {"getattribute": "__getattribute__", "getattr": "__getattr__", "setattr": "__setattr__",
                           "shadowed_field": "'stride' is shadowed"}


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (eager's exception is the value to compare)
        return e


@needs_msgspec
@pytest.mark.parametrize("name", sorted(STRUCT_BODIES))
def test_a_struct_whose_class_runs_code_on_access_equals_eager(name):
    cls, body = STRUCT_BODIES[name]

    def step(x, stride):
        t = cls(ids=x + 1, stride=stride)
        return body(t)

    for x, stride in ((torch.ones(3), 3), (torch.arange(4.0), 3), (torch.full((2,), -1.5), 3)):
        torch._dynamo.reset()
        before = len(_compat.graph_break_reasons())
        compiled = compile_pass.compile(step, max_context_len=16)
        got, want = _outcome(compiled, x, stride), _outcome(step, x, stride)
        if isinstance(want, Exception):
            assert type(got) is type(want), (got, want)
        else:
            torch.testing.assert_close(got, want)
        breaks = _breaks(before)
        assert breaks, f"{name}: not modelled exactly, so the graph must break where eager runs the class's code"
        if name in REFUSED_AT_CONSTRUCTION:
            assert any(traceable.STRUCT_REFUSED in b for b in breaks), breaks
            assert REFUSED_AT_CONSTRUCTION[name] in traceable.struct_refusal(cls)


@needs_msgspec
def test_what_the_struct_model_covers_is_traced_in_one_graph_and_equals_eager():
    """A field holding None read with `is`, arithmetic on fields, a field compared with its default, hasattr of a
    field, a method, a name no class defines and a metaclass attribute, a plain property, truth of a Struct with no
    __bool__ / __len__, isinstance and type: one graph, eager's values."""
    class Table(_Struct):
        ids: torch.Tensor
        stride: int
        v2p: object = None

        def scaled(self, k):
            return self.ids * k

        @property
        def width(self):
            return self.stride * 10

    # the truth of a Struct is one graph from torch 2.13 on; 2.11/2.12's Dynamo asks the object and skips the frame
    # (README, "Supported versions"; test_compat checks that side)
    truth = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)

    def step(x, stride):
        t = Table(x + 1, stride)
        a = 2 if t.v2p is None else 3
        b = t.stride % 2 + t.stride // 2 + (t.stride == 3)
        c = hasattr(t, "v2p") + 2 * hasattr(t, "scaled") + 4 * hasattr(t, "nothing") + 8 * hasattr(t, "mro")
        d = ((1 if t else 0) if truth else 1) + 2 * isinstance(t, Table) + 4 * (type(t) is Table) + 8 * (t is None)
        return t.scaled(a) + b + c * 100 + d * 1000 + t.width

    for stride in (3, 4, 7):
        torch._dynamo.reset()
        before = len(_compat.graph_break_reasons())
        compiled = compile_pass.compile(step, max_context_len=16)
        got = compiled(torch.ones(2), stride)
        torch.testing.assert_close(got, step(torch.ones(2), stride))
        assert _breaks(before) == []
        assert len(compile_pass.reports(compiled)) == 1  # one graph, not a frame Dynamo skipped


@needs_msgspec
def test_the_struct_model_turns_itself_off_where_it_does_not_fit_this_torch(monkeypatch):
    """On a torch whose Dynamo reads attributes through a method the model does not answer, the model is off:
    the Struct breaks the graph where it is built (the report names why), and the result equals eager."""
    from compile_pass._compat import dynamo_hooks

    assert _compat.struct_model_unfit() is None  # every torch this runs on: the model fits
    monkeypatch.setattr(dynamo_hooks, "_ATTRIBUTE_READERS", ("no_such_reader",))
    assert "no_such_reader" in _compat.struct_model_unfit()

    def step(x):
        t = StructTable(x + 1, 3)
        return t.ids * t.stride + (t.extra if t.extra is not None else 0)

    got, breaks, _ = _one_graph(step, torch.ones(3))
    torch.testing.assert_close(got, step(torch.ones(3)))
    assert any(traceable.STRUCT_REFUSED in b for b in breaks), breaks


@needs_msgspec
@pytest.mark.parametrize("cls, why", [(GetAttributeTable, "__getattribute__"), (GetAttrTable, "__getattr__"),
                                      (SetAttrTable, "__setattr__"), (ShadowedFieldTable, "shadowed")])
def test_struct_refusal_names_what_customises_access(cls, why):
    assert why in traceable.struct_refusal(cls)


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


# -- an argument is at its default only when identical in value and type (issue 45, item 2) -------------------
# The op runs the launcher with the default for every argument it does not take: an argument equal (==) to the
# default but not identical (-0.0 for 0.0, True for 1, 1.0 for 1, a tuple holding one of those) would run with the
# default in the graph and with the argument in eager.
def _launch_defaults(x, out, scale, page_size=1, sign=0.0, nan=float("nan"), pair=(1, 0.0), mode=1):
    """Every argument the op does not take changes what it writes when it is not exactly the default."""
    k = math.copysign(1.0, sign) * (2.0 if math.isnan(nan) and math.copysign(1.0, nan) > 0 else 3.0)
    k += 10.0 * (type(pair[0]) is bool) + 100.0 * math.copysign(1.0, pair[1]) + 1000.0 * (type(mode) is not int)
    k += 10000.0 * (type(scale) is not float) + 100000.0 * (type(page_size) is not int)
    out.copy_(x * scale * page_size + k)


LAUNCH_DEFAULTS = torch.compiler.disable(_launch_defaults)


@pytest.fixture
def defaults_launcher():
    op = _register(_launch_defaults, "syncfree_test::launch_defaults")
    yield op
    compile_pass.unregister_disabled_launcher(_launch_defaults)


NOT_THE_DEFAULT = [("sign", -0.0), ("nan", -float("nan")), ("nan", 1.0), ("pair", (1, -0.0)), ("pair", (True, 0.0)),
                   ("pair", (1.0, 0.0)), ("pair", (1, 0)), ("pair", (1, 0.0, 0)), ("mode", True), ("mode", 1.0)]
THE_DEFAULT = [("sign", 0.0), ("nan", float("nan")), ("pair", (1, 0.0)), ("mode", 1), (None, None)]


@pytest.mark.parametrize("name, value", NOT_THE_DEFAULT)
def test_a_launcher_argument_equal_but_not_identical_to_its_default_breaks(defaults_launcher, name, value):
    def step(x):
        out = torch.empty_like(x)
        LAUNCH_DEFAULTS(x + 1, out, 2.0, **{name: value})
        return out * 3

    got, breaks, _ = _one_graph(step, torch.ones(3))
    torch.testing.assert_close(got, step(torch.ones(3)))
    assert any(traceable.LAUNCHER_REFUSED + f" ({name}=)" in b for b in breaks), breaks


@pytest.mark.parametrize("name, value", THE_DEFAULT)
def test_a_launcher_argument_identical_to_its_default_is_traced_as_the_op(defaults_launcher, name, value):
    def step(x):
        out = torch.empty_like(x)
        LAUNCH_DEFAULTS(x + 1, out, 2.0, **({name: value} if name else {}))
        return out * 3

    got, breaks, _ = _one_graph(step, torch.ones(3))
    torch.testing.assert_close(got, step(torch.ones(3)))
    assert breaks == []


@pytest.mark.parametrize("args, name", [((2, 1), "scale"), ((2.0, True), "page_size"), ((2.0, 1.0), "page_size")])
def test_a_launcher_argument_the_op_would_convert_breaks(defaults_launcher, args, name):
    """The op hands the launcher what the dispatcher makes of a value: an int given for `float scale` arrives as
    2.0, True for `SymInt page_size` as 1. Not what eager passes: the break stands, the report names it."""
    def step(x):
        out = torch.empty_like(x)
        LAUNCH_DEFAULTS(x + 1, out, *args)
        return out * 3

    got, breaks, _ = _one_graph(step, torch.ones(3))
    torch.testing.assert_close(got, step(torch.ones(3)))
    assert any(traceable.LAUNCHER_REFUSED + f" ({name}=)" in b for b in breaks), breaks


@pytest.mark.parametrize("value, default, same", [
    (0.0, 0.0, True), (-0.0, 0.0, False), (0.0, -0.0, False), (float("nan"), float("nan"), True),
    (-float("nan"), float("nan"), False), (float("nan"), 0.0, False), (1, True, False), (True, 1, False),
    (1, 1.0, False), (True, True, True), (False, 0, False), (None, None, True), (None, 0, False), ("a", "a", True),
    ((1, 0.0), (1, 0.0), True), ((1, -0.0), (1, 0.0), False), ((True,), (1,), False), ((1,), (1, 1), False),
    ((float("nan"),), (float("nan"),), True), ([1], [1], False), (2**70, 2**70, True), (1.5, 1.5, True),
])
def test_same_default_is_identity_of_value_and_type(value, default, same):
    assert traceable._same_default(value, default) is same


# -- a branch that differs inside the range: traced at the bound, asserted on the device, or traced again ------
def _branch_step(fb):
    m = fb.seq_lens.max().item()
    n = m + 4 if m < 8 else m  # False at the bound (64): the branch differs inside [0, 64]
    table = fb.req_to_token[fb.req_pool_indices, :n]
    return torch.ops.syncfree_test.bounded_sum(table, fb.seq_lens, 1, n)


def test_a_branch_whose_outcomes_rewrite_differently_breaks_and_never_raises():
    """Traced at the bound (n = m) and again with the other outcome (n = m + 4): the two rewritten graphs differ
    (the upper bound 64 against 68), so the frame is traced a third time with the range only, the branch breaks
    the graph as without the backend, and every max in [0, 64] gives eager's value: none raises (issue 45)."""
    import consumers_for_tests  # noqa: F401  (syncfree_test::bounded_sum, a self-guarding consumer)
    from passlib import make_fb

    before = len(_compat.graph_break_reasons())
    step = compile_pass.compile(_branch_step, max_context_len=64)
    for lengths in ([3, 9, 60], [8, 1, 2], [3, 5, 7], [0, 0, 0], [64, 1, 1]):
        fb = make_fb(lengths)
        torch.testing.assert_close(step(fb), _branch_step(fb))
    assert any("data-dependent" in r for r in _breaks(before))
    line = f"test_tracing.py:{_branch_step.__code__.co_firstlineno + 1}"
    assert all(i.location != line for r in compile_pass.reports(step) for i in r.rewritten)


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


# -- a Struct's arguments bind as msgspec binds them, without reading its annotations ------------------------------
if msgspec is not None:
    import typing as _typing

    if _typing.TYPE_CHECKING:  # resolved only by a type checker: msgspec's signature raises NameError on it
        from engine.types import Scale  # noqa: F401

    class ForwardRefTable(_Struct):
        ids: torch.Tensor
        scale: "Scale" = 2  # noqa: F821

    class KwOnlyBase(_Struct, kw_only=True):
        a: int
        b: int = 2

    class MixedTable(KwOnlyBase):
        ids: torch.Tensor
        c: int = 5


@needs_msgspec
def test_a_struct_with_a_forward_reference_annotation_is_traced_and_equals_eager():
    """`scale: "Scale"` imported under TYPE_CHECKING: inspect.signature raises NameError (msgspec resolves the
    annotations); the arguments still bind from msgspec's metadata, as its constructor binds them."""
    with pytest.raises(NameError):
        import inspect

        inspect.signature(ForwardRefTable)

    def step(x):
        t = ForwardRefTable(x + 1)
        u = ForwardRefTable(x, scale=3)
        return t.ids * t.scale + u.ids * u.scale

    got, breaks, _ = _one_graph(step, torch.ones(3))
    torch.testing.assert_close(got, step(torch.ones(3)))
    assert breaks == []


@needs_msgspec
@pytest.mark.parametrize("args, kwargs", [
    ((), {"ids": 1, "a": 4}), ((1,), {"a": 4}), ((1, 7), {"a": 4, "b": 9}), ((1,), {}), ((1, 2, 3), {"a": 4}),
    ((1,), {"a": 4, "ids": 2}), ((1,), {"a": 4, "zz": 1}), ((), {"a": 4}),
])
def test_struct_fields_bind_as_msgspec_does(args, kwargs):
    """The binding (traceable._struct_fields, on plain values) refuses exactly where msgspec's constructor raises,
    and otherwise gives the fields msgspec stores (positional fields first, keyword-only after, defaults last)."""
    try:
        made = MixedTable(*args, **kwargs)
    except TypeError:
        made = None
    fields, why = traceable._struct_fields(MixedTable, [_compat.constant_variable(a) for a in args],
                                           {k: _compat.constant_variable(v) for k, v in kwargs.items()})
    if made is None:
        assert fields is None and "eager raises" in why
    else:
        assert why is None
        assert {k: v.as_python_constant() for k, v in fields.items()} == \
            {k: getattr(made, k) for k in MixedTable.__struct_fields__}

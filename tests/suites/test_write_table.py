"""Table-driven tests of the write analysis (issue 18, "soundness by construction"; DESIGN.md "Default deny").

(a) Unit level, every aten overload whose schema writes an argument (`Tensor(a!)`, out= included): a one-node FX
    graph calling it, spelled as the overload (positional, then by keyword) and as the packet; `written_by` must
    name every written argument. Plus the call_method / callable spellings Dynamo emits.
(b) End to end through Dynamo with the pass-only backend: the canonical step plus one write to a protected tensor
    (or a view of it) between the max and the consumer, for every in-place Tensor method that eager accepts on
    int tensors, every in-place dunder in three spellings, numpy in place, out=, packets, an allow_in_graph
    helper, ...: the max must be KEPT (host read left, nothing rewritten) and the compiled step must equal eager.
(c) The chained-gather window: `rows = req_to_token[rpi]`, a write, then `rows[:, :m:ps] // ps`: kept or equal.
"""

from __future__ import annotations

import itertools
import operator

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

import program_generator as pg
from compile_pass.mutations import written_by

# == (a) every aten overload that writes ====================================================================
_TENSOR = torch._C.TensorType.get()


def _is_tensor(t) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return t.isSubtypeOf(_TENSOR)


def _is_tensor_list(t) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.ListType) and _is_tensor(t.getElementType())


_DUMMIES = {"int": 1, "SymInt": 1, "float": 1.0, "bool": False, "Scalar": 1, "str": "none", "int[]": [1],
            "SymInt[]": [1], "float[]": [1.0], "bool[]": [False], "Scalar[]": [1], "str[]": ["none"],
            "ScalarType": torch.float32, "Layout": torch.strided, "Device": torch.device("cpu"),
            "MemoryFormat": torch.contiguous_format, "Dimname": "N", "Dimname[]": ["N"]}


def _dummy(arg):
    if arg.has_default_value():
        return arg.default_value
    if isinstance(arg.type, torch._C.OptionalType):
        return None
    kind = str(arg.type)
    if kind.startswith("int[") or kind.startswith("SymInt["):
        return [1]
    if kind.startswith("bool["):
        return [False]
    return _DUMMIES.get(kind)


def writing_overloads() -> list:
    found = []
    for name in sorted(dir(torch.ops.aten)):
        try:
            packet = getattr(torch.ops.aten, name)
        except Exception:  # noqa: BLE001 - a name that does not resolve to an op
            continue
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            writes = [a for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            # (TorchScript's list ops, `aten.add_.t(t[](a!) self, ...)`, write Python lists: not tensors)
            if writes and all(_is_tensor(a.type) or _is_tensor_list(a.type) for a in writes):
                found.append(op)
    return found


WRITING = writing_overloads()


def build_call(op: torch._ops.OpOverload, spelling: str):
    """(node, the placeholders of the written arguments) for a one-call graph of `op`."""
    graph = torch.fx.Graph()
    fake = FakeTensorMode()
    counter = [0]

    def placeholder(name):
        counter[0] += 1
        node = graph.placeholder(f"{name}_{counter[0]}")
        node.meta["example_value"] = fake.from_tensor(torch.empty(2, 2))
        return node

    args, kwargs, written = [], {}, []
    for arg in op._schema.arguments:
        if _is_tensor_list(arg.type):
            value = [placeholder(arg.name), placeholder(arg.name)]
        elif _is_tensor(arg.type):
            value = placeholder(arg.name)
        else:
            value = _dummy(arg)
        if arg.alias_info is not None and arg.alias_info.is_write:
            written += value if isinstance(value, list) else [value]
        if spelling == "keywords" or arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            args.append(value)
    target = op if spelling != "packet" else op.overloadpacket
    node = graph.call_function(target, tuple(args), kwargs)
    graph.output(node)
    return node, written


def _missed(spelling: str) -> list[str]:
    missed = []
    for op in WRITING:
        node, written = build_call(op, spelling)
        try:
            found = set(written_by(node))
        except Exception as e:  # noqa: BLE001 - a crash is a miss
            missed.append(f"{op} ({spelling}): written_by raised {type(e).__name__}: {e}")
            continue
        lost = [n.name for n in written if n not in found]
        if lost:
            missed.append(f"{op} ({spelling}): {lost} not reported written")
    return missed


def test_the_table_is_the_whole_aten_namespace():
    names = {str(op) for op in WRITING}
    assert len(WRITING) > 800, len(WRITING)
    for expected in ("aten.add_.Tensor", "aten.clamp.out", "aten.copy_.default", "aten.index_put_.default",
                     "aten._foreach_add_.Scalar", "aten.max.dim_max", "aten.sort.values"):
        assert expected in names


@pytest.mark.parametrize("spelling", ["positional", "keywords", "packet"])
def test_every_written_argument_of_every_aten_overload_is_reported(spelling):
    """`torch.ops.aten.X.overload(...)`, by position or by keyword, and `torch.ops.aten.X(...)` (the packet, which
    resolves to the overload its arguments select: `aten.clamp(x, 40, 60, out=x)` is `clamp.out`, whose write the
    packet's `.default` schema does not show)."""
    missed = _missed(spelling)
    assert not missed, f"{len(missed)} of {len(WRITING)} overloads:\n" + "\n".join(missed[:40])


@pytest.mark.parametrize("op, spelling", [
    ("clamp.out", "packet"), ("add_.Tensor", "packet"), ("add_.Scalar", "packet"), ("copy_.default", "packet"),
    ("fill_.Scalar", "packet"), ("index_put_.default", "keywords"), ("add.out", "keywords"),
    ("_foreach_add_.Scalar", "positional"), ("sort.values", "packet"), ("max.dim_max", "keywords"),
])
def test_named_overloads(op, spelling):
    packet, overload = op.split(".")
    node, written = build_call(getattr(getattr(torch.ops.aten, packet), overload), spelling)
    assert set(written) <= set(written_by(node))


def _graph_with(n_inputs=2):
    graph = torch.fx.Graph()
    fake = FakeTensorMode()
    nodes = []
    for i in range(n_inputs):
        node = graph.placeholder(f"x{i}")
        node.meta["example_value"] = fake.from_tensor(torch.zeros(4, dtype=torch.int64))
        nodes.append(node)
    return graph, nodes


@pytest.mark.parametrize("method", pg.inplace_methods() + list(pg.DUNDERS) + ["foo_bar", "frobnicate"])
def test_call_method_writes_self(method):
    """`x.add_(1)`, `x.__iadd__(1)` (Dynamo keeps the dunder as a call_method) and unknown methods: self written."""
    graph, (x, y) = _graph_with()
    node = graph.call_method(method, (x, y))
    assert x in written_by(node)


@pytest.mark.parametrize("target", [
    *(getattr(torch.Tensor, d) for d in pg.DUNDERS),
    *(getattr(operator, d.strip("_")) for d in pg.DUNDERS),
    torch.Tensor.add_, torch.relu_, torch.fill_, torch.index_put_,
], ids=lambda t: f"{getattr(t, '__module__', None) or type(t).__name__}.{getattr(t, '__qualname__', None) or t.__name__}")
def test_call_function_inplace_writes_its_first_argument(target):
    graph, (x, y) = _graph_with()
    node = graph.call_function(target, (x, y) if target not in (torch.relu_,) else (x,))
    assert x in written_by(node)


def _numpy_wrappers():
    from torch._dynamo import utils

    return [utils.numpy_operator_wrapper(operator.iadd), utils.numpy_method_wrapper("fill"),
            utils.numpy_method_wrapper("sort"), utils.numpy_to_tensor_wrapper(lambda a: a)]


@pytest.mark.parametrize("target", [pg.opaque_bump, pg.user_writer, lambda t, u: None, *_numpy_wrappers()],
                         ids=["allow_in_graph", "user_function", "lambda", "np_iadd", "np_fill", "np_sort",
                              "np_to_tensor"])
def test_opaque_callables_write_every_tensor_they_receive(target):
    """Default deny: a callable the pass does not know writes every tensor argument (nested ones too)."""
    graph, (x, y) = _graph_with()
    node = graph.call_function(target, (x,), {"other": [y]})
    assert {x, y} <= set(written_by(node))


@pytest.mark.parametrize("target, args, kwargs", [
    (torch.ops.aten.add.Tensor, 2, {}), (torch.ops.aten.clamp, 1, {"min": 0}), (torch.ops.aten.floor_divide, 2, {}),
    (operator.floordiv, 2, {}), (operator.getitem, 1, {}), (torch.ops.aten.max.default, 1, {}),
], ids=str)
def test_pure_ops_write_nothing(target, args, kwargs):
    """The canonical step must stay rewritable: a pure op (schema, packet without out=, operator) writes nothing."""
    graph, nodes = _graph_with()
    call_args = tuple(nodes[:args]) if target is not operator.getitem else (nodes[0], slice(None, 2))
    assert written_by(graph.call_function(target, call_args, kwargs)) == []


# == (b) end to end: one write between the max and the consumer ================================================
def _e2e_programs() -> tuple[list, dict]:
    """Deterministic: every in-place method in two of the three roles (rotating; a third when eager refuses one),
    on a view or the tensor itself (rotating); every dunder in three spellings, each spelling in another role;
    numpy, out=, packets and opaque callables in two roles. The write sits between the gather and the consumer
    (for the lengths, alternately between the max and the gather)."""
    programs, refused = [], {}
    n = 0

    def add(name, category, statement, target, position, method=None):
        nonlocal n
        n += 1
        programs.append(pg.Program(
            name=name, category=category, source=pg.step_source(statement, position, ps=4 if n % 5 == 0 else 1),
            must_keep=pg.must_keep(pg.role_of(target), position, method, target),
            vectors=pg.program_vectors(2, n), seed=n))

    def place(i, name, category, statement_for, roles_wanted, method=None) -> int:
        placed = 0
        for r in range(len(pg.ROLES)):
            role = pg.ROLES[(i + r) % len(pg.ROLES)]
            views = pg.VIEWS[role]
            position = ("max_gather", "gather_consumer")[i % 2] if role == "lens" else "gather_consumer"
            for target in dict.fromkeys((views[i % len(views)], views[0])):
                statement = statement_for(target)
                if statement is not None:
                    add(f"{name} | {target}", category, statement, target, position, method)
                    placed += 1
                    break
            if placed == roles_wanted:
                break
        return placed

    for i, method in enumerate(pg.inplace_methods()):
        if not place(i, method, "method", lambda t, m=method: pg.method_statement_for(m, t), 2, method):
            refused[method] = "eager refuses it on int tensors with every simple argument"

    def accepted(template):
        return lambda t: template.format(t=t) if pg.eager_accepts(template.format(t=t)) else None

    for j, (name, template) in enumerate(pg.dunder_edits()):  # dunder k's three spellings: roles k, k+1, k+2
        place(j + j // 3, f"dunder {name}", "dunder", accepted(template), 1)
    for j, (name, template) in enumerate(pg.NUMPY_EDITS):
        place(j, name, "numpy", accepted(template), 2)
    for j, (name, template) in enumerate(pg.MISC_EDITS):
        place(j, name, "misc", accepted(template), 2)
    return programs, refused


E2E, REFUSED = _e2e_programs()
_UNTRACEABLE: dict = {}


def test_e2e_table_covers_every_inplace_method():
    names = {p.name.split(" | ")[0] for p in E2E}
    methods = pg.inplace_methods()
    assert all(m in names or m in REFUSED for m in methods)
    covered = [m for m in methods if m in names]
    print(f"\nin-place methods: {len(methods)}; in a program: {len(covered)}; refused by eager on int tensors "
          f"({len(REFUSED)}): {' '.join(sorted(REFUSED))}")
    assert len(covered) > 60
    assert {p.category for p in E2E} == {"method", "dunder", "numpy", "misc"}
    dunder_spellings = {p.name.split(" | ")[0] for p in E2E if p.category == "dunder"}
    assert len(dunder_spellings) == 3 * len(pg.DUNDERS), sorted(dunder_spellings)


def _check(result: pg.Result):
    program = result.program
    if result.untraceable:
        _UNTRACEABLE[program.name] = result.untraceable
        pytest.skip(f"Dynamo cannot trace it under fullgraph=True: {result.untraceable}")
    where = f"\n{program.source}"
    assert not result.crashed, f"the pass crashed: {result.crashed}{where}"
    if result.divergences and result.dynamo_also_diverges:
        pytest.xfail(f"Dynamo alone (no pass) diverges from eager: {result.divergences[0]}")
    if result.divergences:
        pytest.fail("compiled != eager:\n  " + "\n  ".join(result.divergences) + where, pytrace=False)
    if program.must_keep and not (result.kept and result.host_reads and not result.rewritten):
        pytest.fail(f"a protected tensor is written between the max and the consumer, yet the max was rewritten"
                    f"{where}", pytrace=False)


@pytest.mark.parametrize("program", E2E, ids=[p.name for p in E2E])
def test_write_between_max_and_consumer_keeps_the_max(program):
    _check(pg.run_program(program))


# == (c) the chained-gather window ============================================================================
CHAINED = [
    pg.Program(name=f"chained {name} | {target} | ps={ps}", category="chained",
               source=pg.step_source(template.format(t=target), "max_gather", chained=True, ps=ps),
               vectors=pg.program_vectors(2, i), seed=i)
    for i, ((name, template), target) in enumerate(itertools.product(
        (("add_", "{t}.add_(1)"), ("copy_ flip", "{t}.copy_({t}.flip(0))"), ("setitem", "{t}[0] = 1"),
         ("np a+=1", "_a = {t}.numpy(); _a += 1"), ("out=", "torch.add({t}, 1, out={t})"),
         ("allow_in_graph", "_s = opaque_bump({t})")),
        ("r2t", "rpi", "r2t[:, :8]", "rpi[1:]")))
    for ps in [(1, 4)[i % 2]]
]


@pytest.mark.parametrize("program", CHAINED, ids=[p.name for p in CHAINED])
def test_chained_gather_window_is_kept_or_equal(program):
    """`rows = req_to_token[rpi]` read the table; a write to the table or the indices follows; then the page table
    is sliced from `rows`. A table rebuilt from req_to_token/rpi at the slice would see the write eager did not."""
    _check(pg.run_program(program))

"""Two traces of one frame, compared: the TraceSignature of a trace (its rewritten graph and the code Dynamo runs
around it, spelled so that two traces in one process agree exactly where they compute the same thing), and the one
relation between two different signatures that the backend accepts (`regrown_scratch`).

A branch on a bounded max whose outcome differs inside [0, bound] is traced with each outcome
(compile_pass.tracing, traced_ranges.settle_at_bound). The two traces are one computation where their signatures are
equal (TraceSignature.same_computation): then either trace's code gives eager's values for every max. Besides
that, one relation, under options['static_escapes'] only: the bound's outcome regrows a scratch that the other
outcome slices as it is (SGLang's FlashMLA `_eager_block_kv_indices` with a scratch an earlier step left narrower
than the bound): see regrown_scratch.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import NamedTuple

import torch
import torch.fx

from . import _compat
from .allocations import as_allocation


class ScratchTable(NamedTuple):
    """A table `base[:B, :w]` that the allocated-table rule rewrote (rules/allocated_table.py): `base` a graph input
    (a persistent scratch) or an allocation the step stores for later steps (the scratch regrown), `table` the
    slice its writer fills and its readers read, `stride` where the writer's row stride is in its call:
    ("arg", i) / ("kwarg", name) of an op, ("kernel", name) of a Triton launch (its constants or its kwargs), or
    None (not passed)."""

    base: torch.fx.Node
    table: torch.fx.Node
    writer: torch.fx.Node
    stride: tuple | None


class _Spelled:
    """A value a scratch form writes by what it is (`the table's width`): spelled as its text, equal only to
    itself (TraceSpelling)."""

    def __init__(self, text: str):
        self.text = text


_WIDTH, _ROW_STRIDE = _Spelled("<the scratch table's width>"), _Spelled("<the scratch table's row stride>")


@dataclasses.dataclass(frozen=True)
class ScratchForm:
    """A trace's graph spelled with its one scratch table written by what it holds, not by where its cells live:
    the scratch itself (a graph input, or an allocation the step stores) is not spelled, the table is "the scratch
    table" of its rows, and the writer's row stride is "the table's row stride". `source`: where the scratch lives
    between steps (the input's source; or the attribute the step stores it in, FrameResidual.stores). `cells`: its
    dtype and device, and the table's rows. `regrown`: the step allocates the scratch and stores it (its graph output `output`, the
    last)."""

    graph: str
    source: str
    cells: str
    regrown: bool
    output: int | None = None


@dataclasses.dataclass(frozen=True)
class TraceSignature:
    """What one trace of the frame computes and the guards it runs under: the rewritten graph (each placeholder by
    its source, each callable and object by identity: TraceSpelling), the code Dynamo runs before the graph call
    (what it builds there and hands the graph: a Parameter of an input) and after it (side effects, returned
    constants, where each output goes), and what runs around the graph that the code does not hold
    (`uncompared`: Python random calls replayed with arguments fixed when traced). `kept` holds every object
    spelled by identity, so that its id is not reused while this signature is compared."""

    graph: str
    before: str
    after: str
    guards: frozenset
    uncompared: tuple = ()
    kept: tuple = dataclasses.field(default=(), compare=False, repr=False)
    stores: tuple | None = dataclasses.field(default=None, compare=False, repr=False)  # FrameResidual.stores
    scratch: ScratchForm | None = dataclasses.field(default=None, compare=False, repr=False)

    def same_computation(self, first: "TraceSignature") -> bool:
        """This trace (the other outcome's: its compiled code is what runs) computes what `first` (the bound's
        outcome's) computes wherever its guards hold: nothing uncompared in either, the same graph and code
        around it, and every guard of `first` among its own (a guard only `first` made, on a value only that
        outcome read, would not be checked)."""
        return not self.uncompared and not first.uncompared and self.graph == first.graph \
            and self.before == first.before and self.after == first.after and first.guards <= self.guards


def uncompared_reason(signature: TraceSignature) -> str:
    """Why a trace that runs code the signature does not hold is never called the same as another."""
    return (f"Dynamo runs code around the graph that the two outcomes' comparison does not read "
            f"({'; '.join(signature.uncompared)}); the rewrite is proven when the step does not depend on it")


def outcomes_differ(first: TraceSignature, second: TraceSignature) -> str:
    """Why two traces of a branch's outcomes are not one computation, and what would make them one."""
    if first.uncompared or second.uncompared:
        return uncompared_reason(first if first.uncompared else second)
    if first.graph != second.graph:
        return ("its two outcomes compute different graphs (a width, an op, a callable or an input that depends on "
                "the outcome); the rewrite is proven when both outcomes size and fill the table alike (a round-up "
                "to a multiple that the bound's width is one of, a scratch already as wide as the bound's pages)")
    if first.before != second.before:
        return ("its two outcomes differ in what Dynamo builds before the graph (a Parameter of another input, a "
                "value hoisted out of the graph); the rewrite is proven when they do not")
    if first.after != second.after:
        return ("its two outcomes differ outside the graph (an attribute stored, a constant returned); the rewrite "
                "is proven when they do not")
    missing = sorted(first.guards - second.guards)
    return (f"the bound's outcome depends on a value the other outcome does not read ({missing[0]}): its compiled "
            "code would not be guarded by it")


def frame_signature(graph: torch.fx.Graph, scratch_tables=()) -> TraceSignature | None:
    """The TraceSignature of the trace being compiled (graph_signature, _compat.frame_residual), its objects
    spelled by one TraceSpelling, with its ScratchForm where the pass rewrote exactly one scratch table
    (`scratch_tables`: ScratchTable). None where the code around the graph cannot be read (a graph that ends at a
    graph break among them): the trace is then never called the same as another (an attribute store, a
    returned constant or a guard that differs between the outcomes is not in the graph)."""
    spell = TraceSpelling()
    residual = _compat.frame_residual(spell)
    if residual is None:
        return None
    form = scratch_form(graph, scratch_tables[0], residual.stores, spell) if len(scratch_tables) == 1 else None
    return TraceSignature(graph_signature(graph, spell), residual.before, residual.after, residual.guards,
                          residual.uncompared, tuple(spell.kept), residual.stores, form)


class TraceSpelling:
    """How a TraceSignature writes a value that two traces must agree on (a graph's call target or constant, a
    constant or global of the code around it). Both traces run in one process, so "the same" is decided exactly:

      * a plain literal by its value, which its repr says in full: None, bool, int, str, bytes, Ellipsis; a torch
        dtype, device, layout or memory format; a float by its repr and its 64 bits (repr tells -0.0 from 0.0 but
        not a NaN's sign or payload: -nan, which `inf - inf` gives on x86, prints as nan); a tuple or frozenset
        of these (exact types: an int subclass such as an IntEnum, or a str subclass, is not one);
      * anything else by identity: its id, with the object kept in `kept` for as long as the signature lives, so
        that no other object takes that id while the two signatures are compared (the bound's outcome's is held
        as evidence until the other outcome's is compared). Two objects that print alike (two closures of one
        factory: one __module__ and __qualname__; two classes of one factory: one repr) are then different."""

    _LITERALS = (type(None), bool, int, float, str, bytes, type(Ellipsis), torch.dtype, torch.device, torch.layout,
                 torch.memory_format)

    def __init__(self):
        self.kept: list = []

    def __call__(self, value) -> str:
        kind = type(value)
        if kind is _Spelled:
            return value.text
        if kind is float:
            return f"{value!r} (bits {struct.pack('<d', value).hex()})"
        if kind in self._LITERALS:
            return repr(value)
        if kind is tuple:
            return "(" + "".join(self(v) + ", " for v in value) + ")"
        if kind is frozenset:
            return "frozenset({" + ", ".join(sorted(self(v) for v in value)) + "})"
        self.kept.append(value)
        named = value if hasattr(value, "__qualname__") else kind
        return f"<{getattr(named, '__module__', '')}.{getattr(named, '__qualname__', kind.__name__)} " \
               f"id {id(value):#x}>"


def graph_signature(graph: torch.fx.Graph, spell: TraceSpelling, scratch: ScratchTable | None = None) -> str:
    """The graph as text with nothing but what it computes: each node's op, target (a callable by identity:
    `spell`), and arguments (other nodes by position, constants by `spell`), compiled regions' bodies included;
    no names, no meta. Two traces of one frame compute the same thing where their signatures, spelled while
    both are alive, are equal. With `scratch`, its ScratchForm's spelling: the scratch not spelled (neither its
    node nor its place among the graph's outputs), the table's width and the writer's row stride by what they
    are (scratch_form checks that they are nothing else)."""
    index: dict = {}
    if scratch is not None:
        index[scratch.base] = "the scratch"

    def arg(a) -> str:
        if isinstance(a, torch.fx.Node):
            return f"%{index[a]}"
        if type(a) in _FX_SEQUENCES:  # exact types: a named tuple is an object of its own (spell: identity)
            return type(a).__name__ + "(" + ", ".join(arg(x) for x in a) + ")"
        if type(a) in _FX_DICTS:
            return "{" + ", ".join(f"{spell(k)}: {arg(v)}" for k, v in a.items()) + "}"
        if type(a) is slice:
            return f"slice({arg(a.start)}, {arg(a.stop)}, {arg(a.step)})"
        return spell(a)

    lines = []
    owner = graph.owning_module
    for node in graph.nodes:
        if scratch is not None and node is scratch.base:
            continue
        index[node] = len(index) - (scratch is not None)
        if node.op == "placeholder":  # where it comes from: two traces may lift other inputs in its place
            lines.append(f"placeholder {index[node]} {_compat.placeholder_source_name(node)}")
            continue
        if node.op in ("get_attr", "call_module"):
            target = _attribute(owner, str(node.target), spell)  # what it reads, not its name
        elif node.op == "call_function":
            target = spell(node.target)
        else:  # call_method, output: a name
            target = str(node.target)
        if node.op == "call_function" and "constant_args_idx" in node.kwargs:
            # A user Triton launch names its kernel and constant arguments by their index in torch's kernel side
            # table, which gives every trace's constants a new index: spelled by what the entries hold (the kernel
            # by identity, each constant by `spell`), two launches of one kernel with equal constants are one
            # launch. Where the table does not hold them (torch._dynamo.reset() empties it from torch 2.12 on and
            # the indices start again: an index alone names nothing), the launch is a fresh object: never another
            # trace's.
            launched = _compat.user_triton_kernel(node)
            if launched is None:
                lines.append(f"{node.op} {target} {spell(object())}")
                continue
            kernel, constants = launched
            rest = {k: v for k, v in node.kwargs.items() if k not in ("kernel_idx", "constant_args_idx")}
            if scratch is not None and node is scratch.writer and scratch.stride is not None:
                constants, rest = _stride_spelled(scratch.stride, constants, rest)
            lines.append(f"{node.op} {target} {arg(node.args)} launches {spell(kernel)} with the constants "
                         f"{arg(constants)} {arg(rest)}")
            continue
        args, kwargs = node.args, node.kwargs
        if scratch is not None and node is scratch.table:
            base, (rows, cols) = args
            args = (base, (rows, slice(cols.start, _WIDTH, cols.step)))
        elif scratch is not None and node is scratch.writer and scratch.stride is not None:
            args, kwargs = _stride_spelled(scratch.stride, args, kwargs)
        elif scratch is not None and node.op == "output":
            args = torch.fx.node.map_aggregate(args, lambda a: a)  # a copy: the scratch's place dropped below
            args = (tuple(a for a in args[0] if a is not scratch.base),) if isinstance(args[0], (tuple, list)) \
                else args
        lines.append(f"{node.op} {target} {arg(args)} {arg(kwargs)}")
    return "\n".join(lines)


def _stride_spelled(stride: tuple, first, second):
    """(first, second) with the writer's row stride replaced by what it is: ("arg", i) in the positional
    arguments `first`, ("kwarg", name) in the keyword arguments `second`, ("kernel", name) in a Triton launch's
    constants `first` or its `kwargs` entry of `second`."""
    kind, key = stride
    if kind == "arg":
        return tuple(_ROW_STRIDE if i == key else a for i, a in enumerate(first)), second
    if kind == "kwarg":
        return first, {k: _ROW_STRIDE if k == key else v for k, v in second.items()}
    constants = {k: _ROW_STRIDE if k == key else v for k, v in dict(first).items()}
    rest = dict(second)
    if isinstance(rest.get("kwargs"), dict):
        rest["kwargs"] = {k: _ROW_STRIDE if k == key else v for k, v in rest["kwargs"].items()}
    return constants, rest


_FX_SEQUENCES = (list, tuple, torch.Size, torch.fx.immutable_collections.immutable_list)  # what FX args nest
_FX_DICTS = (dict, torch.fx.immutable_collections.immutable_dict)


def _attribute(owner, path: str, spell: TraceSpelling) -> str:
    """What a get_attr or call_module node reads from the graph's module: a compiled region's body by its
    signature; a module by the identity of its state (Dynamo gives each trace's graph module fresh proxies of
    the user's modules, nn_module_proxy, each sharing its module's __dict__); anything else by `spell`. An
    attribute that cannot be read is spelled as a fresh object: never the same as another trace's."""
    if owner is None:
        return spell(object())
    try:
        value = owner
        for name in path.split("."):
            value = getattr(value, name)
    except AttributeError:
        return spell(object())
    if isinstance(value, torch.fx.GraphModule):
        return "{" + graph_signature(value.graph, spell).replace("\n", "; ") + "}"
    if isinstance(value, torch.nn.Module):
        return f"{type(value).__qualname__} with the state {spell(vars(value))}"
    return spell(value)




def scratch_form(graph: torch.fx.Graph, scratch: ScratchTable, stores, spell: TraceSpelling) -> ScratchForm | None:
    """The trace's ScratchForm, or None where its scratch is not one of the two forms regrown_scratch relates:
      * the scratch sliced as it is: a graph input whose only use is the table `base[:B, :w]` (columns from 0,
        step 1), not among the graph's outputs, whose memory no other tensor input of the graph shares;
      * the scratch regrown: a 2-D allocation whose only uses are the table and the graph's last output, which
        the code after the graph stores in one attribute (FrameResidual.stores) and nowhere else."""
    base, table = scratch.base, scratch.table
    if not (table.op == "call_function" and len(table.args) == 2 and table.args[0] is base
            and isinstance(table.args[1], tuple) and len(table.args[1]) == 2
            and all(type(s) is slice for s in table.args[1])):
        return None
    cols = table.args[1][1]
    if cols.start not in (None, 0) or cols.step not in (None, 1):
        return None
    output = graph.output_node()
    outputs = output.args[0] if output.args and isinstance(output.args[0], (tuple, list)) else None
    if outputs is None:
        return None
    value, view = _compat.example_value(base), _compat.example_value(table)
    if not isinstance(value, torch.Tensor) or value.ndim != 2 or not isinstance(view, torch.Tensor):
        return None
    # the table's rows as this trace knows them (a regrown scratch of fewer rows than the other's slice would give
    # the writer and the readers fewer rows than eager's table has)
    cells = f"{value.dtype} on {value.device}, the table's rows {view.shape[0]}"
    if base.op == "placeholder":
        if set(base.users) != {table} or base in outputs or _shares_memory(graph, base):
            return None
        source = _compat.placeholder_source_name(base)
        return ScratchForm(graph_signature(graph, spell, scratch), source, cells, False) if source else None
    spelled = as_allocation(base)
    if spelled is None or spelled.rank != 2 or set(base.users) != {table, output} \
            or [i for i, o in enumerate(outputs) if o is base] != [len(outputs) - 1] or stores is None:
        return None
    where = [w for w, node in stores if node is base]
    if len(where) != 1:
        return None
    return ScratchForm(graph_signature(graph, spell, scratch), where[0], cells, True, len(outputs) - 1)


def _shares_memory(graph: torch.fx.Graph, base: torch.fx.Node) -> bool:
    """Does another tensor input of the graph share the scratch's memory (a view of it kept from an earlier step,
    `state.stored`), or can that not be told? Eager's step writes the table into the scratch, which such a view
    sees; the regrown scratch's step would not (found by a helper's programs, 2026-12-05)."""
    mine = _compat.storage_id(_compat.example_value(base))
    if mine is None:
        return True
    for node in graph.nodes:
        value = _compat.example_value(node) if node.op == "placeholder" and node is not base else None
        if isinstance(value, torch.Tensor) and _compat.storage_id(value) in (mine, None):
            return True
    return False


# What the code after the graph may do to store one graph output in an attribute, and nothing else: load the
# output and the owner (locals, cells, constants: no global, whose name may be bound to anything), keep the owner in
# a fresh local (STORE_FAST of a name the other code never uses), index the outputs, and one call (a setattr Dynamo
# loaded into a local) or one STORE_ATTR.
_STORE_CODE = {"NOP", "PUSH_NULL", "LOAD_FAST", "LOAD_DEREF", "LOAD_CONST", "BINARY_SUBSCR", "PRECALL", "CALL",
               "CALL_FUNCTION", "POP_TOP", "STORE_ATTR", "ROT_TWO", "ROT_THREE", "SWAP", "COPY", "DUP_TOP",
               "STORE_FAST"}
_STORING = {"CALL", "CALL_FUNCTION", "STORE_ATTR"}


def regrown_scratch(first: TraceSignature, second: TraceSignature) -> bool:
    """Is the bound's outcome (`first`) the other outcome (`second`) with its scratch regrown? Exactly:
      * the other outcome slices a scratch as it is (a graph input S, ScratchForm) and the bound's outcome
        allocates one of the same dtype and device and stores it in S's place (the same source: `L['self'].buf`);
      * their graphs are equal once each scratch table is spelled by what it holds (the same rows of a table that
        the same writer fills, with the same request indices, lengths and token table, and that the same
        consumers read by the same lengths): only where the table's cells live, its width and the writer's row
        stride differ (ScratchForm);
      * the code before the graph is the same; the code after it is the same but for one inserted block that
        stores the new scratch (the graph's last output) in S, and nothing else (_STORE_CODE); the side effects are
        the same attribute stores and that one;
      * nothing runs that the signatures do not hold, and every guard of the other outcome is one of the bound's
        outcome's (its code is what will run, for both).
    Then, for a max that takes the other outcome, the bound's outcome's graph computes what the other outcome's
    computes (each trace's rewrite is proven for its maxima; the allocated-table rule proves the bound's outcome's
    for every max within the bound: a table at least as wide as every row's pages, written by its writer before its
    consumers read it, no further than each row's length), except the scratch: stored anew at the static width
    (the bound's pages), where eager would have kept the narrower one and written the table into it. That is what
    options['static_escapes'] allows: the caller checks it."""
    b, a = first.scratch, second.scratch
    if a is None or b is None or a.regrown or not b.regrown or a.source != b.source or a.cells != b.cells \
            or a.graph != b.graph:
        return False
    if first.uncompared or second.uncompared or first.before != second.before or not second.guards <= first.guards:
        return False
    if first.stores is None or second.stores is None:
        return False
    kept = [w for w, _ in second.stores]
    if b.source in kept or sorted(kept + [b.source]) != [w for w, _ in first.stores]:
        return False
    return _one_store_inserted(second.after.split("\n"), first.after.split("\n"), b.source, b.output)


def _one_store_inserted(other: list, bound: list, source: str, output: int) -> bool:
    """`bound` is `other` with lines inserted (`other` a subsequence of it: the owner may be kept in a local where
    Dynamo rebuilds it, the store made later), and the inserted lines store graph output `output` in the attribute
    named last in `source` (`L['self'].buf`: buf), with nothing but _STORE_CODE, one store, and locals of their
    own. The inserted lines are the same whichever way `other` is found in `bound`."""
    extra, at = [], 0
    for line in bound:
        if at < len(other) and line == other[at]:
            at += 1
        else:
            extra.append(line)
    if at != len(other) or not extra:
        return False
    names = [line.split(" ", 1)[0] for line in extra]
    used = {line.rsplit(" ", 1)[-1] for line in other}  # every name (and constant) the other code spells
    fresh = all(line.rsplit(" ", 1)[-1] not in used for line in extra if line.startswith("STORE_FAST "))
    attribute = repr(source.rsplit(".", 1)[-1])
    return set(names) <= _STORE_CODE and sum(n in _STORING for n in names) == 1 and fresh \
        and f"LOAD_CONST {output}" in extra and "BINARY_SUBSCR" in names \
        and any(line.split(" ", 1)[0] in ("LOAD_CONST", "STORE_ATTR") and line.endswith(" " + attribute)
                for line in extra)

"""What the frame Dynamo is compiling does outside its FX graph, read while the backend runs (issue 45).

Two traces of one frame (a branch on a bounded max traced with each outcome, compile_pass.traced_ranges) are the
same computation only where their FX graphs are the same AND the code Dynamo runs around the graph is the same:
  * before the graph call: what Dynamo builds there and hands the graph as an input (a `torch.nn.Parameter` of an
    input, `_nn_param_via_prefix_insert`, and every other hoisted value: `OutputGraph.pregraph_bytecode`, read
    here as part of `OutputGraph.output_instructions`), and the Python random calls it replays there
    (`OutputGraph.random_calls`: `__gen_rand_values`, with arguments fixed at trace time and held in a closure,
    in no instruction);
  * after the graph call: the attribute stores of its side effects (`self.flag = "even"`), the Python constants it
    returns or hands a resume function, which graph output goes where.
An FX graph holds none of that; Dynamo's residual bytecode does. Dynamo generates the code before the graph call
and the code that follows it (`PyCodegen` `pass2` in `OutputGraph.compile_subgraph`: side effects, then the stack
and live locals rebuilt from the graph's outputs) before it calls the backend, so the backend can read both from
that frame.

Patch-free, but private, dated:
  * 2026-12-04, torch 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0: `OutputGraph.compile_subgraph` holds `reason`
    (a `GraphCompileReason`; `graph_break` False for a return), `pass2` (a `PyCodegen` whose
    `get_instructions()` is the code after the graph call) and `stack_values_flat`; on the fast path (no side
    effects, only distinct tensors on the stack) there is no `pass2` and the graph's outputs are the stack as
    they are. The guards are `OutputGraph.guards` (`Guard.name`, `Guard.create_fn_name()`) and the shape
    environment's `guards` (`ShapeGuard.expr`, its symbols spelled by `var_to_sources`).
  * 2026-12-05, torch 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0: while the backend runs, `OutputGraph
    .output_instructions` is the code before the graph call and nothing else (compile_subgraph adds the frame's
    prefix, `pregraph_bytecode`, the stolen lists' aliases and the random calls' replay, then calls the backend
    from `compile_and_call_fx_graph`, then adds the graph call); `OutputGraph.random_calls` is a list of
    `(fn, args, kwargs)`; `OutputGraph.global_scope` is the frame's globals (where `install_global` puts what the
    code loads); a graph input's source is `OutputGraph.graphargs[i].source`, whose `guard_source` is
    `GuardSource.RANDOM_VALUE` for a random call's value.
  * 2026-12-05, torch 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0: `OutputGraph.side_effects.store_attr_mutations`
    (owner VariableTracker -> attribute -> value VariableTracker; a source without a name raises
    NotImplementedError: TempLocalSource) for FrameResidual.stores; a DUPLICATE_INPUT guard's `create_fn` is a
    partial holding `source_b` (_guard_texts).
Anywhere else `frame_residual()` is None and the caller refuses to call two traces the same (the branch breaks the
graph, as without the backend).
Removed by: a Dynamo API that exposes the code around the graph (or a side-effect summary) to the backend.
"""

from __future__ import annotations

import re
import sys
from typing import Callable, NamedTuple


class FrameResidual(NamedTuple):
    """What the frame Dynamo is compiling runs around its graph, as text, and what it runs under.

    before: the code before the graph call (each instruction: name, argument, jump target), with any frame prefix.
    after: why the graph ends there, then the code after the graph call.
    guards: the guards the compiled code will run under.
    uncompared: what runs around the graph that `before` and `after` do not hold (Python random calls replayed
        before the graph, their arguments in a closure; a graph input that is such a call's value), one line each;
        a trace with any is never the same computation as another.
    stores: the attribute stores among the side effects, as (where: the owner's source and the attribute,
        `L['self'].buf`; the FX node of the graph whose value is stored there, or None for anything else), sorted
        by where; None where they cannot be read. `after` holds them too, as code: this says which is which."""

    before: str
    after: str
    guards: frozenset
    uncompared: tuple
    stores: tuple | None = None


def _compile_subgraph_frame():
    from torch._dynamo.output_graph import OutputGraph

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "compile_subgraph" and isinstance(frame.f_locals.get("self"), OutputGraph):
            return frame
        frame = frame.f_back
    return None


def _not_provided(value) -> bool:
    return type(value).__name__ == "_NotProvided" or (isinstance(value, type) and value.__name__ == "_NotProvided")


def _instructions(instructions: list, spell: Callable[[object], str], global_scope: dict) -> list[str]:
    """Each instruction as text that says everything it does: its name; its numeric argument; its argument value
    by `spell` (a constant of LOAD_CONST: a plain literal by value, any other object by identity); for a global
    it loads, the object the name is bound to now (Dynamo installs globals under names made of counters and
    ids, which two traces may share for different objects); its jump target and exception-table entry by
    position in the list (a jump's argument value does not say where it goes)."""
    position = {id(inst): n for n, inst in enumerate(instructions)}

    def at(inst) -> str:
        return f"#{position[id(inst)]}" if id(inst) in position else "outside"

    lines = []
    for inst in instructions:
        arg, argval = getattr(inst, "arg", None), getattr(inst, "argval", None)
        words = [inst.opname]
        if isinstance(arg, int) and not _not_provided(arg):
            words.append(f"arg={arg}")
        if not _not_provided(argval):
            words.append(spell(argval))
        if inst.opname == "LOAD_GLOBAL" and isinstance(argval, str):
            words.append("= " + (spell(global_scope[argval]) if argval in global_scope else "unbound here"))
        if getattr(inst, "target", None) is not None:
            words.append("-> " + at(inst.target))
        entry = getattr(inst, "exn_tab_entry", None)
        if entry is not None:
            words.append(f"except [{at(entry.start)}, {at(entry.end)}] -> {at(entry.target)} depth={entry.depth} "
                         f"lasti={entry.lasti}")
        lines.append(" ".join(words))
    return lines


def frame_residual(spell: Callable[[object], str]) -> FrameResidual | None:
    """The FrameResidual of the frame Dynamo is compiling now, with each constant and each bound global written by
    `spell` (the caller decides when two objects are the same: compile_pass.traced_ranges writes plain literals by
    value and anything else by identity). `guards`: each of Dynamo's by source and kind, with the counters
    Dynamo appends to global names dropped; each shape guard by expression. Two traces of one call read the same
    values, so the same guard is the same condition. None where it cannot be read: not inside Dynamo's compile
    of a subgraph, a torch whose compile_subgraph or OutputGraph does not hold these, or a graph that ends at a
    graph break (the call of the resume function and what it is handed are generated after the backend
    returns: not readable here, so never compared)."""
    try:
        frame = _compile_subgraph_frame()
        if frame is None:
            return None
        found = frame.f_locals
        reason = found.get("reason")
        if getattr(reason, "graph_break", True):
            return None
        stack = found.get("stack_values_flat")
        if stack is None:
            return None
        output = found["self"]
        global_scope = output.global_scope
        guards = _guard_texts(output.guards)
        shape_env = getattr(output, "shape_env", None)
        guards |= {f"shape {_sourced(g.expr, shape_env)}" for g in getattr(shape_env, "guards", None) or ()}
        before = _instructions(list(output.output_instructions), spell, global_scope)
        after = [f"ends at: {reason.reason!r}", f"stack and locals: {len(stack)}"]
        pass2 = found.get("pass2")
        if pass2 is None:
            if "graph_output_var" in found and found["graph_output_var"] is not None:
                return None  # the general path without its codegen: another torch
            after.append("the graph's outputs, as they are")  # the fast path: no side effects, tensors only
        else:
            after += _instructions(pass2.get_instructions(), spell, global_scope)
        return FrameResidual("\n".join(before), "\n".join(after), frozenset(guards), _uncompared(output),
                             _stores(output))
    except Exception:  # a torch whose locals differ: nothing read
        return None


def _guard_texts(guards) -> set:
    """Each guard as `source kind`, Dynamo's counters in global names dropped. A source Dynamo found to be another
    one (DUPLICATE_INPUT: `G['a'].torch` is `G['b'].torch`, the module reached through two globals) is one object:
    each duplicate guard is spelled by its pair of sources, sorted, and every other guard's source by the least
    source of its class, so that two traces that reached one object by the two paths in another order (their
    guards installed on whichever path came first) spell the same conditions alike. Only this trace's own
    duplicate guards join sources, and each stays among the texts: a set that holds another's texts asserts the
    same identities. `Guard.create_fn` is a partial with `source_b` for DUPLICATE_INPUT: checked on torch 2.11.0,
    2.13.0, 2.15.0, 2026-12-05."""
    def name_of(source) -> str:
        return _COUNTER.sub("___", source.name() if callable(source.name) else source.name)

    parent: dict = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for g in guards:
        other = _duplicate_of(g)
        if other is not None:
            a, b = _COUNTER.sub("___", g.name), name_of(other)
            parent.setdefault(a, a)
            parent.setdefault(b, b)
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    members = sorted(parent, key=len, reverse=True)  # the longest source first: `G['a'].torch.ops` before `.torch`

    def canonical(name: str) -> str:
        for member in members:
            if name == member or name.startswith((member + ".", member + "[")):
                return find(member) + name[len(member):]
        return name

    classes: dict = {}
    for member in parent:
        classes.setdefault(find(member), set()).add(member)
    texts = {" is ".join(sorted(c)) + " DUPLICATE_INPUT" for c in classes.values()}
    for g in guards:
        if _duplicate_of(g) is not None:
            continue
        texts.add(f"{canonical(_COUNTER.sub('___', g.name))} {g.create_fn_name()}")
    return texts


def _duplicate_of(guard):
    """The other source of a DUPLICATE_INPUT guard, or None."""
    if guard.create_fn_name() != "DUPLICATE_INPUT":
        return None
    return getattr(guard.create_fn, "keywords", {}).get("source_b")


def _stores(output) -> tuple | None:
    """FrameResidual.stores: `OutputGraph.side_effects.store_attr_mutations` (the owner's VariableTracker -> the
    attribute -> the value's VariableTracker), each owner by its source, or, for an object the frame made (no
    source, or one with no name: a TempLocalSource), by its place among those (`<made #0>`, in the side effects'
    order); a value by the graph node of its
    proxy where it is a tensor of the graph (`TensorVariable.as_proxy().node`). Checked on torch 2.11.0, 2.13.0,
    2.15.0, 2026-12-05."""
    try:
        found, made = [], 0
        for owner, attributes in output.side_effects.store_attr_mutations.items():
            source = getattr(owner, "source", None)
            try:
                name = None if source is None else source.name() if callable(source.name) else source.name
            except NotImplementedError:  # a source with no name of its own (TempLocalSource): a made object's
                name = None
            if name is None:
                name, made = f"<made #{made}>", made + 1
            for attribute, value in attributes.items():
                node = None
                if type(value).__name__ == "TensorVariable":
                    node = getattr(value.as_proxy(), "node", None)
                found.append((f"{name}.{attribute}", node))
        return tuple(sorted(found, key=lambda pair: pair[0]))
    except Exception:  # noqa: BLE001 -- another torch: not read
        return None


def _uncompared(output) -> tuple:
    """What the frame runs around its graph that its instructions do not hold: Dynamo replays the Python random
    calls it traced in one function called before the graph (`__gen_rand_values`, a fresh closure over
    `random_calls` each trace), whose arguments are fixed at trace time; their values reach the graph as inputs
    whose source is a random value. A graph input without a source is listed too (the signature spells each
    input by its source)."""
    from torch._guards import GuardSource

    lines = []
    if output.random_calls:
        lines.append(f"{len(output.random_calls)} Python random call(s) replayed before the graph with the "
                     f"arguments they were traced with")
    for index, grapharg in enumerate(output.graphargs):
        source = grapharg.source
        if source is None:  # fed by nothing the signature spells (placeholders are spelled by source)
            lines.append(f"the graph input #{index} has no source")
            continue
        kind = source.guard_source() if callable(source.guard_source) else source.guard_source
        if kind == GuardSource.RANDOM_VALUE:
            lines.append(f"the graph input {source.name() if callable(source.name) else source.name} is a random "
                         f"call's value")
    return tuple(lines)


def _sourced(expr, shape_env) -> str:
    """A shape guard with each size symbol spelled by the input it is a size of (`L['q'].size()[0]`, not `s0`):
    two traces may number the same sizes in another order."""
    import sympy

    names = {}
    for symbol in expr.free_symbols:
        sources = shape_env.var_to_sources.get(symbol)
        if sources:
            names[symbol] = sympy.Symbol(sources[0].name() if callable(sources[0].name) else sources[0].name)
    return str(expr.xreplace(names))


_COUNTER = re.compile(r"___\d+")  # Dynamo's `__builtins_dict___2`: a name counter per trace, not a source

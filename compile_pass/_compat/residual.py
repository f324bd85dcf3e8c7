"""What the frame Dynamo is compiling does outside its FX graph, read while the backend runs (issue 45).

Two traces of one frame (a branch on a bounded max traced with each outcome, compile_pass.traced_ranges) are the
same computation only where their FX graphs are the same AND the code Dynamo runs around the graph is the same:
the attribute stores of its side effects (`self.flag = "even"`), the Python constants it returns or hands a
resume function, which graph output goes where. An FX graph does not hold any of that; Dynamo's residual bytecode
does. Dynamo generates the bytecode that follows the graph call (`PyCodegen` `pass2` in
`OutputGraph.compile_subgraph`: side effects, then the stack and live locals rebuilt from the graph's outputs)
before it calls the backend, so the backend can read it from that frame.

Patch-free, but private, dated:
  * 2026-12-04, torch 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0: `OutputGraph.compile_subgraph` holds `reason`
    (a `GraphCompileReason`; `graph_break` False for a return), `pass2` (a `PyCodegen` whose
    `get_instructions()` is the code after the graph call) and `stack_values_flat`; on the fast path (no side
    effects, only distinct tensors on the stack) there is no `pass2` and the graph's outputs are the stack as
    they are. The guards are `OutputGraph.guards` (`Guard.name`, `Guard.create_fn_name()`) and the shape
    environment's `guards` (`ShapeGuard.expr`, its symbols spelled by `var_to_sources`). Anywhere else `frame_residual()` is None and the caller refuses
    to call two traces the same (the branch breaks the graph, as without the backend).
Removed by: a Dynamo API that exposes the residual code (or a side-effect summary) to the backend.
"""

from __future__ import annotations

import re
import sys


def _compile_subgraph_frame():
    from torch._dynamo.output_graph import OutputGraph

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "compile_subgraph" and isinstance(frame.f_locals.get("self"), OutputGraph):
            return frame
        frame = frame.f_back
    return None


def _argument(inst) -> str:
    value = getattr(inst, "argval", None)
    if type(value).__name__ == "_NotProvided" or (isinstance(value, type) and value.__name__ == "_NotProvided"):
        value = getattr(inst, "arg", None)
    return repr(value)


def frame_residual() -> tuple[str, frozenset] | None:
    """(code, guards) of the frame Dynamo is compiling now. `code`: what Dynamo runs after the graph, as text
    (each instruction's name and argument; constants by repr, so an object without a value repr never compares
    equal) with why the graph ends there. `guards`: the guards the compiled code will run under (each of
    Dynamo's by source and kind, with the counters Dynamo appends to global names dropped; each shape guard by
    expression). Two traces of one call read the same values, so the same guard is the same condition. None where
    it cannot be read: not inside Dynamo's compile of a subgraph, a torch whose compile_subgraph does not hold
    these locals, or a graph that ends at a graph break (the call of the resume function and what it is handed
    are generated after the backend returns: not readable here, so never compared)."""
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
        guards = {f"{_COUNTER.sub('___', g.name)} {g.create_fn_name()}" for g in output.guards}
        shape_env = getattr(output, "shape_env", None)
        guards |= {f"shape {_sourced(g.expr, shape_env)}" for g in getattr(shape_env, "guards", None) or ()}
        lines = [f"ends at: {reason.reason!r}", f"stack and locals: {len(stack)}"]
        pass2 = found.get("pass2")
        if pass2 is None:
            if "graph_output_var" in found and found["graph_output_var"] is not None:
                return None  # the general path without its codegen: another torch
            lines.append("the graph's outputs, as they are")  # the fast path: no side effects, tensors only
        else:
            lines += [f"{inst.opname} {_argument(inst)}" for inst in pass2.get_instructions()]
        return "\n".join(lines), frozenset(guards)
    except Exception:  # a torch whose locals differ: nothing read
        return None


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

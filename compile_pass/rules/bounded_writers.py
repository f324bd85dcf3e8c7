"""The allocated-table family's facts: bounded writers (a kernel or op that fills each row of a table up to its
length, and nothing else) and their launches in a graph. Registered with register_bounded_writer; the built-in
ones live next to their kernel (kernels/flashmla_kv_indices.py). Not a rule: the allocated-table rule reads it.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.fx

from .. import _compat
from ..consumers import (INT, TENSOR, FactKind, Param, Signature, argument, bind_arguments, constant, facts_of,
                         load_facts, lookup_facts, overload_name, register_facts, signature_of, unregister_facts)

RULE = "allocated_table"  # the rule whose facts these are (consumers' registry is scoped by rule)


def _positive_int(what: str):
    def check(label: str, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be {what}, got {value!r}")
    return check


# -- facts: bounded writers -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BoundedWriter:
    """A writer of a [rows, n] page table: a user Triton kernel or a torch op. Program (or row) b writes row b's
    first cdiv(max(lengths[b], 0), page_size) columns of `table` and nothing else; every other tensor it receives
    it only reads. Its writes depend on the table only through its data pointer and `table_stride` (the table's
    row stride), never its width. A kernel is launched on a grid (rows of the table, 1, 1), or, with
    `pages_per_program`, (rows, cdiv(width, pages_per_program), 1) with program (b, j) writing only columns
    [j * pages_per_program, (j + 1) * pages_per_program) of row b's first cdiv(lengths[b], page_size): any axis-1
    count that covers the widest row writes the same. An op owns its launch."""

    name: str  # "module:qualname" of the kernel's Python function, or the op's "ns::name.overload"
    table: str = argument(TENSOR)  # the parameter that takes the [rows, n] table (written in place)
    lengths: str = argument(TENSOR)  # the parameter that takes the per-row lengths, in tokens
    page_size: int | str = argument(INT, constant=_positive_int("an int >= 1 or a parameter name"))  # or its parameter
    req_pool_indices: str | None = argument(TENSOR, default=None)  # the request indices (checked like the lengths)
    req_to_token: str | None = argument(TENSOR, default=None)  # the token table it reads
    table_stride: str | None = argument(INT, default=None)  # the parameter that takes table.stride(0), if any
    pages_per_program: int | None = constant(_positive_int("an int >= 1"), default=None)  # a kernel's, grid axis 1
    op: bool = False  # a torch op (its schema says what it writes), not a Triton kernel


def _check(writer: BoundedWriter, signature: Signature) -> None:
    """An op's schema writes its table and nothing else, returns nothing; its launch is its own."""
    if not writer.op:
        return
    written = [name for name, p in signature.params.items() if p.written]
    if written != [writer.table] or signature.returns:
        raise ValueError(f"{writer.name} must write only its table {writer.table!r} and return nothing (its schema "
                         f"writes {written} and returns {signature.returns} values)")
    if writer.pages_per_program is not None:
        raise ValueError("pages_per_program describes a Triton kernel's launch grid; an op owns its launch")


BOUNDED_WRITER = FactKind(RULE, BoundedWriter, "a bounded writer", noun="parameter", check=_check)


def kernel_name(kernel) -> str:
    """`module:qualname` of a @triton.jit kernel (through autotuners/heuristics) or of a Python function."""
    obj, seen = kernel, 0
    while not inspect.isfunction(obj) and hasattr(obj, "fn") and seen < 8:
        obj, seen = obj.fn, seen + 1
    if not inspect.isfunction(obj):
        raise TypeError(f"not a @triton.jit kernel or a function: {type(kernel).__name__}")
    return f"{obj.__module__}:{obj.__qualname__}"


def _key(name: str) -> str:
    return overload_name("triton::" + name)


def _kernel_signature(kernel) -> Signature:
    """A kernel's parameter names (their kinds are not known), or nothing known for a 'module:qualname' string."""
    name = kernel if isinstance(kernel, str) else kernel_name(kernel)
    obj, seen = kernel, 0
    while getattr(obj, "arg_names", None) is None and hasattr(obj, "fn") and seen < 8:
        obj, seen = obj.fn, seen + 1
    names = None if isinstance(kernel, str) else getattr(obj, "arg_names", None)
    return Signature(name, None if names is None else {n: Param(None, None) for n in names}, key=_key(name))


def _is_op(kernel) -> bool:
    """A torch op (OpOverload, packet, custom_op) or its 'ns::name' string; a kernel's string is 'module:qualname'."""
    if isinstance(kernel, str):
        return "::" in kernel
    return isinstance(kernel, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
        or isinstance(getattr(kernel, "_opoverload", None), torch._ops.OpOverload)


def register_bounded_writer(kernel, *, table: str, lengths: str, page_size: int | str,
                            req_pool_indices: str | None = None, req_to_token: str | None = None,
                            table_stride: str | None = None, pages_per_program: int | None = None) -> BoundedWriter:
    """Declare that `kernel` is a bounded writer (BoundedWriter): a @triton.jit kernel (or its `module:qualname`),
    or a torch op (OpOverload, packet, custom_op, or 'ns::name[.overload]'). With the kernel object or an op, the
    names are checked against its parameters; an op's schema must write its `table` and nothing else, and return
    nothing. Registering again replaces."""
    op = _is_op(kernel)
    return register_facts(BOUNDED_WRITER, signature_of(kernel) if op else _kernel_signature(kernel), dict(
        table=table, lengths=lengths, page_size=page_size, req_pool_indices=req_pool_indices,
        req_to_token=req_to_token, table_stride=table_stride, pages_per_program=pages_per_program, op=op))


def unregister_bounded_writer(kernel) -> None:
    unregister_facts(BOUNDED_WRITER, kernel if _is_op(kernel) else _key(kernel if isinstance(kernel, str)
                                                                          else kernel_name(kernel)))


def bounded_writer_of(kernel) -> BoundedWriter | None:
    try:
        name = kernel if isinstance(kernel, str) else kernel_name(kernel)
    except TypeError:
        return None
    return facts_of(BOUNDED_WRITER).get(_key(name))


@dataclasses.dataclass(frozen=True)
class Launch:
    """One call that may write a table: a user Triton kernel's launch, or a call of an op with writer facts."""

    node: torch.fx.Node
    name: str
    facts: BoundedWriter | None  # None: a Triton kernel with no facts
    args: dict  # parameter -> value (a kernel's constants included; an op's defaults included)
    grid: object = None  # a kernel's grid; None for an op


def launch_of(node: torch.fx.Node) -> Launch | None:
    """The launch `node` makes, or None (neither a user Triton kernel nor an op registered as a bounded writer)."""
    found = _compat.user_triton_kernel(node)
    if found is not None:
        kernel, constants = found
        try:
            name = kernel_name(kernel)
        except TypeError:
            name = type(kernel).__name__
        args = {**constants, **dict(node.kwargs.get("kwargs", {}))}
        return Launch(node, name, bounded_writer_of(kernel), args, node.kwargs.get("grid"))
    facts = lookup_facts(BOUNDED_WRITER, node) if node.op == "call_function" else None
    if facts is None:
        return None
    return Launch(node, facts.name, facts, bind_arguments(facts.name, node.args, node.kwargs, defaults=True))


def _builtin_writers() -> dict:
    from ..kernels import flashmla_kv_indices  # it defines a Triton kernel: imported with this rule, not the ops

    return flashmla_kv_indices.BOUNDED_WRITERS


load_facts(_builtin_writers(), register_bounded_writer)

"""Facts about ops: the mechanism that every rule's facts share (Inductor's `inplaceable_ops` idea: a declared
record per kind of fact, one registration path, one check against the op's own schema).

    kind        FactKind(scope, record, what, check): `scope` is the rule or family that reads the facts (the
                registry's namespace); `record` a frozen dataclass whose fields declare which of them name
                arguments of the op (`argument(TENSOR)`, `arguments(INT)`, `argument_dim(TENSOR)`: the kind each
                must have, and whether the op must or must not write it) and which are constants; `check` the
                kind's own rule across fields (Inductor's extra_check)
    schema      one place resolves an op (an overload, a packet, a custom_op, "ns::name[.overload]") to the schema
                of the one overload its facts belong to (schema_of, signature_of) or to every overload of its
                packet (overload_schemas)
    validator   check_record: every named argument exists, has the declared kind (a tensor for a table or lengths,
                an int or SymInt for a bound, a stride or a page size) and is written or not as declared; one
                message format, "<field>=<value> is not ... of <op> (...)"
    registry    register_facts(kind, op, row): the record built from a row (field -> value: a registration
                function's keywords, or a row of a built-in table next to its op in kernels/), checked, stored under
                (scope, overload); load_facts for a table; lookup_facts for a graph node

Facts belong to ONE overload (`ns::op.overload`) and name that overload's own arguments: registering
`torch.ops.mylib.attn.default` says nothing about `torch.ops.mylib.attn.varlen`. A call through the packet
(`torch.ops.mylib.attn(...)`) is resolved to the overload the dispatcher would run; when that is unknown, the
call has no facts (and so keeps the max).

The kinds live with the rules that read them: rules/self_guarding.py (the page-table family's consumers),
rules/bounded_writers.py, rules/flat_buffer.py, rules/indptr_bound.py.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Callable

import torch

from . import _compat

TENSOR = "tensor"
INT = "int"  # an int or a SymInt, optional or not
_KIND_WORDS = {TENSOR: "a tensor", INT: "an int or SymInt"}


class FactTypeError(TypeError, ValueError):
    """A fact's field holds a value of the wrong Python type (a name that is not a string, a string where a tuple
    of names belongs). A TypeError, and a ValueError as the registrations raised for it before one validator."""


# -- declared records ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
    """What a record's field holds. `kind` set: it names arguments of that kind (`shape` "one": a name, "many": a
    tuple of names, "dim": (name, dim)), which the op must (`written` True) or must not (False) write. `constant`:
    the check of a value that is not a name (raises ValueError); with no `kind`, the field is only a constant."""

    kind: str | None
    shape: str = "one"
    written: bool | None = None
    constant: Callable[[str, Any], None] | None = None


def argument(kind: str, *, written: bool | None = None, constant=None, default=dataclasses.MISSING):
    """A field naming one argument of `kind` (or, with `constant`, holding a value that `constant` checks)."""
    return dataclasses.field(default=default, metadata={"fact": Spec(kind, "one", written, constant)})


def arguments(kind: str, *, default=dataclasses.MISSING):
    """A field naming a tuple of arguments of `kind`."""
    return dataclasses.field(default=default, metadata={"fact": Spec(kind, "many")})


def argument_dim(kind: str, *, default=dataclasses.MISSING):
    """A field naming (an argument of `kind`, one of its dims)."""
    return dataclasses.field(default=default, metadata={"fact": Spec(kind, "dim")})


def constant(check: Callable[[str, Any], None], *, default=dataclasses.MISSING):
    """A field holding a constant, checked by `check(field, value)`."""
    return dataclasses.field(default=default, metadata={"fact": Spec(None, constant=check)})


@dataclasses.dataclass(frozen=True)
class FactKind:
    """One kind of fact: its scope in the registry, its record, what one is called, its check across fields."""

    scope: str
    record: type
    what: str  # "a bounded writer": the messages' name for one such fact
    noun: str = "argument"  # what the messages call the op's names ("parameter" where they may be a kernel's)
    check: Callable[[Any, "Signature"], None] | None = None  # (record, signature) -> None; raises ValueError


# -- one schema lookup ----------------------------------------------------------------------------------------------
def overload_name(op: Any) -> str:
    """'ns::op.overload' for an OpOverload; '.default' for a packet, a custom_op or an 'ns::op' string."""
    if isinstance(op, str):
        if "::" not in op:
            raise ValueError(f"op must be named 'namespace::name[.overload]', got {op!r}")
        return op if "." in op.split("::", 1)[1] else op + ".default"
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname or 'default'}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return f"{op._qualified_op_name}.default"
    # torch.library.custom_op returns a CustomOpDef; its ._opoverload is the registered op.
    inner = getattr(op, "_opoverload", None)
    if isinstance(inner, torch._ops.OpOverload):
        return overload_name(inner)
    raise TypeError(
        f"op must be a torch op (torch.ops.ns.name[.overload]), a custom_op or an 'ns::name' string, got "
        f"{type(op).__name__}"
    )


def _packet(name: str):
    namespace, rest = name.split("::", 1)
    return getattr(getattr(torch.ops, namespace), rest.split(".", 1)[0])


def schema_of(op: Any):
    """The schema of the one overload `op` names (a packet, a custom_op or 'ns::name' means `.default`)."""
    name = overload_name(op)
    try:
        return getattr(_packet(name), name.split("::", 1)[1].split(".", 1)[1])._schema
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"op {name!r} is not a registered torch op overload: {e}") from None


def overload_schemas(op: Any) -> list:
    """[('ns::name.overload', schema)] of every overload of `op`'s packet; [] when there is none."""
    name = overload_name(op)
    try:
        packet = _packet(name)
    except (AttributeError, RuntimeError):
        return []
    return [(f"{packet._qualified_op_name}.{o}", s) for o, s in _compat.overload_schemas(packet)]


def schema_argument_names(op: Any) -> list[str]:
    """The argument names of one overload, from its own schema."""
    return [a.name for a in schema_of(op).arguments]


def bind_arguments(name: str, args: tuple, kwargs: dict, *, defaults: bool = False) -> dict[str, Any]:
    """Map a call's positional and keyword arguments to one overload's argument names (with `defaults`, the
    arguments the call leaves out hold their schema defaults)."""
    schema = schema_of(name)
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()} if defaults else {}
    bound.update(zip((a.name for a in schema.arguments), args))
    bound.update(kwargs)
    return bound


@dataclasses.dataclass(frozen=True)
class Param:
    kind: str | None  # TENSOR, INT, another type as the schema spells it; None: not known (a kernel's parameter)
    written: bool | None  # None: not known
    type: str = ""  # as the schema spells it, for the messages


@dataclasses.dataclass(frozen=True)
class Signature:
    """What facts are checked against: an overload's schema, a kernel's parameter names (kinds not known), or
    nothing known (`params` None: a kernel named only by its 'module:qualname')."""

    name: str  # the record's name: 'ns::op.overload', or a kernel's 'module:qualname'
    params: dict | None  # argument name -> Param, in order
    returns: int = 0
    key: str = ""  # the registry key, when it is not the name


def _kind(t) -> str:
    if t.kind() == "OptionalType":
        t = t.getElementType()
    return {"TensorType": TENSOR, "IntType": INT, "SymIntType": INT}.get(t.kind(), str(t))


def _spelled(t) -> str:
    """A schema type as the schema spells it (`Tensor?`, `SymInt`), for the messages."""
    if t.kind() == "OptionalType":
        return _spelled(t.getElementType()) + "?"
    return "SymInt" if t.kind() == "SymIntType" else str(t)


def signature_of(op: Any) -> Signature:
    """The signature of the one overload `op` names, from its schema (ValueError when it is not registered)."""
    schema = schema_of(op)
    params = {a.name: Param(_kind(a.real_type), a.alias_info is not None and a.alias_info.is_write,
                            _spelled(a.real_type))
              for a in schema.arguments}
    return Signature(overload_name(op), params, len(schema.returns))


# -- one validator --------------------------------------------------------------------------------------------------
def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _names(field: str, spec: Spec, value, noun: str) -> list[tuple[str, str]]:
    """(label, argument name) of each name a field's value holds."""
    if spec.shape == "many":
        if isinstance(value, str):
            raise FactTypeError(f"{field} must be a tuple of {noun} names, got the string {value!r}")
        pairs = [(f"{field}[{i}]", v) for i, v in enumerate(value)]
    elif spec.shape == "dim":
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int)):
            raise FactTypeError(f"{field} must be ({_a(noun)} name, a dim), got {value!r}")
        pairs = [(f"{field}[0]", value[0])]
    else:
        pairs = [(field, value)]
    for label, name in pairs:
        if not isinstance(name, str):
            raise FactTypeError(f"{label} must be {_a(noun)} name, got {name!r}")
    return pairs


def _elsewhere(sig: Signature, name: str) -> str:
    others = [o for o, s in overload_schemas(sig.name) if o != sig.name and name in [a.name for a in s.arguments]]
    return f"; facts belong to one overload, and {name!r} is an argument of {', '.join(others)}" if others else ""


def _check_argument(kind: FactKind, sig: Signature, label: str, name: str, spec: Spec) -> None:
    if sig.params is None:
        return
    noun, param = kind.noun, sig.params.get(name)
    if param is None:
        raise ValueError(f"{label}={name!r} is not {_a(noun)} of {sig.name} "
                         f"({noun}s: {list(sig.params)}){_elsewhere(sig, name) if '::' in sig.name else ''}")
    if param.kind is not None and param.kind != spec.kind:
        raise ValueError(f"{label}={name!r} is not {_KIND_WORDS[spec.kind]} {noun} of {sig.name}: its type is "
                         f"{param.type}")
    if spec.written is not None and param.written is not None and param.written != spec.written:
        raise ValueError(f"{label}={name!r} is not written by {sig.name}'s schema (mutates_args must name it)"
                         if spec.written else
                         f"{label}={name!r} is written by {sig.name}'s schema: {kind.what} must not write it")


def check_record(kind: FactKind, record, sig: Signature) -> None:
    """Every field of `record` against `sig` as `kind` declares it, then the kind's own check. Raises ValueError
    (FactTypeError for a value of the wrong Python type)."""
    for field in dataclasses.fields(record):
        spec, value = field.metadata.get("fact"), getattr(record, field.name)
        if spec is None or value is None:
            continue
        if spec.constant is not None and (spec.kind is None or not isinstance(value, str)):
            spec.constant(field.name, value)
            continue
        for label, name in _names(field.name, spec, value, kind.noun):
            _check_argument(kind, sig, label, name, spec)
    if kind.check is not None:
        kind.check(record, sig)


# -- one registry ---------------------------------------------------------------------------------------------------
_REGISTRY: dict[str, dict[str, Any]] = {}  # scope -> overload name -> record
_LATER: dict[str, dict[str, tuple]] = {}  # scope -> overload name -> (register, row): ops that may be defined later
_LOCK = threading.RLock()


def _scope(kind) -> str:
    return kind if isinstance(kind, str) else kind.scope


def register_facts(kind: FactKind, op: Any, row: dict):
    """The one registration path: `kind`'s record for the overload `op` (or a kernel's Signature) from `row`,
    checked against the op's schema, then registered (replacing any); returns the record."""
    sig = op if isinstance(op, Signature) else signature_of(op)
    fields = {f.name: f.metadata.get("fact") for f in dataclasses.fields(kind.record)}
    row = {k: tuple(v) if getattr(fields.get(k), "shape", None) == "many" and v is not None
           and not isinstance(v, (str, tuple)) else v for k, v in row.items()}
    record = kind.record(name=sig.name, **row)
    check_record(kind, record, sig)
    with _LOCK:
        _REGISTRY.setdefault(kind.scope, {})[sig.key or sig.name] = record
    return record


def unregister_facts(kind, op: Any) -> None:
    with _LOCK:
        _REGISTRY.get(_scope(kind), {}).pop(overload_name(op), None)


def facts_of(kind) -> dict[str, Any]:
    """The records of a kind's scope (or of a scope by name), by overload."""
    with _LOCK:
        return dict(_REGISTRY.get(_scope(kind), {}))


def load_facts(table: dict, register, *, later: str | None = None) -> None:
    """Register a table of built-in facts (kept next to their ops in kernels/: op name -> row, the keyword arguments
    of `register`, the kind's own registration function). `later=scope`: the ops are defined elsewhere and may not
    exist yet; each row is registered (and so checked) when a lookup in that scope first meets the op."""
    for name, row in table.items():
        if later is None:
            register(name, **row)
            continue
        with _LOCK:
            _LATER.setdefault(later, {}).setdefault(overload_name(name), (register, row))


def registry_fingerprint() -> str:
    """Part of the post-grad pass's uuid: every rule's facts when the graph was compiled."""
    with _LOCK:
        return repr(sorted((rule, sorted(entries.items())) for rule, entries in _REGISTRY.items()))


def resolved_overload(node: torch.fx.Node):
    """The OpOverload a call_function node runs: itself, or the packet's overload for these arguments."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target
    inner = getattr(target, "_opoverload", None)  # a CustomOpDef called directly
    if isinstance(inner, torch._ops.OpOverload):
        return inner
    if isinstance(target, torch._ops.OpOverloadPacket):
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _compat.example_value)
        return _compat.resolve_packet_call(target, args, kwargs)
    return None


def lookup_facts(kind, node: torch.fx.Node):
    """The record of `kind`'s scope for the overload this node runs, or None."""
    if node.op != "call_function" or not isinstance(
            node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
            and getattr(node.target, "_opoverload", None) is None:
        return None
    overload = resolved_overload(node)
    if overload is None:
        return None
    scope, name = _scope(kind), overload_name(overload)
    with _LOCK:
        later = _LATER.get(scope, {}).pop(name, None) if name not in _REGISTRY.get(scope, {}) else None
    if later is not None:
        register, row = later
        try:  # the op exists now: check the facts against its schema, once
            register(name, **row)
        except (ValueError, TypeError) as e:
            warnings.warn(f"syncfree: the built-in facts for {name} do not fit its schema ({e}); not registered")
    return _REGISTRY.get(scope, {}).get(name)

"""Facts about ops, scoped by the rule that reads them: which ops read no key past their own lengths argument.

Facts belong to ONE overload (`ns::op.overload`) and name that overload's own arguments: registering
`torch.ops.mylib.attn.default` says nothing about `torch.ops.mylib.attn.varlen`. A call through the packet
(`torch.ops.mylib.attn(...)`) is resolved to the overload the dispatcher would run; when that is unknown, the
call has no facts (and so keeps the max).

The page-table rule reads `SelfGuardingConsumer` facts (register them with `register_self_guarding_consumer`);
other rules register their own kinds of facts with `register_facts(rule, op, facts)`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from . import _compat


@dataclasses.dataclass(frozen=True)
class SelfGuardingConsumer:
    """An overload ("ns::op.overload") and the names of its page-table, lengths and upper-bound arguments."""

    name: str
    page_table: str | None
    lengths: str | None
    upper_bounds: tuple[str, ...]
    # (argument, dim) whose size is the op's page size, e.g. ("k_cache", 1): lets a page-level table sliced by a
    # page count `(m + ps - 1) // ps` be proven (the count must use the op's own page size).
    page_size_of: tuple[str, int] | None = None
    # Scheduler metadata computed from the same max (FA3's get_scheduler_metadata): the argument of this op that
    # takes it. Such metadata is only valid for the bound it was computed with, so the rewrite is joint.
    metadata: str | None = None
    # For a producer of such metadata (it reads the lengths and an upper bound, its result steers a consumer's
    # split-KV): the consumers' argument its result may go to. Its upper bounds get the consumers' bound.
    feeds_metadata: str | None = None

    @property
    def overload(self) -> str:
        return self.name.split(".", 1)[1] if "." in self.name else "default"


_REGISTRY: dict[str, dict[str, Any]] = {}  # rule -> overload name -> facts
_PENDING: dict[str, dict] = {}  # overload name -> page-table facts for ops that may be defined later
_LOCK = threading.RLock()
PAGE_TABLE_RULE = "page_table"


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


def _resolve(name: str):
    namespace, rest = name.split("::", 1)
    opname, overload = rest.split(".", 1)
    packet = getattr(getattr(torch.ops, namespace), opname)
    return getattr(packet, overload)


def schema_argument_names(name: str) -> list[str]:
    """The argument names of one overload, from its own schema."""
    return [a.name for a in _resolve(overload_name(name))._schema.arguments]


def register_facts(rule: str, op: Any, facts):
    """`rule`'s facts for the overload `op` (registering again replaces them); returns the facts."""
    with _LOCK:
        _REGISTRY.setdefault(rule, {})[overload_name(op)] = facts
    return facts


def unregister_facts(rule: str, op: Any) -> None:
    with _LOCK:
        _REGISTRY.get(rule, {}).pop(overload_name(op), None)


def facts_of(rule: str) -> dict[str, Any]:
    with _LOCK:
        return dict(_REGISTRY.get(rule, {}))


def register_self_guarding_consumer(
    op: Any,
    *,
    page_table: str | None = None,
    lengths: str | None = None,
    upper_bounds: tuple[str, ...] | list[str] = (),
    page_size_of: tuple[str, int] | None = None,
    metadata: str | None = None,
    feeds_metadata: str | None = None,
) -> SelfGuardingConsumer:
    """Declare that the overload `op` reads at most `lengths[b]` keys of row b through `page_table`, and that the
    arguments named in `upper_bounds` (e.g. max_seqlen_k) accept any value >= the true maximum.

    `op` is one overload (`torch.ops.ns.name.overload`); a packet, a custom_op or 'ns::name' means `.default`.
    The names are checked against that overload's schema. Registering the same overload again replaces it.
    """
    name = overload_name(op)
    try:
        arg_names = schema_argument_names(name)
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"op {name!r} is not a registered torch op overload: {e}") from None
    upper_bounds = tuple(upper_bounds)
    for label, value in (("page_table", page_table), ("lengths", lengths), ("metadata", metadata)):
        if value is not None and value not in arg_names:
            raise ValueError(f"{label}={value!r} is not an argument of {name} (arguments: {arg_names})")
    for value in upper_bounds:
        if value not in arg_names:
            raise ValueError(f"upper_bounds entry {value!r} is not an argument of {name} (arguments: {arg_names})")
    if page_table is not None and lengths is None:
        raise ValueError("a consumer that takes a page_table must name its lengths argument")
    if feeds_metadata is not None and (lengths is None or not upper_bounds):
        raise ValueError("a metadata producer (feeds_metadata) must name its lengths and upper_bounds arguments")
    if page_size_of is not None:
        if not (isinstance(page_size_of, tuple) and len(page_size_of) == 2 and page_size_of[0] in arg_names
                and isinstance(page_size_of[1], int)):
            raise ValueError(f"page_size_of must be (argument of {name}, dim), got {page_size_of!r}")
    entry = SelfGuardingConsumer(name, page_table, lengths, upper_bounds, page_size_of, metadata, feeds_metadata)
    register_facts(PAGE_TABLE_RULE, name, entry)
    return entry


def unregister_self_guarding_consumer(op: Any) -> None:
    unregister_facts(PAGE_TABLE_RULE, op)


def registered_consumers() -> dict[str, SelfGuardingConsumer]:
    return facts_of(PAGE_TABLE_RULE)


def load_facts(table: dict, register) -> None:
    """Register a table of built-in facts (kept next to their ops in kernels/: op name -> the keyword arguments
    of `register`, the rule's own registration function, which checks them against the op's schema)."""
    for name, facts in table.items():
        register(name, **facts)


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


def lookup_facts(rule: str, node: torch.fx.Node):
    """The facts `rule` holds for the overload this node runs, or None."""
    if node.op != "call_function" or not isinstance(
            node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
            and getattr(node.target, "_opoverload", None) is None:
        return None
    overload = resolved_overload(node)
    if overload is None:
        return None
    name = overload_name(overload)
    if rule == PAGE_TABLE_RULE and name in _PENDING and name not in _REGISTRY.get(rule, {}):
        facts = _PENDING.pop(name)
        try:  # the op exists now: check the facts against its schema, once
            register_self_guarding_consumer(name, **facts)
        except (ValueError, TypeError) as e:
            import warnings

            warnings.warn(f"syncfree: the built-in facts for {name} do not fit its schema ({e}); not registered")
    return _REGISTRY.get(rule, {}).get(name)


def lookup_consumer(node: torch.fx.Node) -> SelfGuardingConsumer | None:
    """The page-table rule's facts for the overload a call node runs, or None."""
    return lookup_facts(PAGE_TABLE_RULE, node)


def bind_arguments(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map a call's positional and keyword arguments to one overload's argument names."""
    names = schema_argument_names(name)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def register_builtin_consumers() -> None:
    from . import kernels

    load_facts(kernels.SELF_GUARDING, register_self_guarding_consumer)
    for name, facts in kernels.EXTERNAL_SELF_GUARDING.items():
        with _LOCK:
            _PENDING.setdefault(overload_name(name), facts)
    # torch's varlen attention (torch >= 2.13 takes a block table and seqused_k); max_q/max_k are upper bounds.
    try:
        import torch.nn.attention.varlen  # noqa: F401  (defines the torch_attn ops)
    except ImportError:
        return
    for name in ("torch_attn::_varlen_attn", "torch_attn::_varlen_attn_out"):
        try:
            args = schema_argument_names(name)
        except (AttributeError, RuntimeError):
            continue
        if "block_table" in args and "seqused_k" in args:
            register_self_guarding_consumer(name, page_table="block_table", lengths="seqused_k",
                                            upper_bounds=("max_q", "max_k"))

"""The registry of self-guarding consumers: ops that read no key past their own lengths argument.

The safety rule (docs/design.md) lets the pass hand such an op a static-width page table and a static upper bound
in place of a dynamic max. Register your own attention op with `register_self_guarding_consumer`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class SelfGuardingConsumer:
    """An op name ("ns::op") and the names of its page-table, lengths and upper-bound arguments."""

    name: str
    page_table: str | None
    lengths: str | None
    upper_bounds: tuple[str, ...]
    # (argument, dim) whose size is the op's page size, e.g. ("k_cache", 1): lets a page-level table sliced by a
    # page count `(m + ps - 1) // ps` be proven (the count must use the op's own page size).
    page_size_of: tuple[str, int] | None = None


_REGISTRY: dict[str, SelfGuardingConsumer] = {}
_LOCK = threading.Lock()


def _qualified_name(op: Any) -> str:
    if isinstance(op, str):
        if "::" not in op:
            raise ValueError(f"op must be named 'namespace::name', got {op!r}")
        return op.split(".")[0]
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    # torch.library.custom_op returns a CustomOpDef; its ._opoverload is the registered op.
    inner = getattr(op, "_opoverload", None)
    if isinstance(inner, torch._ops.OpOverload):
        return inner._schema.name
    raise TypeError(
        f"op must be a torch op (torch.ops.ns.name), a custom_op or an 'ns::name' string, got {type(op).__name__}"
    )


def schema_argument_names(name: str) -> list[str]:
    namespace, opname = name.split("::")
    packet = getattr(getattr(torch.ops, namespace), opname)
    return [a.name for a in packet.default._schema.arguments]


def register_self_guarding_consumer(
    op: Any,
    *,
    page_table: str | None = None,
    lengths: str | None = None,
    upper_bounds: tuple[str, ...] | list[str] = (),
    page_size_of: tuple[str, int] | None = None,
) -> SelfGuardingConsumer:
    """Declare that `op` reads at most `lengths[b]` keys of row b through `page_table`, and that the arguments
    named in `upper_bounds` (e.g. max_seqlen_k) accept any value >= the true maximum.

    The op must be registered with torch.library (its schema names the arguments). Registering the same op
    again replaces the entry.
    """
    name = _qualified_name(op)
    try:
        arg_names = schema_argument_names(name)
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"op {name!r} is not a registered torch op: {e}") from None
    upper_bounds = tuple(upper_bounds)
    for label, value in (("page_table", page_table), ("lengths", lengths)):
        if value is not None and value not in arg_names:
            raise ValueError(f"{label}={value!r} is not an argument of {name} (arguments: {arg_names})")
    for value in upper_bounds:
        if value not in arg_names:
            raise ValueError(f"upper_bounds entry {value!r} is not an argument of {name} (arguments: {arg_names})")
    if page_table is not None and lengths is None:
        raise ValueError("a consumer that takes a page_table must name its lengths argument")
    if page_size_of is not None:
        if not (isinstance(page_size_of, tuple) and len(page_size_of) == 2 and page_size_of[0] in arg_names
                and isinstance(page_size_of[1], int)):
            raise ValueError(f"page_size_of must be (argument of {name}, dim), got {page_size_of!r}")
    entry = SelfGuardingConsumer(name, page_table, lengths, upper_bounds, page_size_of)
    with _LOCK:
        _REGISTRY[name] = entry
    return entry


def unregister_self_guarding_consumer(op: Any) -> None:
    with _LOCK:
        _REGISTRY.pop(_qualified_name(op), None)


def lookup_consumer(target: Any) -> SelfGuardingConsumer | None:
    """The registry entry for an FX call_function target, or None."""
    try:
        name = _qualified_name(target)
    except (TypeError, ValueError):
        return None
    return _REGISTRY.get(name)


def registered_consumers() -> dict[str, SelfGuardingConsumer]:
    with _LOCK:
        return dict(_REGISTRY)


def registry_fingerprint() -> str:
    """Part of the post-grad pass's uuid: what the registry held when the graph was compiled."""
    return repr(sorted(registered_consumers().items()))


def bind_arguments(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map a call's positional and keyword arguments to the op schema's argument names."""
    names = schema_argument_names(name)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def register_builtin_consumers() -> None:
    from . import kernels

    for name, facts in kernels.SELF_GUARDING.items():
        register_self_guarding_consumer(name, **facts)
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

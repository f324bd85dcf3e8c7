"""The page-table rule's facts: self-guarding consumers, an overload that reads at most lengths[b] keys of row b
through its page table and whose upper-bound arguments accept any value at or above the true max. The rules that
replace a max (page_table, allocated_table) and their family's module (host_max) read them; not a rule.

The built-in ones live next to their ops (kernels/paged_decode.py, kernels/flash_attn.py); those of ops defined
elsewhere (FA3's sgl_kernel and flash_attn_3 ops, kernels.EXTERNAL_SELF_GUARDING) are checked and registered when
a graph first calls them; torch's varlen attention where this torch has the paged form.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from .. import kernels
from ..consumers import (INT, TENSOR, FactKind, argument, argument_dim, arguments, facts_of, load_facts, lookup_facts,
                         register_facts, schema_argument_names, unregister_facts)

SCOPE = "page_table"  # the rule that reads these facts first


@dataclasses.dataclass(frozen=True)
class SelfGuardingConsumer:
    """An overload ("ns::op.overload") and the names of its page-table, lengths and upper-bound arguments."""

    name: str
    page_table: str | None = argument(TENSOR, default=None)
    lengths: str | None = argument(TENSOR, default=None)
    upper_bounds: tuple[str, ...] = arguments(INT, default=())
    # (argument, dim) whose size is the op's page size, e.g. ("k_cache", 1): lets a page-level table sliced by a
    # page count `(m + ps - 1) // ps` be proven (the count must use the op's own page size).
    page_size_of: tuple[str, int] | None = argument_dim(TENSOR, default=None)
    # Scheduler metadata computed from the same max (FA3's get_scheduler_metadata): the argument of this op that
    # takes it. Such metadata is only valid for the bound it was computed with, so the rewrite is joint.
    metadata: str | None = argument(TENSOR, default=None)
    # For a producer of such metadata (it reads the lengths and an upper bound, its result steers a consumer's
    # split-KV): the consumers' argument its result may go to. Its upper bounds get the consumers' bound.
    feeds_metadata: str | None = None

    @property
    def overload(self) -> str:
        return self.name.split(".", 1)[1] if "." in self.name else "default"


def _check(entry: SelfGuardingConsumer, signature) -> None:
    if entry.page_table is not None and entry.lengths is None:
        raise ValueError("a consumer that takes a page_table must name its lengths argument")
    if entry.feeds_metadata is not None and (entry.lengths is None or not entry.upper_bounds):
        raise ValueError("a metadata producer (feeds_metadata) must name its lengths and upper_bounds arguments")


SELF_GUARDING_CONSUMER = FactKind(SCOPE, SelfGuardingConsumer, "a self-guarding consumer", check=_check)


def register_self_guarding_consumer(
    op,
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
    return register_facts(SELF_GUARDING_CONSUMER, op, dict(
        page_table=page_table, lengths=lengths, upper_bounds=upper_bounds, page_size_of=page_size_of,
        metadata=metadata, feeds_metadata=feeds_metadata))


def unregister_self_guarding_consumer(op) -> None:
    unregister_facts(SELF_GUARDING_CONSUMER, op)


def registered_consumers() -> dict[str, SelfGuardingConsumer]:
    return facts_of(SELF_GUARDING_CONSUMER)


def lookup_consumer(node: torch.fx.Node) -> SelfGuardingConsumer | None:
    """The facts for the overload a call node runs, or None."""
    return lookup_facts(SELF_GUARDING_CONSUMER, node)


def register_builtin_consumers() -> None:
    load_facts(kernels.SELF_GUARDING, register_self_guarding_consumer)
    load_facts(kernels.EXTERNAL_SELF_GUARDING, register_self_guarding_consumer, later=SCOPE)
    # torch's varlen attention (torch >= 2.13 takes a block table and seqused_k); max_q/max_k are upper bounds.
    try:
        import torch.nn.attention.varlen  # noqa: F401  (defines the torch_attn ops)
    except ImportError:
        return
    for name in ("torch_attn::_varlen_attn", "torch_attn::_varlen_attn_out"):
        try:
            args = schema_argument_names(name)
        except ValueError:
            continue
        if "block_table" in args and "seqused_k" in args:
            register_self_guarding_consumer(name, page_table="block_table", lengths="seqused_k",
                                            upper_bounds=("max_q", "max_k"))


register_builtin_consumers()

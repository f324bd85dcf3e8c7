"""The one answer to "what is the static bound of this lengths input?" (issue 42, item 4).

    lengths_bound(options, *names) -> Bound(value, text, declared) | None

`names` are the input's name and, for a CPU mirror, its device twin's. A name in options['length_bounds'] has
that bound (declared=True); any other lengths input has max_context_len (declared=False); no bound at all is None.

The one deliberate difference between callers (tests/test_bounds.py states it): while Dynamo traces
(compile_pass.tracing), the backend ASSUMES a range before any proof, so it gives one only to inputs named as
lengths (`seq_lens`, `seq_lens_cpu`, a `cpu_mirrors` name or a `length_bounds` key): `named_lengths_only=True`.
The rules bound any input whose max reaches a consumer's lengths argument, whatever its name: the consumer's
facts say it is lengths, and max_context_len bounds every length by the contract.
"""

from __future__ import annotations

from typing import NamedTuple

LENGTHS_NAMES = frozenset({"seq_lens", "seq_lens_cpu"})

NO_BOUND = ("options['max_context_len'] is missing, so no static bound exists (pass options={'max_context_len': "
            "N}, or compile_pass.compile(fn, max_context_len=N))")


class Bound(NamedTuple):
    value: int
    text: str  # how it was set, for the report: "max_context_len=4096", "length_bounds['verify_lens']=4"
    declared: bool  # from options['length_bounds'] (else max_context_len)


def lengths_bound(options, *names: str | None, named_lengths_only: bool = False) -> Bound | None:
    """The static bound of a lengths input known by any of `names` (None entries are skipped), from the backend's
    options (a SyncfreeOptions). With `named_lengths_only`, max_context_len applies only to an input named as
    lengths (LENGTHS_NAMES or a cpu_mirrors name); a declared bound always applies."""
    declared = dict(options.rule_option("length_bounds") or ())
    for name in names:
        if name is not None and name in declared:
            return Bound(declared[name], f"length_bounds['{name}']={declared[name]}", True)
    limit = options.max_context_len
    if limit is None:
        return None
    if named_lengths_only:
        mirrors = {n for pair in options.cpu_mirrors for n in pair}
        if not any(n in LENGTHS_NAMES or n in mirrors for n in names if n is not None):
            return None
    return Bound(limit, f"max_context_len={limit}", False)


def require_bound(options) -> int:
    """max_context_len, or the pass's `no_bound` refusal (the start of every max and total rule)."""
    from .proof import Unsafe

    if options.max_context_len is None:
        raise Unsafe("no_bound", NO_BOUND)
    return options.max_context_len

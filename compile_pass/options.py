"""The backend's options: parsed once, validated with errors that name the option."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Options of ours; everything else passes through to Inductor as config patches.
_OURS = {"max_context_len", "page_size", "strict", "cpu_mirrors", "checked", "cudagraphs", "static_escapes"}


@dataclasses.dataclass(frozen=True)
class SyncfreeOptions:
    max_context_len: int | None = None
    page_size: int | None = None
    strict: bool = False
    # attribute name of a CPU mirror -> attribute name of its device twin; "X_cpu" <-> "X" is implied.
    cpu_mirrors: tuple[tuple[str, str], ...] = ()
    # Rewritten page tables assert on the device that no length exceeds the static bound.
    checked: bool = False
    cudagraphs: bool = False
    # Metadata that escapes the step (a page table, its strided column index or the max, stored on a backend
    # object or returned) leaves at the static width / as the static bound: the one semantic change, opt-in.
    static_escapes: bool = False
    inductor: tuple[tuple[str, Any], ...] = ()
    # Options the rules declare (compile_pass.rules: each rule's `options`), normalised by their checks.
    rule_options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "SyncfreeOptions":
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict, got {type(options).__name__}")
        options = dict(options or {})
        mcl = options.get("max_context_len")
        if mcl is not None and (isinstance(mcl, bool) or not isinstance(mcl, int) or mcl < 1):
            raise ValueError(f"options['max_context_len'] must be a positive int, got {mcl!r}")
        ps = options.get("page_size")
        if ps is not None and (isinstance(ps, bool) or not isinstance(ps, int) or ps < 1):
            raise ValueError(f"options['page_size'] must be a positive int or None, got {ps!r}")
        for flag in ("strict", "checked", "cudagraphs", "static_escapes"):
            if not isinstance(options.get(flag, False), bool):
                raise TypeError(f"options['{flag}'] must be a bool, got {options[flag]!r}")
        mirrors = options.get("cpu_mirrors") or {}
        if not isinstance(mirrors, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in mirrors.items()):
            raise TypeError("options['cpu_mirrors'] must map mirror attribute names to device twin names (str -> str)")
        from .rules import declared_options

        declared = declared_options()
        rule_options = {name: option.check(name, options.get(name, option.default))
                        for name, option in declared.items()}
        inductor = {k: v for k, v in options.items() if k not in _OURS and k not in declared}
        return cls(
            max_context_len=mcl,
            page_size=ps,
            strict=options.get("strict", False),
            cpu_mirrors=tuple(sorted(mirrors.items())),
            checked=options.get("checked", False),
            cudagraphs=options.get("cudagraphs", False),
            static_escapes=options.get("static_escapes", False),
            inductor=tuple(sorted(inductor.items())),
            rule_options=tuple(sorted(rule_options.items())),
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cpu_mirrors"] = dict(self.cpu_mirrors)
        d["inductor"] = dict(self.inductor)
        d.pop("rule_options")
        d.update({k: (dict(v) if isinstance(v, tuple) else v) for k, v in self.rule_options})
        return d

    def rule_option(self, name: str):
        """A rule-declared option's normalised value (its declared default when not given)."""
        return dict(self.rule_options).get(name)

    def fingerprint(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, default=repr)

    def config_patches(self) -> dict[str, Any]:
        patches = dict(self.inductor)
        if self.cudagraphs:
            patches["triton.cudagraphs"] = True
        return patches

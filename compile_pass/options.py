"""The backend's options: parsed once, validated with errors that name the option."""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any, get_origin

# Options of ours; every other key must be an Inductor config key and passes through as a config patch.
_OURS = {"max_context_len", "page_size", "strict", "cpu_mirrors", "checked", "cudagraphs", "static_escapes",
         "outline_repeats"}
_FLAGS = ("strict", "checked", "cudagraphs", "static_escapes", "outline_repeats")


class OptionError(TypeError, ValueError):
    """A bad backend option: an unknown key or a value of the wrong type. Both a TypeError and a ValueError, so
    `except TypeError` and `except ValueError` both catch it."""


def _ours() -> set[str]:
    """Our option names: the backend's own, and those the rules declare (compile_pass.rules)."""
    from .rules import declared_options

    return _OURS | set(declared_options())


def _unknown_key_error(key: str, inductor_keys) -> OptionError:
    ours = _ours()
    hint = difflib.get_close_matches(key, sorted(ours | set(inductor_keys)), n=1, cutoff=0.6)
    suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
    return OptionError(f"unknown syncfree option {key!r}{suggestion} (options of the syncfree backend: "
                       f"{', '.join(sorted(ours))}; any other key must be a torch._inductor.config key)")


def _check_keys(options: dict) -> None:
    from . import _compat

    inductor_keys = _compat.inductor_config_keys()
    ours = _ours()
    for key in options:
        if not isinstance(key, str):
            raise OptionError(f"option names must be str, got {key!r}")
        if key not in ours and key not in inductor_keys:
            raise _unknown_key_error(key, inductor_keys)


def _check_inductor_types(patches: dict) -> None:
    """The type check stock `torch.compile(options=...)` makes on every Inductor key: a value that is not an
    instance of the key's declared type raises (a generic type such as `int | None` is not checked, as stock
    does not)."""
    from torch._inductor import config

    get_type = getattr(config, "get_type", None)
    if get_type is None:  # pragma: no cover - every supported torch has it
        return
    for key, value in patches.items():
        try:
            expected = get_type(key)
        except Exception:
            continue
        if get_origin(expected) is not None or not isinstance(expected, type):
            continue
        if not isinstance(value, expected):
            raise OptionError(f"options[{key!r}] (a torch._inductor.config key) must be {expected.__name__}, got "
                              f"{type(value).__name__} {value!r}, as torch.compile(options=...) checks it")


@dataclasses.dataclass(frozen=True)
class SyncfreeOptions:
    max_context_len: int | None = None
    page_size: int | None = None
    strict: bool = False
    # attribute name of a CPU mirror -> attribute name of its device twin; "X_cpu" <-> "X" is implied.
    cpu_mirrors: tuple[tuple[str, str], ...] = ()
    # Rewritten page tables assert on the device that no length exceeds the static bound (no host sync; on by
    # default since 0.2.0: a length past max_context_len would otherwise silently give other numbers).
    checked: bool = True
    cudagraphs: bool = False
    # Metadata that escapes the step (a page table, its strided column index or the max, stored on a backend
    # object or returned) leaves at the static width / as the static bound: the one semantic change, opt-in.
    static_escapes: bool = False
    # The graph's repeated stretches (a whole model's identical layers) are compiled once, as one compiled region
    # called per layer (compile_pass.outline_repeats): start-up time only, the same values. Opt-in.
    outline_repeats: bool = False
    inductor: tuple[tuple[str, Any], ...] = ()
    # Options the rules declare (compile_pass.rules: each rule's `options`), normalised by their checks.
    rule_options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "SyncfreeOptions":
        if options is not None and not isinstance(options, dict):
            raise OptionError(f"options must be a dict, got {type(options).__name__}")
        options = dict(options or {})
        _check_keys(options)
        mcl = options.get("max_context_len")
        if mcl is not None and (isinstance(mcl, bool) or not isinstance(mcl, int) or mcl < 1):
            raise OptionError(f"options['max_context_len'] must be a positive int (or None: no static bound), "
                              f"got {mcl!r}")
        ps = options.get("page_size")
        if ps is not None and (isinstance(ps, bool) or not isinstance(ps, int) or ps < 1):
            raise OptionError(f"options['page_size'] must be a positive int or None, got {ps!r}")
        for flag in _FLAGS:
            if not isinstance(options.get(flag, False), bool):
                raise OptionError(f"options['{flag}'] must be a bool, got {options[flag]!r}")
        mirrors = options.get("cpu_mirrors") or {}
        if not isinstance(mirrors, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in mirrors.items()):
            raise OptionError("options['cpu_mirrors'] must map mirror attribute names to device twin names "
                              f"(str -> str), got {mirrors!r}")
        from .rules import declared_options

        declared = declared_options()
        try:
            rule_options = {name: option.check(name, options.get(name, option.default))
                            for name, option in declared.items()}
        except (TypeError, ValueError) as e:
            raise OptionError(str(e)) from None
        inductor = {k: v for k, v in options.items() if k not in _OURS and k not in declared}
        _check_inductor_types(inductor)
        return cls(
            max_context_len=mcl,
            page_size=ps,
            strict=options.get("strict", False),
            cpu_mirrors=tuple(sorted(mirrors.items())),
            checked=options.get("checked", True),
            cudagraphs=options.get("cudagraphs", False),
            static_escapes=options.get("static_escapes", False),
            outline_repeats=options.get("outline_repeats", False),
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

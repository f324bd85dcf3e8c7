"""Import-time stand-ins for packages SGLang imports at module level but the attention backends never use
(torchvision, aiohttp, IPython, tvm_ffi): a meta-path finder makes `root` and every `root.sub.module` importable;
any attribute of such a module is a placeholder class that raises when instantiated or called.

Submodules listed in `refused` stay unimportable (ImportError), e.g. `torchvision.ops`, so that torch._inductor's
roi_align probe keeps seeing no torchvision. Nothing here is installed into site-packages: `install()` is called
by the harness (tests/sglang/harness.py) only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

PLACEHOLDER_ROOTS = {
    # root: submodules that must stay unimportable
    "torchvision": {"torchvision.ops"},
    "aiohttp": set(),
    "IPython": set(),
    "tvm_ffi": set(),
}


class _PlaceholderType(type):
    """Class attributes of a placeholder are placeholders too (`InterpolationMode.BILINEAR`)."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(cls._qualname, name)


class _Unavailable(metaclass=_PlaceholderType):
    """Base of every placeholder attribute."""

    _qualname = "?"

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"stand-in: {self._qualname} is not available in the SGLang test harness")


def _placeholder(module_name: str, name: str):
    # A class, so it can be subclassed, used in isinstance/annotations and decorated with.
    return type(name, (_Unavailable,), {"_qualname": f"{module_name}.{name}", "__module__": module_name})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__version__ = "0.0.0+stand-in"
        return module

    def exec_module(self, module):
        module.__path__ = []  # a package: submodules resolve through the finder too


class PlaceholderFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        root = fullname.split(".")[0]
        if root not in PLACEHOLDER_ROOTS:
            return None
        if any(fullname == r or fullname.startswith(r + ".") for r in PLACEHOLDER_ROOTS[root]):
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        spec.origin = "tests/sglang/placeholders.py (stand-in)"
        return spec


_FINDER = PlaceholderFinder()


def install(allow_installed: bool = False) -> None:
    """Append the finder. A root installed for real is an error, unless `allow_installed` (the GPU machine has
    torchvision and aiohttp): then the real package is used and only the missing roots get placeholders (the
    finder is after the real finders, so a real package wins anyway)."""
    if _FINDER in sys.meta_path:
        return
    for root in PLACEHOLDER_ROOTS:
        try:
            import importlib.util

            spec = importlib.util.find_spec(root)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin != "tests/sglang/placeholders.py (stand-in)" and not allow_installed:
            raise RuntimeError(f"{root} is installed for real; the SGLang harness expects its stand-in")
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)  # after the real finders: an installed package would win

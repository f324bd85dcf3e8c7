"""Inductor: compile_fx, its config, its compile workers, CUDA-graph static inputs, logging and trace artifacts.

Patches here: none (accessors of Inductor's private config and internals only; each says where it reads).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx

try:  # torch >= 2.6
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - older torch is not supported, but fail clearly
    CustomGraphPass = object  # type: ignore[assignment,misc]

from .regions import region_schema_cache


def compile_fx(gm: torch.fx.GraphModule, example_inputs, config_patches: dict[str, Any]):
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    with region_schema_cache():
        return _compile_fx(gm, example_inputs, config_patches=config_patches)


def warm_compile_workers() -> bool:
    """Start Inductor's compile-worker pool now (what Inductor starts only when its first graph compiles), so that
    it is up when Inductor reaches its kernels: with a fast AOTAutograd it otherwise compiles the first ones in the
    process, one after another (1.8-2.9 s of the regional 8B step's cold call on the H200). False where there is
    no pool to start (compile_threads <= 1, or this torch lacks the calls)."""
    try:
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads
    except ImportError:  # pragma: no cover - every supported torch has them
        return False
    if get_compile_threads() <= 1 or not all(hasattr(AsyncCompile, m) for m in ("warm_pool", "wakeup")):
        return False
    AsyncCompile.warm_pool()
    AsyncCompile.wakeup()
    return True


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_triton_cache_dir(device: int) -> str:
    """Where Inductor points TRITON_CACHE_DIR (when unset) as it builds its first kernel launcher in a process:
    TRITON_CACHE_DIR itself where set, else <Inductor's cache dir>/triton/<device>."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    return triton_cache_dir(device)


def inductor_config_value(name: str):
    from torch._inductor import config

    return getattr(config, name, None)


def inductor_config_fingerprint() -> str:
    """Inductor's global config, as text (every key, machine-dependent ones such as compile_threads included)."""
    from torch._inductor import config

    return repr(sorted((k, repr(v)) for k, v in config.get_config_copy().items()))


# -- static inputs of a CUDA graph (the persistent scratch of the allocated-table rule) ----------------------
# AOT autograd takes a Dynamo graph's static inputs from its placeholders: those whose
# node.meta["tensor_dict"]["_dynamo_static_input_type"] is set (what torch._dynamo.mark_static_address records on a
# tensor, copied to its placeholder by Dynamo; torch 2.11 _functorch/_aot_autograd/frontend_utils.py:200,
# _dynamo/utils.py:5048). Inductor hands them to CUDA graph trees as static_input_idxs: not copied into the graph's
# own buffers, so an in-place write lands in the caller's tensor, as in eager; a new address re-records
# (cudagraph_trees.py:876, :1780) where rerecord_if_static_inputs_change holds. Tested in tests/test_compat.py.
_STATIC_KEY = "_dynamo_static_input_type"


def static_inputs_rerecord() -> bool:
    """Do CUDA graph trees re-record a graph when a static input's address changes (rather than fail)? torch 2.11:
    `inline_inbuilt_nn_modules or triton.cudagraph_support_input_mutation` (cudagraph_trees.py:876); later torch
    always re-records (2.13: the Dynamo flag is deprecated, always True; a torch without the flag: True)."""
    import warnings

    import torch._dynamo.config
    from torch._inductor import config

    if getattr(config.triton, "cudagraph_support_input_mutation", False):
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13: "inline_inbuilt_nn_modules is deprecated"
        return bool(getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", True))


def is_static_placeholder(node: torch.fx.Node) -> bool:
    """Will AOT autograd count this Dynamo placeholder as a static input (mark_static_address, or marked here)?"""
    return bool((node.meta.get("tensor_dict") or {}).get(_STATIC_KEY))


def mark_static_placeholder(node: torch.fx.Node) -> bool:
    """Make a Dynamo graph's placeholder a static input ('unguarded', as mark_static_address(t) makes a tensor:
    a new address re-records, no recompile). The tensor itself is not touched. The dict is replaced, not edited:
    a copied graph's node shares it with Dynamo's own. False when it was static already."""
    if node.op != "placeholder" or is_static_placeholder(node):
        return False
    node.meta["tensor_dict"] = {**(node.meta.get("tensor_dict") or {}), _STATIC_KEY: "unguarded"}
    return True


def unmark_static_placeholder(node: torch.fx.Node) -> None:
    """Undo mark_static_placeholder."""
    found = dict(node.meta.get("tensor_dict") or {})
    found.pop(_STATIC_KEY, None)
    node.meta["tensor_dict"] = found


def input_alignment() -> int:
    """The alignment (bytes) Inductor's kernels assume of a GPU input whose example is aligned; a static input is
    not checked again at run time (torch 2.11 compile_fx.py:1821, utils.py:3296 tensor_is_aligned)."""
    try:
        from torch._inductor.utils import GPU_ALIGN_BYTES
    except ImportError:  # pragma: no cover
        return 16
    return int(GPU_ALIGN_BYTES)


def statically_aligned(t) -> bool:
    """Is a (fake) tensor's storage offset known, without a guard, to keep it aligned as Inductor assumes?"""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true((t.storage_offset() * t.element_size()) % input_alignment() == 0))
    except Exception:
        return False


_TORCH_LOGGERS = ("torch", "torch._inductor", "torch._dynamo", "torch._inductor.cudagraph_utils")


class CudagraphSkips:
    """Collects Inductor's 'skipping cudagraphs due to ...' messages (TORCH_LOGS=cudagraphs) while active."""

    def __init__(self):
        import logging

        self.messages: list[str] = []
        outer = self

        class _Handler(logging.Handler):
            def emit(self, record):
                text = record.getMessage()
                if "cudagraph" in text.lower():
                    outer.messages.append(text[:300])

        self.handler = _Handler()

    def __enter__(self):
        import logging

        torch._logging.set_logs(cudagraphs=True)  # Inductor logs its skip reasons under this artifact
        for name in _TORCH_LOGGERS:  # torch's loggers do not propagate to "torch"
            logging.getLogger(name).addHandler(self.handler)
        return self

    def partitions(self) -> list[str]:
        """Inductor's "Created N graph partitions: ..." lines (logged when it compiles, not on a cache hit)."""
        import re

        return [m.group(0) for text in self.messages
                for m in [re.search(r"Created \d+ graph partitions?: [^\n]*", text)] if m]

    def __exit__(self, *exc):
        import logging

        for name in _TORCH_LOGGERS:
            logging.getLogger(name).removeHandler(self.handler)
        torch._logging.set_logs()
        return False


def inductor_config_keys() -> frozenset[str]:
    """Every key torch._inductor.config accepts as a patch ("max_autotune", "triton.cudagraphs", ...)."""
    from torch._inductor import config

    return frozenset(config.get_config_copy())


def register_torch_log(setting_name: str, logger_name: str) -> bool:
    """Let TORCH_LOGS / torch._logging.set_logs control `logger_name` under `setting_name`. False when this torch
    has no registry to add to (the logger then still works through TORCH_LOGS=<module name>)."""
    try:
        from torch._logging._internal import register_log
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    register_log(setting_name, logger_name)
    return True


def trace_artifact(name: str, payload_fn) -> None:
    """A structured-trace artifact (TORCH_TRACE, tlparse) of JSON `payload_fn()`; a no-op when tracing is off."""
    torch._logging.trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "json"},
                                    payload_fn=payload_fn)


@contextlib.contextmanager
def no_compile_caches():
    """Inductor's FX graph cache and AOT autograd's cache off: every compile generates its code (syncfree-inspect
    counts host reads in the code of this run, the same way on both sides)."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config

    aot = {"enable_autograd_cache": False} if hasattr(functorch_config, "enable_autograd_cache") else {}
    with config.patch(fx_graph_cache=False), functorch_config.patch(**aot):
        yield

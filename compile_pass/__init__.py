"""torch-syncfree: a torch.compile backend that removes host syncs from LLM decode graphs.

    import compile_pass
    step = compile_pass.compile(decode_step, max_context_len=4096)
    torch.compile(decode_step, backend="syncfree", options={"max_context_len": 4096})   # no import needed
    print(compile_pass.last_report())
"""

import sys as _sys


def _imported_by_torch_autoload() -> bool:
    """Is torch importing this package as a device-backend plugin (entry point `torch.backends`), mid-way
    through its own `import torch`?"""
    frame = _sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_import_device_backends" and frame.f_globals.get("__name__") == "torch":
            return True
        frame = frame.f_back
    return False


_LIGHT = _imported_by_torch_autoload()


def _torch_autoload() -> None:
    """Entry point `torch.backends`: torch calls it while it is imported, before it parses TORCH_LOGS, so that
    TORCH_LOGS=syncfree is a setting it knows. It registers the log name and nothing else (no ops, no
    kernels: `import torch` stays as fast); the next `import compile_pass` imports the package for real."""
    try:
        from torch._logging._internal import register_log

        register_log("syncfree", "compile_pass")
    except Exception:  # never break `import torch`
        pass
    finally:
        if _LIGHT:
            for name in [m for m in _sys.modules if m == __name__ or m.startswith(__name__ + ".")]:
                del _sys.modules[name]


if not _LIGHT:
    from . import kernels  # noqa: F401  (registers the torch.ops.syncfree ops)
    from . import cache  # noqa: F401  (compile_pass.cache: start-up caches to build once and ship)
    from .backend import compile, syncfree_backend
    from .rules.self_guarding import (
        SelfGuardingConsumer,
        register_self_guarding_consumer,
        registered_consumers,
        unregister_self_guarding_consumer,
    )
    from .rules.bounded_writers import register_bounded_writer, unregister_bounded_writer
    from .rules.flat_kv_indices import register_indptr_reader, register_indptr_writer, unregister_flat_kv_facts
    from .rules.indptr_bound import register_indptr_bound_consumer, unregister_indptr_bound_consumer
    from .report import SyncItem, SyncRemainsError, SyncReport, last_report, reports
    from .traceable import register_disabled_launcher, registered_launchers, unregister_disabled_launcher

    from .log import register_with_torch as _register_log
    from ._triton_cache import install as _record_triton_compiles

    _register_log()  # TORCH_LOGS=syncfree, torch._logging.set_logs(modules={"syncfree": logging.INFO})
    # Triton's compiles and cache hits of this package's kernels, for compile_pass.cache to ship their binaries
    # (before any of them can launch: they are defined in this package).
    _record_triton_compiles()

__all__ = [
    "compile",
    "last_report",
    "reports",
    "register_self_guarding_consumer",
    "unregister_self_guarding_consumer",
    "registered_consumers",
    "register_indptr_bound_consumer",
    "unregister_indptr_bound_consumer",
    "register_indptr_reader",
    "register_indptr_writer",
    "unregister_flat_kv_facts",
    "register_bounded_writer",
    "unregister_bounded_writer",
    "register_disabled_launcher",
    "unregister_disabled_launcher",
    "registered_launchers",
    "SelfGuardingConsumer",
    "SyncItem",
    "SyncRemainsError",
    "SyncReport",
    "syncfree_backend",
]

"""torch-syncfree: a torch.compile backend that removes host syncs from LLM decode graphs.

    import compile_pass
    step = compile_pass.compile(decode_step, max_context_len=4096)
    torch.compile(decode_step, backend="syncfree", options={"max_context_len": 4096})   # no import needed
    print(compile_pass.last_report())
"""

from . import kernels  # noqa: F401  (registers the torch.ops.syncfree ops)
from .backend import compile, syncfree_backend
from .consumers import (
    SelfGuardingConsumer,
    register_builtin_consumers,
    register_self_guarding_consumer,
    registered_consumers,
    unregister_self_guarding_consumer,
)
from .report import SyncItem, SyncRemainsError, SyncReport, last_report, reports

register_builtin_consumers()

__all__ = [
    "compile",
    "last_report",
    "reports",
    "register_self_guarding_consumer",
    "unregister_self_guarding_consumer",
    "registered_consumers",
    "SelfGuardingConsumer",
    "SyncItem",
    "SyncRemainsError",
    "SyncReport",
    "syncfree_backend",
]

"""Reading torch's private state: FX node meta, fake tensors and modes, symbols, schemas, Dynamo's counters.

Patches here: none (read-only accessors; each names what it reads).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.fx


def placeholder_source_name(node: torch.fx.Node) -> str | None:
    """Dynamo's record of where a graph input came from, e.g. "L['forward_batch'].seq_lens_cpu"."""
    grapharg = node.meta.get("grapharg")  # present while the backend runs; Dynamo drops it afterwards
    source = getattr(grapharg, "source", None) or getattr(node, "_dynamo_source", None)
    if source is None:
        return None
    try:
        return source.name() if callable(source.name) else source.name
    except Exception:
        return None


def example_value(node: Any):
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def storage_id(t: torch.Tensor):
    """An identity of the memory behind a (fake) tensor: views and aliases share it; None when unknown."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(t.untyped_storage()).cdata
    except Exception:
        return None


def fake_mode_of(nodes) -> Any:
    """The FakeTensorMode the Dynamo graph was traced with (from any node's example value)."""
    for node in nodes:
        value = example_value(node)
        mode = getattr(value, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def fresh_fake_mode():
    """A FakeTensorMode of its own (no shape environment, no dispatch cache): for work on fake tensors in another
    thread than the compile's, which must not share the compile's mode or its caches (compile_pass.kernel_warmup)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    mode.cache_enabled = False  # the dispatch cache is shared by every mode, and this mode runs in another thread
    return mode


@contextlib.contextmanager
def capture_scalar_outputs():
    """Dynamo reads this flag at trace time, i.e. at the first call, not at torch.compile()."""
    import torch._dynamo

    old = torch._dynamo.config.capture_scalar_outputs
    torch._dynamo.config.capture_scalar_outputs = True
    try:
        yield
    finally:
        torch._dynamo.config.capture_scalar_outputs = old


def capture_scalar_outputs_enabled() -> bool:
    import torch._dynamo

    return bool(torch._dynamo.config.capture_scalar_outputs)


def graph_counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return counters


def known_equal(a, b) -> bool:
    """Are two ints / SymInts equal for every value of their symbols (no guard added)? False when unknown."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001  (an expression it cannot decide)
        return False


def known_at_least(a, k: int) -> bool:
    """Is the int / SymInt `a` at least `k` for every value its symbols may take in this trace (its guards
    included; no guard added)? False when unknown."""
    if isinstance(a, int):
        return a >= k
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a >= k))
    except Exception:  # noqa: BLE001  (an expression it cannot decide)
        return False


def free_unbacked_symbols(value) -> set:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols as _free

    return _free(value)


def run_and_get_code(fn, *args, **kwargs):
    """(fn(*args), Inductor wrapper code of what compiles during the call).

    Unlike torch._inductor.utils.run_and_get_code this does not reset Dynamo, so other compiled functions
    keep their caches (a reset would make them compile again and look like recompiles).
    """
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", lambda code: codes.append(code)):
        result = fn(*args, **kwargs)
    return result, codes


def dynamo_cache_entries(code) -> int:
    """How many compiled entries Dynamo holds for a code object (tests: a check must not add any to yours)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def mark_static_address(t: torch.Tensor) -> None:
    """A persistent buffer (KV pool, req_to_token): CUDA graphs may keep its address and let the graph mutate it."""
    import torch._dynamo

    torch._dynamo.mark_static_address(t)


def copy_dynamo_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a Dynamo graph that AOT autograd still recognises as Dynamo's.

    AOT reads `gm.meta["dynamo_compile_id"]`, `gm._param_name_to_source` and each placeholder's
    `_dynamo_source` to find static inputs (parameters, buffers, mark_static_address tensors); without them a
    CUDA graph would refuse to let the step write its KV pool ("skipping cudagraphs due to mutated inputs").
    """
    graph = torch.fx.Graph()
    value_map: dict = {}
    out = graph.graph_copy(gm.graph, value_map)
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    for old_node, new_node in value_map.items():
        if hasattr(old_node, "_dynamo_source"):
            new_node._dynamo_source = old_node._dynamo_source
    return new


def overload_schemas(packet) -> list:
    """[(overload name, schema)] of an OpOverloadPacket: every overload a call of the packet may resolve to."""
    found = []
    for name in packet.overloads():
        try:
            found.append((name, getattr(packet, name)._schema))
        except (AttributeError, RuntimeError):
            continue
    return found


def resolve_packet_call(packet, args, kwargs):
    """The OpOverload that `packet(*args, **kwargs)` runs (the dispatcher's own choice), or None when unknown."""
    names = packet.overloads()
    if names == ["default"]:
        return packet.default
    try:
        name = torch._C._jit_resolve_packet(packet._qualified_op_name, *args, **kwargs)
    except Exception:
        return None
    return getattr(packet, name or "default", None)


def _graph_break_record(r) -> tuple[str, str]:
    stack = getattr(r, "user_stack", None) or []
    where = f"{stack[-1].filename.rsplit('/', 1)[-1]}:{stack[-1].lineno}" if stack else "<unknown>"
    return str(getattr(r, "reason", r)), where


def graph_break_reasons() -> list[tuple[str, str]]:
    """[(reason, 'file.py:LINE' of the user's code)] of every graph break Dynamo recorded in this process."""
    try:
        from torch._dynamo.utils import graph_break_reasons as reasons
    except ImportError:
        return []
    return [_graph_break_record(r) for r in list(reasons)]


_SEEN_MARK = "_syncfree_seen"


def unseen_graph_break_reasons() -> list[tuple[str, str]]:
    """The graph breaks Dynamo recorded that no earlier call returned, as graph_break_reasons gives them. Each is
    marked on Dynamo's record (a GraphCompileReason) when returned, so a break recorded after
    torch._dynamo.reset() is new even where its text and line are those of one seen before."""
    try:
        from torch._dynamo.utils import graph_break_reasons as reasons
    except ImportError:
        return []
    found = []
    for r in list(reasons):
        if getattr(r, _SEEN_MARK, False):
            continue
        try:
            setattr(r, _SEEN_MARK, True)
        except (AttributeError, TypeError):  # a record that takes no attribute: returned each time
            pass
        found.append(_graph_break_record(r))
    return found


def graph_break_count() -> int:
    """How many graph breaks Dynamo recorded in this process: len(graph_break_reasons()), without formatting them
    (once per call of a compiled step: discard_graph_breaks takes it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    reasons = getattr(utils, "graph_break_reasons", None)
    return len(reasons) if reasons is not None else 0


def invoke_subgraph_op():
    """The higher-order op a `torch.compiler.nested_compile_region` call becomes in a Dynamo graph (or None)."""
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)

def user_triton_kernel(node: torch.fx.Node):
    """(kernel, constant args) of a `triton_kernel_wrapper_mutation` node: the user's @triton.jit kernel (or its
    autotuner) that the node launches, from torch's kernel side table, and the arguments Dynamo kept there
    (constexprs, None, non-tensor constants) by parameter name. None for any other node, or where the table does
    not hold the node's entries (torch._dynamo.reset() empties it from torch 2.12 on). Private API, dated: checked
    on torch 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0 (2026-12-05: `kernel_side_table.get_kernel` /
    `get_constant_args` by the node's kwargs `kernel_idx` / `constant_args_idx`; tests/test_hook_versions.py);
    removed when the higher-order op carries its kernel and constants itself."""
    hop = getattr(torch.ops.higher_order, "triton_kernel_wrapper_mutation", None)
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or hop is None or node.target is not hop:
        return None
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    try:
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        constants = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
    except (AssertionError, KeyError):
        return None
    return kernel, dict(constants)


@contextlib.contextmanager
def no_guard_profiling():
    """While inside, Dynamo does not time each guard manager it builds (torch._dynamo.guards.profile_guard_manager,
    whose result only feeds a debug log): the generated trace-time suites compile a thousand small frames, where
    it is a fifth of the CPU time. A test-speed patch, dated: checked on torch 2.11.0, 2.12.1, 2.13.0, 2.14.1 and
    2.15.0 (2026-12-04: each imports the function into torch._dynamo.guards and calls it by that name there;
    tests/test_hook_versions.py); a no-op on a torch without the function; removed when Dynamo profiles guards only
    under its debug logging."""
    import torch._dynamo.guards as guards

    profile = getattr(guards, "profile_guard_manager", None)
    if profile is not None:
        guards.profile_guard_manager = lambda *args, **kwargs: 0.0
    try:
        yield
    finally:
        if profile is not None:
            guards.profile_guard_manager = profile

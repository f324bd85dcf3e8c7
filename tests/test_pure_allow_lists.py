"""The default-deny write analysis trusts short allow-lists (compile_pass.mutations): each entry is tested here to
write nothing, on real tensors, by the version counter every in-place write bumps (through any view)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

from compile_pass import mutations


def _fresh():
    return torch.arange(1, 7, dtype=torch.float32).reshape(2, 3)


def _call_method(name, t):
    """Call `t.<name>` with a plausible argument; None when the method needs arguments this test has not got."""
    method = getattr(t, name)
    for args in ((), (2,), (t,)):
        try:
            return method(*args)
        except (TypeError, RuntimeError, ValueError, IndexError):
            continue
    return None


@pytest.mark.parametrize("name", sorted(mutations.PURE_METHODS))
def test_pure_method_writes_nothing(name):
    t = _fresh()
    before, version = t.clone(), t._version
    if name in ("cuda",) and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not hasattr(t, name):
        pytest.skip(f"torch.Tensor has no {name} on this torch")
    _call_method(name, t)
    assert t._version == version and torch.equal(t, before), name


@pytest.mark.parametrize("op", sorted(mutations.PURE_OPERATORS, key=lambda f: f.__name__), ids=lambda f: f.__name__)
def test_pure_operator_writes_nothing(op):
    t = _fresh()
    version = t._version
    for args in ((t, 2), (t, t), (t,), (t, 0)):
        try:
            op(*args)
            break
        except (TypeError, RuntimeError, ValueError, IndexError):
            continue
    assert t._version == version, op.__name__


@pytest.mark.parametrize("fn", list(mutations.PURE_FUNCTIONS), ids=lambda f: f.__name__)
def test_pure_function_writes_nothing_and_its_check_sees_inplace(fn):
    t = _fresh()
    version = t._version
    for args in ((t,), (t, -1), ("ij->ji", t), (t, 1), (t, (1, 0))):
        try:
            fn(*args)
            break
        except (TypeError, RuntimeError, ValueError, IndexError):
            continue
    assert t._version == version, fn.__name__
    # The entry's check turns the function impure where an argument asks for a write.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(fn, (x,), {"inplace": True})
    if fn in (torch.nn.functional.silu, torch.nn.functional.relu, torch.nn.functional.dropout):
        assert mutations.written_by(node) == [x]
        assert fn(t.clone(), inplace=True) is not None  # and eager does take the flag


def test_embedding_with_max_norm_is_a_write():
    weight = torch.randn(5, 3)
    version = weight._version
    torch.nn.functional.embedding(torch.tensor([0, 1]), weight, max_norm=0.1)
    assert weight._version != version  # what the allow-list's check is for
    graph = torch.fx.Graph()
    idx, w = graph.placeholder("idx"), graph.placeholder("w")
    node = graph.call_function(torch.nn.functional.embedding, (idx, w), {"max_norm": 0.1})
    assert set(mutations.written_by(node)) == {idx, w}
    pure = graph.call_function(torch.nn.functional.embedding, (idx, w), {})
    assert mutations.written_by(pure) == []


def test_numpy_reads_only():
    assert mutations.PURE_NUMPY == frozenset({"max", "amax", "min", "amin", "item"})
    import numpy as np

    a = _fresh().numpy()
    copy = a.copy()
    for name in mutations.PURE_NUMPY - {"item"}:
        getattr(np, name)(a)
    a.item(0)
    assert (a == copy).all()


def test_inplace_operators_are_writes():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for op in (operator.iadd, operator.setitem, operator.ixor):
        assert mutations.written_by(graph.call_function(op, (x, 1, 2) if op is operator.setitem else (x, 1))) == [x]

"""compile_pass.compile starts Inductor's compile workers at once on a GPU machine (issue 29), and only there."""

import torch

import compile_pass
from compile_pass import _compat, backend


def _count_warmups(monkeypatch, cuda: bool):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(_compat, "warm_compile_workers", lambda: calls.append(1) or True)
    return calls


def test_compile_starts_the_workers_on_a_gpu_machine(monkeypatch):
    calls = _count_warmups(monkeypatch, cuda=True)
    compile_pass.compile(lambda x: x + 1, max_context_len=64)
    assert calls == [1]


def test_no_workers_started_without_a_gpu_or_when_turned_off(monkeypatch):
    calls = _count_warmups(monkeypatch, cuda=False)
    compile_pass.compile(lambda x: x + 1, max_context_len=64)
    assert calls == []
    calls = _count_warmups(monkeypatch, cuda=True)
    monkeypatch.setenv("SYNCFREE_PREWARM_WORKERS", "0")
    compile_pass.compile(lambda x: x + 1, max_context_len=64)
    assert calls == []


def test_a_pool_that_cannot_start_is_left_to_inductor(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken():
        raise RuntimeError("no pool here")

    monkeypatch.setattr(_compat, "warm_compile_workers", broken)
    assert backend.warm_compile_workers() is False
    compile_pass.compile(lambda x: x * 2, max_context_len=64)  # does not raise

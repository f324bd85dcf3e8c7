"""pytest plugin (entry point `pytest11`): the `syncfree` fixture and `--syncfree-report PATH`.

    def test_decode_step(syncfree):
        syncfree(decode_step, batch, k_pool, v_pool, max_context_len=32768)   # compile_pass.testing.assert_sync_free

`pytest --syncfree-report syncfree.json` writes every step checked through the fixture (test id, outcome and the
merged report of its graphs) as JSON, for CI artifacts; a check that failed is written too, with its whole message
(`error`). Each item's `stack` holds the user's frames only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

_RESULTS_KEY = pytest.StashKey[list]()


def pytest_addoption(parser):
    group = parser.getgroup("syncfree", "torch-syncfree: sync-free compiled decode steps")
    group.addoption("--syncfree-report", metavar="PATH", default=None,
                    help="write the report of every step checked through the `syncfree` fixture to PATH (JSON)")


def pytest_configure(config):
    config.stash[_RESULTS_KEY] = []
    config.addinivalue_line("markers", "syncfree: a test that checks a compiled step with the syncfree fixture")


@pytest.fixture
def syncfree(request):
    """Call it like compile_pass.testing.assert_sync_free; it records each check for --syncfree-report."""
    from compile_pass.testing import SyncCheckFailed, assert_sync_free

    results = request.config.stash[_RESULTS_KEY]

    def check(fn, *args, **kwargs):
        __tracebackhide__ = True  # a failure shows the report, not the plugin's source
        entry = {"test": request.node.nodeid, "function": getattr(fn, "__qualname__", repr(fn))}
        try:
            result = assert_sync_free(fn, *args, **kwargs)
        except SyncCheckFailed as e:
            # The whole message (what failed and the report's table), as pytest shows it.
            results.append({**entry, "sync_free": False, "error": str(e), **e.result.to_dict()})
            raise
        results.append({**entry, "sync_free": True, **result.to_dict()})
        return result

    return check


def pytest_sessionfinish(session):
    path = session.config.getoption("--syncfree-report")
    if path:
        Path(path).write_text(json.dumps(session.config.stash[_RESULTS_KEY], indent=2, default=str))

"""tests/sglang: SGLang 0.5.23's own FlashAttentionBackend on CPU (see harness.py). Skips, saying why, where the
SGLang packages are not installed (`make sglang-deps`)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import harness  # noqa: E402

_WHY = harness.sglang_available()


def pytest_collection_modifyitems(config, items):
    """Run these tests last (importing SGLang and its placeholders then lasts for the rest of the session, so
    nothing else runs after it), and skip them where SGLang is not installed."""
    here = pathlib.Path(__file__).resolve().parent
    ours = [i for i in items if here in pathlib.Path(str(i.fspath)).resolve().parents]
    items[:] = [i for i in items if i not in ours] + ours
    if _WHY is not None:
        skip = pytest.mark.skip(reason=_WHY)
        for item in ours:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sglang_fa3():
    modules = harness.setup()
    entry = harness.register_fwd_consumer()
    yield modules
    import compile_pass

    compile_pass.unregister_self_guarding_consumer(entry.name)

"""tests/sglang: SGLang 0.5.23's own FlashAttentionBackend on CPU (see harness.py). Skips, saying why, where the
SGLang packages are not installed (`make sglang-deps`)."""

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import harness  # noqa: E402

_WHY = harness.sglang_available()
if _WHY is not None and os.environ.get("CI"):
    # `make test` installs the SGLang packages before it runs pytest: in CI, their absence is a failure, not a skip
    raise RuntimeError(f"tests/sglang cannot run in CI: {_WHY}")


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
    # The FA3 facts (sgl_kernel::fwd, sgl_kernel::get_scheduler_metadata) are built in (kernels/flash_attn.py):
    # they register when the ops first appear in a graph.
    yield harness.setup()

pytest_plugins = ["pytester"]

import os
import pathlib
import sys

# One Inductor cache and TMPDIR for the whole run (the first CPU compile is the expensive one).
_ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_ROOT / ".cache" / "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", str(_ROOT / ".cache" / "triton"))
os.environ.setdefault("TMPDIR", str(_ROOT / ".cache" / "tmp"))
pathlib.Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)

import pytest  # noqa: E402
import torch  # noqa: E402

import compile_pass  # noqa: E402,F401
import compile_pass.kernels  # noqa: E402
import decision_log  # noqa: E402  (tests/support: SYNCFREE_DECISIONS_LOG)

# `python -m pytest` puts the checkout's root on sys.path, where the source folder kernels/ is importable as a
# top-level package `kernels`. transformers (imported by the SGLang tests) probes for a PyPI package of that name
# and, finding no metadata, imports it: kernels/*.py would run a second time and register every torch.ops.syncfree
# op again with the copy's functions, so that a test patching compile_pass.kernels (tests/test_kernel_warmup.py)
# would patch functions the ops no longer call. The name is bound to the package already imported.
sys.modules.setdefault("kernels", compile_pass.kernels)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    torch._dynamo.reset()
    if decision_log.path() is None:
        yield
        return
    from compile_pass import report

    with report._LOCK:
        report._ALL.clear()
    yield
    decision_log.append(request.node.nodeid, list(report._ALL))

"""The pass's decisions over a test run, for comparing a refactor's before and after (issue 42).

With SYNCFREE_DECISIONS_LOG=PATH in the environment, tests/conftest.py appends one JSON line per test to
PATH (PATH.<worker> under xdist): the test's id and, for every graph report made during the test (the backend's
and the pass-only harness's, passlib.Rewriting), in order,
each rewritten and kept item (kind, location, rule, reason code, reason), whether the pass fell back, and the
notes. `python tests/support/decision_log.py BEFORE AFTER` compares two runs (each a path prefix: every
worker's file is read) and prints the tests whose decisions differ; exit 1 when any does.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

_NUMBER = re.compile(r"\d+\.\d+ ?(s|ms|us)\b")


def _item(item) -> list:
    return [item.kind, item.location, item.rule, item.reason_code, item.reason]


def decisions(report) -> dict:
    return {"rewritten": [_item(i) for i in report.rewritten], "kept": [_item(i) for i in report.kept],
            "fell_back": report.fell_back, "notes": [_NUMBER.sub("<time>", n) for n in report.notes]}


def path() -> str | None:
    base = os.environ.get("SYNCFREE_DECISIONS_LOG")
    if not base:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{base}.{worker}" if worker else base


def append(nodeid: str, reports) -> None:
    target = path()
    if target is None:
        return
    with open(target, "a") as f:
        f.write(json.dumps({"test": nodeid, "reports": [decisions(r) for r in reports]}) + "\n")


def load(prefix: str) -> dict:
    runs: dict = {}
    for name in sorted(glob.glob(prefix) + glob.glob(prefix + ".*")):
        with open(name) as f:
            for line in f:
                entry = json.loads(line)
                test = entry["test"].replace("tests/relations/", "tests/rules/")  # moved in issue 42
                runs.setdefault(test, []).append(entry["reports"])
    return runs


def main(argv) -> int:
    before, after = load(argv[1]), load(argv[2])
    differ = sorted(t for t in set(before) & set(after) if before[t] != after[t])
    graphs = sum(len(r) for runs in before.values() for r in runs)
    print(f"{len(before)} tests before, {len(after)} after, {len(set(before) & set(after))} in both; "
          f"{graphs} graph reports before; {len(differ)} tests whose decisions differ")
    for test in differ:
        print("  differs:", test)
    only = sorted(set(before) ^ set(after))
    for test in only[:50]:
        print("  only in", "before:" if test in before else "after:", test)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

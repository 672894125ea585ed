"""Shared pytest set-up: the repository root on sys.path, a one-thread fixture, and a closing
summary that names every test module skipped for a missing optional package (so a run without
transformers cannot look green by silently skipping the HF tests)."""
import os
import sys

import pytest
import torch

# tests import the flat top-level modules (model, parallel, ...) from the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: extra intra-op threads only add overhead (and thrash a shared CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_terminal_summary(terminalreporter):
    """List skips caused by a missing package (pytest.importorskip), with the install line."""
    missing = {}
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if "could not import" in reason:
            where = rep.nodeid.split("::")[0]
            missing.setdefault(reason.split("'")[1] if "'" in reason else reason, set()).add(where)
    if missing:
        terminalreporter.section("skipped: optional test dependencies missing", yellow=True)
        for pkg, files in sorted(missing.items()):
            terminalreporter.line(f"{pkg} not installed: {', '.join(sorted(files))} skipped")
        terminalreporter.line("install them with: pip install -r requirements-test.txt")

"""Shared pytest setup: the tests of e2e/ and benchmarks/ are `slow` (the fast lane leaves them
out), GPU tests skip by themselves where no CUDA device is present, CPU kernel tests skip on a CPU
without their flags and are listed at the end."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Folders whose every test is `slow` (real processes, servers, clusters, benchmark runs): the
# fast lane, `pytest -m "not slow"`, leaves them to `.ci/run`.
SLOW_FOLDERS = ("e2e", "benchmarks")


def pytest_collection_modifyitems(config, items):
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        folder = item.path.resolve().relative_to(tests_dir).parts[0]
        if folder in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# CPU kernel tests (marked by `tests.helpers.cpu_kernel_builds.requires_cpu_flags`): they skip on a CPU
# without the flags they name, and the run ends with the list of those this host skipped, so a
# green run on one CPU says which kernels it did not test.
CPU_KERNEL_MARKER = "cpu_kernel"


def pytest_itemcollected(item):
    marker = item.get_closest_marker(CPU_KERNEL_MARKER)
    if marker is None:
        return
    from core_engine.worker.cpu_features import host_cpu_flags
    from tests.helpers.cpu_kernel_builds import missing_flags_reason

    reason = missing_flags_reason(marker.args, marker.kwargs["kernel"], host_cpu_flags())
    if reason is not None:
        item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    def marked(category: str) -> list:
        reports = terminalreporter.stats.get(category, [])
        return [r for r in reports if getattr(r, "keywords", {}).get(CPU_KERNEL_MARKER)]

    skipped = [(r.nodeid, _skip_reason(r)) for r in marked("skipped")]
    num_ran = sum(len(marked(category)) for category in ("passed", "failed", "xfailed"))
    if not skipped and not num_ran:
        return
    from core_engine.worker.cpu_features import host_cpu_flags
    from tests.helpers.cpu_kernel_builds import skipped_kernel_tests_summary

    heading, lines = skipped_kernel_tests_summary(skipped, num_ran, host_cpu_flags())
    terminalreporter.write_sep("=", heading)
    for line in lines:
        terminalreporter.write_line(line)


def _skip_reason(report) -> str:
    """The reason of a skipped test's report (its longrepr is (path, line, "Skipped: ..."))."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


# Tests of the hooks above run pytest in-process on a file of their own.
pytest_plugins = ("pytester",)


@pytest.fixture(autouse=True)
def _sigint_handler_is_left_as_found():
    """A test that leaves its own SIGINT handler behind changes what Ctrl-C does in every later
    test of the session (the Ctrl-C tests of test_llm.py): fail the test that leaked it, naming
    the handler. (SIGTERM is not checked: Ray's in-process test cluster registers its own.)"""
    before = signal.getsignal(signal.SIGINT)
    yield
    now = signal.getsignal(signal.SIGINT)
    assert now == before, f"the test left SIGINT handled by {now!r}"

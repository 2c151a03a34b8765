"""ONNX backend node conformance on llvm: every test in the expected-pass list must still pass.

Runs the whole suite (about 2.5 minutes on 2 cores) through `tests/conformance/runner.py` in
`--check` mode and prints the pass rate. Deselect with `-m "not conformance"`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.conformance
@pytest.mark.timeout(1800)
def test_expected_onnx_node_tests_still_pass() -> None:
    """No test listed in tests/conformance/expected_pass_llvm.txt may stop passing."""
    completed = subprocess.run(
        [sys.executable, "-m", "tests.conformance.runner", "--target", "llvm", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(completed.stdout)
    assert completed.returncode == 0, (
        f"conformance check failed (exit {completed.returncode}):\n"
        f"{completed.stdout[-8000:]}\n{completed.stderr[-4000:]}"
    )

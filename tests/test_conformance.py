"""ONNX backend node conformance: every test in a target's expected-pass list must still pass.

Runs `tests/conformance/runner.py` in `--check` mode and prints the pass rate. By default (and
in CI) a fixed subset spread evenly over the names: 800 of the suite's tests on llvm, 200 of
vulkan's expected-pass list; `-m slow` runs them whole (about 10 and 20 minutes on 2 cores).
Deselect with `-m "not conformance"`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.conformance
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("target, scope", [
    ("llvm", ["--subset", "800"]),
    ("vulkan", ["--only-expected", "--subset", "200"]),
    pytest.param("llvm", [], marks=pytest.mark.slow),
    pytest.param("vulkan", ["--only-expected"], marks=pytest.mark.slow),
])
def test_expected_onnx_node_tests_still_pass(target: str, scope: list[str]) -> None:
    """No test in tests/conformance/expected_pass_TARGET.txt that runs may stop passing, and
    no test that runs may give a wrong result."""
    completed = subprocess.run(
        [sys.executable, "-m", "tests.conformance.runner", "--target", target, "--check", *scope],
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


@pytest.fixture(scope="module")
def dft_inverse_case():
    from tests.conformance.runner import collect_cases, select

    case, = select(collect_cases(), r"^test_dft_inverse$", None)
    return case


def test_stored_float32_rounding_is_told_apart_from_a_wrong_result(dft_inverse_case) -> None:
    """test_dft_inverse's data has numpy float32 FFT rounding (1.9e-7 where the exact value is
    0, over the test's atol of 1e-7): our exact answer is an imprecise reference, not a wrong
    one; the same output with one of those zeros off by 1e-5 is wrong."""
    import numpy as np

    from tests.conformance.runner import IMPRECISE_REFERENCE, PASS, WRONG, check_outputs, run_case

    category, detail = run_case(dft_inverse_case, "llvm")
    assert category == IMPRECISE_REFERENCE, detail
    exact = np.fft.ifft(np.arange(100, dtype=np.complex128).reshape(10, 10), axis=0)
    ours = np.stack((exact.real, exact.imag), axis=2).astype(np.float32).reshape(1, 10, 10, 2)
    assert check_outputs(dft_inverse_case, [ours])[0] == IMPRECISE_REFERENCE
    off = ours.copy()
    off[0, 5, 4, 1] += 1e-5  # row 5 (Nyquist) has an exact zero imaginary part
    assert check_outputs(dft_inverse_case, [off])[0] == WRONG
    assert check_outputs(dft_inverse_case, dft_inverse_case.expected) == (PASS, "")


def test_ops_table_goes_into_the_marked_block_of_a_readme(tmp_path) -> None:
    """--ops-table writes a table file whole, replaces only the marked block of a README, and
    refuses to overwrite any other file."""
    from tests.conformance.runner import (OPS_TABLE_BEGIN, OPS_TABLE_END, PASS, WRONG, Result,
                                          write_ops_table)

    results = [Result("test_relu", "Relu", PASS, onnxruntime=True),
               Result("test_tanh", "Tanh", WRONG, "output 0 differs", onnxruntime=True)]
    table = tmp_path / "ops.md"
    write_ops_table(str(table), results, "llvm")
    assert "| Relu | 1 | 1 | 1 |" in table.read_text() and "| Tanh | 1 | 0 | 1 |" in table.read_text()
    readme = tmp_path / "README.md"
    begin = OPS_TABLE_BEGIN.format(target="llvm")
    readme.write_text(f"# Project\n\n{begin}\nold table\n{OPS_TABLE_END}\n\nmore text\n")
    write_ops_table(str(readme), results, "llvm")
    text = readme.read_text()
    assert text.startswith(f"# Project\n\n{begin}\n") and text.endswith(f"{OPS_TABLE_END}\n\nmore text\n")
    assert "old table" not in text and "| Relu | 1 | 1 | 1 |" in text and "# ONNX op coverage" not in text
    other = tmp_path / "NOTES.md"
    other.write_text("notes\n")
    with pytest.raises(ValueError, match="no block marked"):
        write_ops_table(str(other), results, "llvm")
    assert other.read_text() == "notes\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "NOTES.md", "README.md", "ops.md"]

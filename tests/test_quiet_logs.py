"""TVM's C++ log lines stay off stderr unless asked (`--verbose`, `GIMLET_LOG=debug`), and
everything else written to stderr comes through (`gimlet_tvm.logs`)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto

import gimlet_tvm
from gimlet_tvm.compiler import INDEX_CHECKS_ENV
from gimlet_tvm.logs import ENV, is_tvm_log_line, quiet_tvm_logs
from gimlet_tvm.models import GraphBuilder

from .conftest import suite_model

POW_WARNING = "Detected pow(x, y) where y >= 3"
FAST_TAKE_WARNING = "Fast mode segfaults when there are out-of-bounds indices"


def embedding_cube_model() -> onnx.ModelProto:
    """Token ids -> embedding (Gather: "fast" take) -> Pow 3 (as GPT-2's tanh GELU has): the
    two ops TVM logs warnings for while compiling."""
    b = GraphBuilder("embedding_cube", 0)
    embedded = b.op("Gather", [b.normal((50, 8), 1.0, "wte"), "ids"], axis=0)
    y = b.op("Pow", [embedded, b.const(3.0, "three")])
    return b.model([("ids", TensorProto.INT64, ["batch", 4])], [(y, "y", ["batch", 4, 8])])


def tvm_warning() -> None:
    """Make TVM's C++ code log one warning line (op.cc: pow with exponent >= 3)."""
    x = tvm.tirx.Var("x", "float32")
    tvm.tirx.power(x, tvm.tirx.const(3.0, "float32"))


def tvm_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if is_tvm_log_line(line)]


@pytest.fixture(autouse=True)
def quiet_by_default(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "embedding_cube.onnx"
    path.write_bytes(embedding_cube_model().SerializeToString())
    return path


def test_compile_prints_no_tvm_log_line(cli, model_file) -> None:
    """Nor a warning about the Gather: its indices are checked at run time."""
    code, out, err = cli("compile", str(model_file), "-t", "llvm", "-o", "m.so")
    assert code == 0, err
    assert tvm_lines(err) == []
    assert "warning" not in err, err


@pytest.mark.parametrize("how", ["--verbose", "env"])
def test_verbose_lets_tvm_log_lines_through(model_file, tmp_path, how) -> None:
    script = os.path.join(os.path.dirname(sys.executable), "gimlet-tvm")
    env = {**os.environ, ENV: "debug"} if how == "env" else dict(os.environ)
    env[INDEX_CHECKS_ENV] = "0"  # TVM's unchecked Gather, and its log line
    flags = ["--verbose"] if how == "--verbose" else []
    proc = subprocess.run([script, *flags, "compile", str(model_file), "-t", "llvm", "-o", "m.so"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = tvm_lines(proc.stderr)
    assert any(POW_WARNING in line for line in lines), proc.stderr
    assert any(FAST_TAKE_WARNING in line for line in lines), proc.stderr
    assert "gimlet-tvm: warning: Gather node gather_0_node" in proc.stderr


def test_build_warns_once_about_unchecked_indices(caplog, monkeypatch) -> None:
    monkeypatch.setenv(INDEX_CHECKS_ENV, "0")
    with caplog.at_level(logging.WARNING, logger="gimlet_tvm"):
        model = gimlet_tvm.build(embedding_cube_model(), "llvm")
        ids = np.array([[0, 1, 2, 49]], dtype=np.int64)
        assert model(ids)[0].shape == (1, 4, 8)
        gimlet_tvm.build(suite_model("mlp"), "llvm")  # no Gather: nothing to say
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("gimlet_tvm")]
    assert len(messages) == 1 and messages[0].startswith("Gather node gather_0_node:"), messages


PYTHON_OUTPUT_CHILD = """
import os, sys
from gimlet_tvm.logs import quiet_tvm_logs
from tests.test_quiet_logs import tvm_warning
before = os.fstat(2)
with quiet_tvm_logs() as log:
    print("python one", file=sys.stderr)
    tvm_warning()
    os.write(2, b"raw two\\n")
    tvm_warning()
    print("python three", file=sys.stderr)
    sys.stderr.write("unflushed ")
after = os.fstat(2)
print(len(log.lines), (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino))
print("after", file=sys.stderr)
tvm_warning()
"""


def test_other_output_passes_in_order_and_fd2_is_restored() -> None:
    # A child process: pytest's capture replaces sys.stderr with a writer that bypasses fd 2.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", PYTHON_OUTPUT_CHILD], capture_output=True,
                          text=True, cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "2 True\n"  # both TVM lines recorded; fd 2 is the original again
    lines = proc.stderr.splitlines()
    assert lines[:4] == ["python one", "raw two", "python three", "unflushed after"], proc.stderr
    assert len(lines) == 5 and POW_WARNING in lines[4]  # outside the block TVM's lines pass


def test_restored_on_exception(capfd) -> None:
    before = os.fstat(2)
    with pytest.raises(ZeroDivisionError):
        with quiet_tvm_logs():
            os.write(2, b"written before the error\n")
            1 / 0  # noqa: B018
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert capfd.readouterr().err == "written before the error\n"


def test_partial_lines_pass_promptly_and_unchanged(capfd) -> None:
    with quiet_tvm_logs():
        os.write(2, b"prompt> ")
        time.sleep(0.3)
        assert capfd.readouterr().err == "prompt> "  # not held back waiting for a line end
        os.write(2, b"[12:00:00] looks like a stamp")  # could still become a log line: held briefly
        time.sleep(0.3)
        os.write(2, b" but is not\n[1")
        os.write(2, b"2:00:00] /src/a.cc:7: Warning: split across writes")
        os.write(2, b"\n")  # std::endl is a write of its own
        os.write(2, b"[12:00:00] /src/a.cc:8: Error: errors pass\n")
        os.write(2, b"no line end at the end")
    assert capfd.readouterr().err == ("[12:00:00] looks like a stamp but is not\n"
                                      "[12:00:00] /src/a.cc:8: Error: errors pass\n"
                                      "no line end at the end")


def test_large_output_does_not_deadlock(capfd) -> None:
    blob = b"".join(b"line %06d of plain output\n" % i for i in range(40000))  # ~1 MB
    with quiet_tvm_logs():
        os.write(2, blob)
    assert capfd.readouterr().err.encode() == blob


def test_nested_and_threaded(capfd) -> None:
    before = os.fstat(2)
    seen = []
    writing = threading.Lock()  # TVM writes a line's text and its end separately (docstring)

    def worker(n: int) -> None:
        with quiet_tvm_logs() as log:
            with quiet_tvm_logs():
                with writing:
                    tvm_warning()
                    os.write(2, b"thread %d\n" % n)
        seen.append(log)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert sorted(capfd.readouterr().err.splitlines()) == [f"thread {n}" for n in range(4)]
    assert len(seen) == 4 and all(log.lines for log in seen)


def test_children_are_filtered_and_a_fork_can_open_its_own(capfd) -> None:
    child = ("import os, sys; os.write(2, b'[01:02:03] /src/b.cc:9: Warning: from the child\\n');"
             "print('child says hi', file=sys.stderr)")
    with quiet_tvm_logs():
        subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
        pid = os.fork()
        if pid == 0:  # the fork opens (and closes) its own block, with no reader inherited
            try:
                with quiet_tvm_logs():
                    tvm_warning()
                    os.write(2, b"forked child\n")
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0
    assert capfd.readouterr().err == "child says hi\nforked child\n"

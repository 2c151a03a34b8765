"""Keep TVM's C++ log lines off the user's terminal unless asked (`GIMLET_LOG=debug`).

TVM's C++ code logs with `LOG(WARNING)` and friends straight to `std::cerr`, one line each:
`[hh:mm:ss] /path/file.cc:NNN: Warning: message` (`Debug: `, no level word for Info,
`Error: `). The 0.27 wheel has no run-time switch for them (`TVM_LOG_DEBUG` only adds debug
`VLOG`s; a custom log sink is a compile-time option, `TVM_LOG_CUSTOMIZE`, the wheel was
built without), and a compile prints dozens, mostly irrelevant to the user. So
`quiet_tvm_logs()` works at the file-descriptor level: while it is active fd 2 is a pipe, and
a reader thread passes every byte on to the real stderr unchanged and promptly, except whole
lines of that shape, which it records and drops. `Error: ` lines pass: TVM reports a failure
there that it did not raise, and hiding it would hide the cause of what goes wrong next.
With `GIMLET_LOG=debug` everything passes (the lines are still recorded).

Callers that care about a line read it from the `TVMLog` the context returns and say it in
their own words (`compiler.build` does for unchecked indices). The module imports only the
standard library, so every layer can use it.

Semantics:
- Nestable and thread-safe: the first active context installs the pipe, the last one to exit
  restores fd 2 (also on exceptions); each context records the lines written while it was
  active (from any thread of the process: fd 2 is process-wide).
- Child processes inherit the pipe as their stderr, so their TVM lines are filtered too. A
  child that outlives the context keeps the pipe open; the reader then serves it until it
  exits. A forked child starts with no context active (and can open its own).
- Promptly: bytes pass as they arrive; only a line start that may still become a log line
  (`[12:3`) waits for more, 50 ms at most.
- Only the first line of a multi-line TVM message is recognised; the messages seen in our
  compile, tuning and selection runs are all one line.
- TVM writes a line's text and its line end in two writes (`std::cerr << text << std::endl`):
  what another thread writes to fd 2 between the two is taken for the rest of the log line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import struct
import sys
import termios
import threading
from dataclasses import dataclass, field
from typing import Iterator

ENV = "GIMLET_LOG"
"""Environment variable: `debug` lets TVM's log lines through (children inherit it)."""

_HEADER = re.compile(rb"\[\d\d:\d\d:\d\d\] \S+:\d+: ")
_ERROR = re.compile(_HEADER.pattern + rb"Error: ")
_STAMP = b"[00:00:00] "  # the header's fixed start; 0 stands for a digit
_HOLD_S = 0.05  # how long a partial line that may still become a log line waits for more
_SYNC_S = 5.0  # how long an exit waits for the reader to pass on what was written before it


def verbose() -> bool:
    """Whether TVM's log lines should reach stderr (`GIMLET_LOG=debug`)."""
    return os.environ.get(ENV, "").strip().lower() == "debug"


def set_verbose(on: bool) -> None:
    """Let TVM's log lines through (or not), here and in child processes started later."""
    if on:
        os.environ[ENV] = "debug"
    else:
        os.environ.pop(ENV, None)


def is_tvm_log_line(line: str) -> bool:
    """Whether `line` is one of TVM's C++ log lines (`[hh:mm:ss] file.cc:NNN: ...`)."""
    return _HEADER.match(line.encode(errors="replace")) is not None


@dataclass(eq=False)  # each block's log is its own, however alike the lines
class TVMLog:
    """The TVM log lines written to stderr while a `quiet_tvm_logs()` block ran (without
    their line ends), whether they were dropped or passed."""

    lines: list[str] = field(default_factory=list)

    def matching(self, text: str) -> list[str]:
        """The lines that contain `text`."""
        return [line for line in self.lines if text in line]


def _may_become_header(partial: bytes) -> bool:
    """Whether more bytes could still make `partial` (no line end) a log line's header."""
    for byte, want in zip(partial, _STAMP):
        if not (chr(byte).isdigit() if want == ord("0") else byte == want):
            return False
    return not any(chr(byte).isspace() for byte in partial[len(_STAMP):])


class _Filter:
    """fd 2 redirected into a pipe; a reader thread filters it onto the original stderr."""

    def __init__(self) -> None:
        self.listeners: list[TVMLog] = []
        self._pending = b""  # bytes of a line not yet passed on or dropped
        self._plain = False  # inside a line known not to be a log line: pass bytes at once
        self._busy = False  # the reader holds bytes it has read but not yet handled
        self._cond = threading.Condition()
        _flush_stderr()
        self._read_fd, write_fd = os.pipe()
        try:
            self._restore_fd = os.dup(2)
        except OSError:  # no stderr at all (fd 2 closed)
            os.close(self._read_fd)
            os.close(write_fd)
            raise
        self._out_fd = os.dup(self._restore_fd)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._thread = threading.Thread(target=self._read, name="gimlet-tvm-logs", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Give fd 2 back to the original stderr (after a `sync()`: what was written before
        it has been passed on)."""
        with self._cond:
            self._write(self._release_held())
        os.dup2(self._restore_fd, 2)
        os.close(self._restore_fd)
        # The reader ends at EOF: now, unless a child process still holds the pipe.
        self._thread.join(timeout=1.0)

    def sync(self) -> None:
        """Wait until the reader has handled every byte written to fd 2 before this call."""
        _flush_stderr()
        with self._cond:
            self._cond.wait_for(self._drained, timeout=_SYNC_S)

    def _drained(self) -> bool:
        # The pipe first: the reader marks itself busy before it reads.
        return not self._thread.is_alive() or (_unread(self._read_fd) == 0 and not self._busy)

    def listen(self, log: TVMLog, on: bool) -> None:
        """Start (or stop) recording log lines into `log`."""
        with self._cond:
            if on:
                self.listeners.append(log)
            else:
                self.listeners.remove(log)

    def _read(self) -> None:
        try:
            while True:
                ready, _, _ = select.select([self._read_fd], [], [], _HOLD_S if self._pending else None)
                with self._cond:
                    self._busy = True
                data = os.read(self._read_fd, 65536) if ready else None
                if data == b"":
                    break
                with self._cond:
                    out = self._release_held() if data is None else self._feed(data)
                self._write(out)  # unlocked: a slow stderr must not block sync()'s timeout
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            with self._cond:
                out = self._release_held(at_end=True)
            self._write(out)
        finally:
            with self._cond:
                self._busy = False
                os.close(self._read_fd)
                os.close(self._out_fd)
                self._cond.notify_all()

    def _feed(self, data: bytes) -> bytes:
        """Take in `data`; what to pass on now."""
        out = []
        pending = self._pending + data
        while pending:
            end = pending.find(b"\n") + 1  # 0: no line end yet
            if self._plain:
                out.append(pending[:end] if end else pending)
                pending = pending[end:] if end else b""
                self._plain = not end
                continue
            line = pending[:end] if end else pending
            if _HEADER.match(line):
                if not end:
                    break  # a log line without its line end yet: std::endl is a second write
                out.append(self._log_line(line))
                pending = pending[end:]
            elif not end and _may_become_header(line):
                break  # held for _HOLD_S at most
            else:
                self._plain = True
        self._pending = pending
        return b"".join(out)

    def _release_held(self, at_end: bool = False) -> bytes:
        """A held partial line that has not become a log line by now: what to pass on."""
        held = self._pending
        if _HEADER.match(held):
            if not at_end:
                return b""  # its line end is on its way
            self._pending = b""
            return self._log_line(held)
        self._pending, self._plain = b"", bool(held)
        return held

    def _log_line(self, line: bytes) -> bytes:
        """Record a log line; what to pass on of it."""
        text = line.decode(errors="replace").rstrip("\r\n")
        for listener in self.listeners:
            listener.lines.append(text)
        return line if verbose() or _ERROR.match(line) else b""

    def _write(self, data: bytes) -> None:
        """Pass `data` on to the original stderr."""
        try:
            while data:
                data = data[os.write(self._out_fd, data):]
        except OSError:
            pass  # stderr is gone (closed pipe): nowhere to say anything


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe `fd`."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def _flush_stderr() -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()


_lock = threading.Lock()
_filter: _Filter | None = None


def _forget_in_child() -> None:
    """A forked child has no reader thread: it starts with no filter of its own (its fd 2 is
    still the parent's pipe while the parent's reader serves it)."""
    global _lock, _filter
    _lock, _filter = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def quiet_tvm_logs() -> Iterator[TVMLog]:
    """Drop TVM's C++ log lines from stderr while the block runs (module docstring); yields
    the `TVMLog` of the lines seen, complete once the block has exited. Also a decorator."""
    global _filter
    log = TVMLog()
    with _lock:
        if _filter is None:
            with contextlib.suppress(OSError):  # no stderr to filter: nothing to do
                _filter = _Filter()
        else:
            _filter.sync()  # lines written before this block are not its own
        active = _filter
        if active is not None:
            active.listen(log, True)
    try:
        yield log
    finally:
        with _lock:
            if active is not None and _filter is active:  # else: a fork leaving its parent's block
                try:
                    active.sync()
                finally:  # even when interrupted (Ctrl-C) while waiting
                    active.listen(log, False)
                    if not active.listeners:
                        _filter = None
                        active.close()

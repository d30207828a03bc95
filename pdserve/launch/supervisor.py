"""Child processes of ``pdserve up``: start each in its own process group with its log in
a file; stop them all (SIGTERM to the group, SIGKILL after a grace period), so no
orphan survives whatever way ``up`` ends (short of SIGKILL of ``up`` itself)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    """One supervised process: ``name`` (e.g. ``prefill-0``), its URL and argv."""

    name: str
    url: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        """Start the process, its stdout and stderr in ``log_path``: a fresh file, so the
        log (and :meth:`log_tail`) holds this run only, never an earlier run's lines from
        a reused ``--log-dir``."""
        log = open(self.log_path, "wb")  # noqa: SIM115 (closed once the child has it)
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in text[-lines:])


def _signal_group(child: Child, sig: int) -> None:
    if child.proc is None:
        return
    try:
        os.killpg(child.proc.pid, sig)  # the child leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(children: list[Child], grace: float = 10.0) -> None:
    """SIGTERM every child's process group, wait up to ``grace`` seconds, then SIGKILL the
    groups still alive, and reap every child."""
    for child in children:
        if child.exit_code() is None:
            _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        # Also reaches grandchildren left in the group after the leader exited.
        _signal_group(child, signal.SIGKILL)
        if child.proc is not None:
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

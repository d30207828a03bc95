"""Child processes of ``pdserve up``: start each in its own process group with its log in
a file; restart one that died, with a backoff (:class:`Restarts`); stop them all (SIGTERM
to the group, SIGKILL after a grace period), so no orphan survives whatever way ``up``
ends (short of SIGKILL of ``up`` itself)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import envs
from pdserve.process_exit import death_cause


@dataclass
class Child:
    """One supervised process: ``name`` (e.g. ``prefill-0``), its URL and argv."""

    name: str
    url: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, *, append: bool = False) -> None:
        """Start the process, its stdout and stderr in ``log_path``: a fresh file, so the
        log (and :meth:`log_tail`) holds this run only, never an earlier run's lines from
        a reused ``--log-dir``; ``append``: a restart, after the lines of the run that
        died."""
        # the child stops itself should this process be killed past its cleanup (kill -9)
        env = dict(os.environ if self.env is None else self.env)
        env[envs.SUPERVISOR_PID.name] = str(os.getpid())
        log = open(self.log_path, "ab" if append else "wb")  # noqa: SIM115 (closed once the child has it)
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
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


@dataclass
class Restarts:
    """The restart policy of ``pdserve up``'s children, as a supervisor's: a child that
    died is started again after ``backoff(k)`` seconds (``first_s`` doubling per death up
    to ``max_s``; ``k`` counts the deaths since the child last served ``stable_s`` seconds
    in a row); the ``give_up_after``-th such death in a row stops everything.

    ``poll(children, healthy, now)`` is the whole policy, called about twice a second: it
    reaps the dead, restarts the due, and returns the lines to print; ``failed`` names the
    child whose restarts keep failing (then ``up`` stops)."""

    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0
    give_up_after: int = 5
    deaths: dict[str, int] = field(default_factory=dict)  # in a row, per child
    due: dict[str, float] = field(default_factory=dict)  # child -> when to restart it
    up_since: dict[str, float] = field(default_factory=dict)  # last (re)start
    serving: set[str] = field(default_factory=set)  # restarted and healthy again
    failed: str | None = None
    total: int = 0  # deaths of any child since start

    def backoff(self, k: int) -> float:
        """Seconds before the ``k``-th restart in a row (1-based)."""
        return min(self.max_s, self.first_s * 2 ** (k - 1))

    def poll(
        self, children: list[Child], healthy: Callable[[Child], bool], now: float
    ) -> list[str]:
        """One round: each child that died since the last round is scheduled for a
        restart (or, at ``give_up_after`` deaths in a row, ``failed`` is set); each one
        due is started again (its group's leftovers killed first); each restarted one
        seen healthy is announced once. Returns what to print."""
        lines: list[str] = []
        for child in children:
            name = child.name
            code = child.exit_code()
            if name in self.due:
                if now >= self.due[name]:
                    del self.due[name]
                    _signal_group(child, signal.SIGKILL)  # no leftover of the dead run
                    child.start(append=True)
                    self.up_since[name] = now
                    lines.append(
                        f"restarted {name} (pid {child.pid}) on {child.url} "
                        f"(restart {self.deaths[name]}), log {child.log_path}"
                    )
                continue
            if code is None:
                started = self.up_since.setdefault(name, now)
                if name in self.deaths and name not in self.serving and healthy(child):
                    self.serving.add(name)
                    lines.append(f"{name} (pid {child.pid}) is serving again")
                if name in self.deaths and now - started >= self.stable_s:
                    del self.deaths[name]  # it served long enough: the count starts over
                continue
            k = self.deaths.get(name, 0) + 1
            self.deaths[name] = k
            self.total += 1
            self.serving.discard(name)
            cause = f"{name} (pid {child.pid}) {death_cause(code)}"
            tail = (
                f"  last lines of its log {child.log_path} (not necessarily the cause):\n"
                f"{child.log_tail()}"
            )
            if k >= self.give_up_after:
                why = (
                    "no restarts (--max-restarts 0)"
                    if k == 1
                    else f"{k} deaths in a row: its restarts keep failing"
                )
                self.failed = f"{cause}; {why}; stopping everything.\n{tail}"
                return lines
            wait = self.backoff(k)
            self.due[name] = now + wait
            lines.append(
                f"{cause}; the others keep serving; restarting it in {wait:g} s "
                f"(restart {k} of at most {self.give_up_after - 1} in a row).\n{tail}"
            )
        return lines

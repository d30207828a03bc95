"""The one process launcher of the tests: real pdserve processes (workers, routers) on
free ports, waiting until healthy, per-process health (naming the process and what
failed), and stopping them (terminate, then kill) at teardown. Importable from every test
folder (``tests`` is on pytest's pythonpath); in-process servers are
``pdserve.http.netutil.ThreadedServer``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.http.netutil import free_port

TINY = "random:tiny"


@dataclass
class Proc:
    """One pdserve process: its name (e.g. ``prefill``), base URL, Popen and log file."""

    name: str
    url: str
    popen: subprocess.Popen | None  # None: not our child (e.g. started by `pdserve up`)
    log_path: Path
    info: dict = field(default_factory=dict)
    pid: int = 0

    def __post_init__(self) -> None:
        if self.popen is not None:
            self.pid = self.popen.pid

    def exit_status(self) -> str | None:
        """None while running, else how it ended."""
        if self.popen is not None:
            code = self.popen.poll()
            return None if code is None else f"exited with code {code}"
        return None if pid_alive(self.pid) else "is gone"

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def health_problem(self, client: httpx.Client | None = None) -> str | None:
        """None if the process runs and its /health answers 200, else what is wrong."""
        status = self.exit_status()
        if status is not None:
            return f"process {status}; last log lines:\n{self.log_tail()}"
        try:
            resp = (client or httpx).get(f"{self.url}/health", timeout=5.0)
        except httpx.HTTPError as exc:
            return f"GET /health failed: {type(exc).__name__}: {exc}"
        if resp.status_code != 200:
            return f"GET /health answered HTTP {resp.status_code}: {resp.text[:300]}"
        return None

    def get_info(self) -> dict:
        self.info = httpx.get(f"{self.url}/get_server_info", timeout=10.0).json()
        return self.info


LIVE: list[Proc] = []  # spawned by this test process and not stopped yet (failure reports)


def live_log_tails(lines: int = 15) -> str:
    """The last ``lines`` log lines of every process this test process spawned and has not
    stopped, with how each stands: what a failed test's report shows (tests/conftest.py)."""
    parts = []
    for p in LIVE:
        state = p.exit_status() or "running"
        parts.append(
            f"--- {p.name} ({p.url}, pid {p.pid}, {state}) {p.log_path}\n{p.log_tail(lines)}"
        )
    return "\n".join(parts)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PDSERVE_LOG_LEVEL", "WARNING")
    env.update(extra or {})
    return env


def spawn(
    name: str, args: list[str], log_dir: Path, *, port: int, env: dict[str, str] | None = None
) -> Proc:
    """Start ``python -m pdserve <args>`` (its own process group), log to ``log_dir/name.log``;
    a PD worker's UCX report goes to ``log_dir`` too (one the test killed leaves it there,
    not in the system's temporary folder)."""
    log_path = log_dir / f"{name}.log"
    env = {"PDSERVE_UCX_LOG_DIR": str(log_dir), **(env or {})}
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_env(env),
            start_new_session=True,
        )
    proc = Proc(name, f"http://127.0.0.1:{port}", popen, log_path)
    LIVE.append(proc)
    return proc


def start_worker(
    name: str,
    role: str,
    log_dir: Path,
    *,
    model: str = TINY,
    env: dict[str, str] | None = None,
    extra: Iterable[str] = (),
) -> Proc:
    """A ``pdserve serve`` worker of ``role`` on a free port (not waited for)."""
    port = free_port()
    args = ["serve", "--role", role, "--model", model, "--port", str(port), *extra]
    return spawn(name, args, log_dir, port=port, env=env)


def start_router(
    name: str,
    log_dir: Path,
    *,
    prefill: Iterable[Proc] = (),
    decode: Iterable[Proc] = (),
    workers: Iterable[Proc] = (),
    extra: Iterable[str] = (),
) -> Proc:
    """A ``pdserve router`` in PD mode (prefill/decode) or regular mode (workers). It
    sends every PD request through a pair (``--pd-min-prefill-tokens 0``: the tests that
    start it are about the PD path, whose short prompts the default threshold would run on
    a decode worker alone; a regular-mode router ignores it); ``extra`` comes last, so a
    test may set its own threshold."""
    port = free_port()
    args = ["router", "--port", str(port), "--health-check-interval", "0.5"]
    args += ["--pd-min-prefill-tokens", "0", *extra]
    for flag, procs in (("--prefill", prefill), ("--decode", decode), ("--worker", workers)):
        for p in procs:
            args += [flag, p.url]
    return spawn(name, args, log_dir, port=port)


def wait_healthy(procs: Iterable[Proc], timeout: float = 240.0) -> None:
    """Wait until every process answers /health 200; fail naming the laggards."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while True:
            problems = {p.name: p.health_problem(client) for p in procs}
            if not any(problems.values()):
                return
            exited = {n: msg for n, msg in problems.items() if msg and msg.startswith("process ")}
            if exited or time.monotonic() > deadline:
                bad = exited or {n: msg for n, msg in problems.items() if msg}
                pytest.fail("not healthy: " + "; ".join(f"{n}: {m}" for n, m in bad.items()))
            time.sleep(0.25)


def assert_all_healthy(procs: Iterable[Proc]) -> None:
    """Every process is alive and its /health is 200; the failure names each bad process
    and what failed."""
    with httpx.Client() as client:
        problems = [
            f"{p.name} ({p.url}): {msg}" for p in procs if (msg := p.health_problem(client))
        ]
    assert not problems, "unhealthy processes:\n" + "\n".join(problems)


def stop(procs: Iterable[Proc], grace: float = 10.0) -> None:
    """SIGTERM each process group, SIGKILL after ``grace`` seconds; reap all."""
    procs = [p for p in procs if p is not None and p.popen is not None]
    LIVE[:] = [p for p in LIVE if all(p is not q for q in procs)]
    for p in procs:
        if p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.popen.wait(timeout=10)


# --responses-store-size of the shared deployment's workers (tests/e2e/conftest.py's
# ``shared_pd``; test_openai_peers_pd.py fills it)
SHARED_PD_STORE = 6


@contextlib.contextmanager
def pd_and_mixed(
    logs: Path,
    model: str = TINY,
    worker_extra: Iterable[str] = (),
    router_extra: Iterable[str] = (),
) -> Iterator[dict[str, Any]]:
    """A prefill, a decode and a router over them, beside one mixed worker (the reference),
    all on ``model`` and healthy (each worker given the flags ``worker_extra``, the router
    ``router_extra``); ``procs``
    lists the four, ``baseline`` each PD worker's free pages at start. Every process is
    stopped however the block ends."""
    more = list(worker_extra)
    prefill = start_worker(
        "prefill",
        "prefill",
        logs,
        model=model,
        extra=["--disaggregation-bootstrap-port", "0", *more],
    )
    decode = start_worker("decode", "decode", logs, model=model, extra=more)
    mixed = start_worker("mixed", "mixed", logs, model=model, extra=more)
    router = start_router(
        "router", logs, prefill=[prefill], decode=[decode], extra=list(router_extra)
    )
    procs = [prefill, decode, mixed, router]
    try:
        wait_healthy(procs)
        baseline = {p.name: p.get_info()["num_free_pages"] for p in (prefill, decode)}
        yield {
            "prefill": prefill,
            "decode": decode,
            "mixed": mixed,
            "router": router,
            "procs": procs,
            "baseline": baseline,
        }
    finally:
        stop(procs)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate()`` until truthy (returned) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def build_eos_model(folder: Path, prompt: str) -> int:
    """Save ``random:tiny`` as a Hugging Face folder whose generation config makes the
    greedy first output token of ``prompt`` an EOS token; returns that token id.

    This gives the PD tests a prompt whose first token (sampled on prefill) is EOS, with
    ordinary output for other prompts.
    """
    import torch
    import transformers

    from pdserve.model.loader import load_model_source

    src = load_model_source(TINY)
    model = transformers.AutoModelForCausalLM.from_config(src.hf_config)
    model.load_state_dict(dict(src.weights()), strict=False)  # lm_head is tied to the embedding
    model.tie_weights()
    ids = src.tokenizer.encode(prompt)
    with torch.no_grad():
        first = int(model(torch.tensor([ids])).logits[0, -1].argmax())
    model.save_pretrained(folder)
    src.tokenizer.save_pretrained(folder)
    transformers.GenerationConfig(eos_token_id=[src.tokenizer.eos_token_id, first]).save_pretrained(
        folder
    )
    return first

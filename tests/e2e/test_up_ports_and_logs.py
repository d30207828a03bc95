"""``pdserve up`` as a user runs it: ``--port 0`` prints (and serves on) the port the
router bound, not ``:0``; a clean stop leaves nothing in the temporary folder (its log
folder removed, every worker's UCX report deleted), a failed run keeps its logs (with the
UCX report of the worker that died) and names their folder. ``pdserve doctor --peer``
leaves no UCX report behind either. Each run gets its own ``TMPDIR`` (the test's folder),
so what is left there is what the run left. A --host that is not an address of this
machine is named as such (not as a taken port); a reused --log-dir's files hold one run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_up_faults import Up

from pdserve_procs import TINY


def _leftovers(folder: Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder))
        for pattern in ("pdserve-up-*", "pdserve-ucx-*")
        for p in folder.rglob(pattern)
    )


def _log_dir(up: Up, tmp: Path) -> Path:
    kids = up.children()
    folder = kids["router"].log_path.parent
    assert folder.parent == tmp and folder.name.startswith("pdserve-up-"), up.text
    return folder


@pytest.mark.timeout(300)
def test_port_0_prints_the_port_the_router_listens_on_and_a_clean_stop_leaves_nothing(
    tmp_path,
):
    up = Up(["--model", TINY, "--port", "0"], env={"TMPDIR": str(tmp_path)})
    try:
        up.wait_line(r"pdserve is ready at", 240)
        url = re.search(r"pdserve is ready at (http://\S+)", up.text).group(1)
        port = int(url.rsplit(":", 1)[1])
        assert port != 0, up.text
        assert f"curl {url}/v1/chat/completions" in up.text, up.text
        # the router's own line names the port it bound
        router_log = (_log_dir(up, tmp_path) / "router.log").read_text()
        assert f"on http://127.0.0.1:{port}" in router_log, router_log
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        # each PD worker's UCX report is in the log folder while it runs
        assert len(list(_log_dir(up, tmp_path).glob("pdserve-ucx-*.log"))) == 2, up.text
    finally:
        if up.popen.poll() is None:
            up.popen.send_signal(signal.SIGTERM)
        code = up.finish(60)
    assert code == 0, up.text
    assert "logs kept" not in up.text, up.text
    assert _leftovers(tmp_path) == [], up.text


@pytest.mark.timeout(300)
def test_a_failed_run_keeps_its_logs_and_names_their_folder(tmp_path):
    # --max-restarts 0: the death ends the run (restarted, it would go on serving)
    up = Up(["--model", TINY, "--port", "0", "--max-restarts", "0"], env={"TMPDIR": str(tmp_path)})
    try:
        up.wait_line(r"pdserve is ready at", 240)
        folder = _log_dir(up, tmp_path)
        decode = up.children()["decode-0"]
        os.kill(decode.pid, signal.SIGKILL)
        assert up.finish(60) == 1, up.text
    finally:
        up.kill()
    assert f"pdserve up: logs kept in {folder}" in up.text, up.text
    assert {"prefill-0.log", "decode-0.log", "router.log"} <= {p.name for p in folder.iterdir()}
    # the killed worker's UCX report stays beside its log, not loose in the temp folder;
    # the prefill worker, stopped cleanly, deleted its own
    left = _leftovers(tmp_path)
    assert left == [folder.name, f"{folder.name}/pdserve-ucx-{decode.pid}.log"], left


@pytest.mark.timeout(120)
def test_doctor_peer_leaves_no_ucx_report(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "doctor", "--peer", "127.0.0.1:1"],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 1 and "127.0.0.1:1" in done.stdout + done.stderr, done
    assert _leftovers(tmp_path) == [], done


@pytest.mark.timeout(120)
def test_a_host_not_of_this_machine_names_the_host_not_the_port(tmp_path):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): documentation only, never a local address
    up = Up(["--model", TINY, "--host", "192.0.2.1", "--port", "0"], env={"TMPDIR": str(tmp_path)})
    assert up.finish(100) == 2, up.text
    assert (
        "pdserve up: error: router cannot listen on 192.0.2.1:0: Cannot assign requested "
        "address (192.0.2.1 is not an address of this machine); choose another with --host"
    ) in up.text, up.text
    assert "another process" not in up.text and "--port" not in up.text, up.text
    assert "started" not in up.text and _leftovers(tmp_path) == [], up.text


def _weightless_model(folder: Path) -> str:
    """A folder whose config resolves and which holds a ``*.safetensors`` file (so ``up``'s
    check before start passes) but no tokenizer: every worker fails at load, after start."""
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"junk, not a header")
    return str(folder)


def _failed_up(model: str, log_dir: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--model", model, "--port", "0"]
        + ["--num-threads", "1", "--log-dir", str(log_dir)],
        capture_output=True,
        text=True,
        timeout=250,
    )
    assert done.returncode == 1, done
    return done.stderr


@pytest.mark.timeout(600)
def test_a_reused_log_dir_shows_this_runs_error_only(tmp_path):
    """Two failed runs with one --log-dir: the second run's crash excerpt and log files
    hold its own error, not the first run's (the files are started fresh, not appended)."""
    log_dir = tmp_path / "logs"
    one, two = _weightless_model(tmp_path / "one"), _weightless_model(tmp_path / "two")
    first = _failed_up(one, log_dir)
    assert f"model '{one}'" in first, first
    second = _failed_up(two, log_dir)
    excerpt = second.split("last lines of its log", 1)[1]
    assert f"model '{two}'" in excerpt and "no usable tokenizer" in excerpt, second
    assert one not in second, second
    for log in log_dir.glob("*.log"):
        assert one not in log.read_text(), log

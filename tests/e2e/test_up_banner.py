"""What ``pdserve up`` and ``pdserve router`` print when they are ready: the banner of
``up`` names the model name the API takes (``--served-model-name`` when given), and its
``curl`` and Python examples work as printed against the running system; the router's
start line counts its workers in plain English."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import httpx
import pytest
from test_up_faults import Up

from pdserve_procs import TINY, free_port


def _banner(text: str) -> str:
    start = text.index("pdserve is ready at")
    return text[start : text.index("Press Ctrl-C to stop.", start)]


def _curl_example(banner: str) -> tuple[str, dict]:
    """(URL, JSON body) of the banner's curl command, read as a shell reads it."""
    line = re.search(r"^  (curl .*\\\n.*)$", banner, flags=re.M)
    assert line, banner
    words = shlex.split(line.group(1).replace("\\\n", " "))
    assert words[0] == "curl" and words[2:4] == ["-H", "Content-Type: application/json"], words
    assert words[4] == "-d" and len(words) == 6, words
    return words[1], json.loads(words[5])


def _python_example(banner: str) -> str:
    lines = banner.split("or in Python, with the official openai client:\n", 1)[1]
    return textwrap.dedent(lines)


@pytest.mark.timeout(400)
def test_banner_names_the_served_model_and_its_examples_work(tmp_path):
    up = Up(
        ["--model", TINY, "--served-model-name", "mymodel", "--port", "0"]
        + ["--log-dir", str(tmp_path)]
    )
    try:
        up.wait_line(r"Press Ctrl-C to stop\.", 300)
        banner = _banner(up.text)
        url = re.search(r"pdserve is ready at (http://\S+)", banner).group(1)
        assert f"(model mymodel, weights {TINY}; 1 prefill + 1 decode" in banner, banner
        # the curl example, sent as printed: the served name is the one the API takes
        endpoint, body = _curl_example(banner)
        assert endpoint == f"{url}/v1/chat/completions" and body["model"] == "mymodel", body
        reply = httpx.post(endpoint, json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "mymodel"
        assert httpx.post(endpoint, json={**body, "model": TINY}, timeout=120).status_code == 404
        # the Python example, run as printed with the official client
        code = _python_example(banner)
        assert 'model="mymodel"' in code, code
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (code, done.stderr)  # a 404 raises NotFoundError
        # the router's start line counts PD workers as such
        router_log = (tmp_path / "router.log").read_text()
        assert "(PD mode, 1 prefill + 1 decode workers, policy power_of_two)" in router_log
    finally:
        up.kill()
    assert up.popen.returncode == 0, up.text


def _router_start_line(args: list[str]) -> str:
    """The first line ``pdserve router`` prints (it starts serving even when its
    workers are down: they only fail its health checks)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "router", "--port", str(free_port()), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PDSERVE_ROUTER_ADMIN_TOKEN": ""},
    )
    try:
        assert proc.stdout is not None
        return proc.stdout.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@pytest.mark.timeout(200)
def test_router_start_line_counts_workers_in_plain_english(tmp_path):
    one, two = "http://127.0.0.1:1", "http://127.0.0.1:2"
    line = _router_start_line(["--worker", one])
    assert "(regular mode, 1 mixed worker, policy power_of_two)" in line, line
    line = _router_start_line(["--worker", one, "--worker", two])
    assert "(regular mode, 2 mixed workers, policy power_of_two)" in line, line
    token = tmp_path / "token"
    token.write_text("t" * 32)
    line = _router_start_line(["--mode", "pd", "--admin-token-file", str(token)])
    assert "(PD mode, 0 prefill + 0 decode workers, admin API on, policy" in line, line

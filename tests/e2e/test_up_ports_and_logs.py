"""``pdserve up`` as a user runs it: ``--port 0`` prints (and serves on) the port the
router bound, not ``:0``."""

from __future__ import annotations

import re
import signal

import httpx
import pytest
from test_up_faults import Up

from pdserve_procs import TINY


@pytest.mark.timeout(300)
def test_port_0_prints_the_port_the_router_listens_on(tmp_path):
    up = Up(["--model", TINY, "--port", "0", "--log-dir", str(tmp_path)])
    try:
        up.wait_line(r"pdserve is ready at", 240)
        url = re.search(r"pdserve is ready at (http://\S+)", up.text).group(1)
        port = int(url.rsplit(":", 1)[1])
        assert port != 0, up.text
        assert f"curl {url}/v1/chat/completions" in up.text, up.text
        # the router's own line names the port it bound
        router_log = (tmp_path / "router.log").read_text()
        assert f"on http://127.0.0.1:{port}" in router_log, router_log
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    finally:
        if up.popen.poll() is None:
            up.popen.send_signal(signal.SIGTERM)
        code = up.finish(60)
    assert code == 0, up.text

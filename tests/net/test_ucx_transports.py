"""UCX protocol-report parsing (the transport visibility of NIXL peers) and the
``doctor --peer`` argument; the live checks run in test_netns_pd.py."""

from __future__ import annotations

import logging
import os

import pytest

from pdserve.disagg.nixl.agent import ucx_transports
from pdserve.disagg.nixl.agent.ucx_transports import UcxTransportLog, parse_lines
from pdserve.disagg.nixl.peer_check import parse_peer

P = "[1796116864.044009] [vm:7826 :0]   "
Q = "[1796116864.079106] [vm:7826 :1]   "
WRITE_TABLE = [
    "+--------+-------------+-----------------------------------+",
    "| pdserve-prefill-ab12 inter-node cfg#1                    |",
    "| remote memory write by ucp_put* from host memory to host |",
    "+--------+-------------+-----------------------------------+",
    "| Range  | Description |              Config               |",
    "+--------+-------------+-----------------------------------+",
    "| 0..8k  | short       | tcp/eth0                          |",
    "| 8k..inf| zero-copy   | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |",
    "+--------+-------------+-----------------------------------+",
]
READ_TABLE = [
    "+--------+-------------+--------------+",
    "| pdserve-doctor-1 intra-node cfg#0   |",
    "| remote memory read by ucp_get*(multi) into host memory from host |",
    "+--------+-------------+--------------+",
    "| Range  | Description | Config       |",
    "| 0..inf | zero-copy   | cma/memory   |",
    "+--------+-------------+--------------+",
]


def test_tables_are_parsed_with_locality_config_and_transports_in_order():
    lines = [P + r for r in WRITE_TABLE] + [Q + r for r in READ_TABLE]
    tables, other = parse_lines(lines)
    assert other == []
    assert [(t.agent, t.locality, t.config) for t in tables] == [
        ("pdserve-prefill-ab12", "inter-node", "cfg#1"),
        ("pdserve-doctor-1", "intra-node", "cfg#0"),
    ]
    assert tables[0].operation.startswith("remote memory write")
    assert tables[0].transports == (
        "tcp/eth0",
        "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1",
    )
    assert tables[1].transports == ("cma/memory",)


def test_other_ucx_lines_are_kept_for_relaying_and_split_tables():
    warning = "[1796116864.1] [vm:7826 :0]  ucp_ep.c:1234 UCX  WARN  connection refused"
    lines = [P + r for r in WRITE_TABLE[:5]] + [warning] + [Q + r for r in READ_TABLE]
    tables, other = parse_lines(lines)
    assert other == [warning]
    assert [t.config for t in tables] == ["cfg#0"]  # the cut table is dropped (< 4 rows)


def test_the_log_reads_incrementally_relays_warnings_and_reports_each_config_once(tmp_path, caplog):
    log = UcxTransportLog(tmp_path / "ucx.log")
    path = log.path
    text = "".join(P + r + "\n" for r in WRITE_TABLE)
    path.write_text(text[:100])  # a line cut mid-way waits for its end
    with caplog.at_level(logging.INFO, logger=ucx_transports.__name__):
        assert log.poll() == []
        with open(path, "a") as f:
            f.write(text[100:] + "[1.0] [vm:1:0]  UCX  ERROR  no route to host\n")
        new = log.poll()
        assert [t.config for t in new] == ["cfg#1"]
        with open(path, "a") as f:
            f.write(text)  # the same table printed again (another thread): not new
        assert log.poll() == []
    assert "UCX: [1.0] [vm:1:0]  UCX  ERROR  no route to host" in caplog.text
    assert "inter-node endpoint cfg#1 of pdserve-prefill-ab12: remote memory write over" in (
        caplog.text
    )
    snap = log.snapshot()
    assert snap["log_file"] == str(path)
    assert [e["transports"][0] for e in snap["endpoints"]] == ["tcp/eth0"]
    log.close()
    assert not path.exists()
    log.close()  # idempotent


def test_install_leaves_a_users_ucx_settings_alone(monkeypatch, tmp_path):
    # Recorded as unset first, so teardown removes what install() sets (delenv of a name
    # that is not set records nothing: set it first).
    monkeypatch.setenv("UCX_PROTO_INFO", "")
    monkeypatch.delenv("UCX_PROTO_INFO")
    monkeypatch.delenv("UCX_LOG_FILE", raising=False)
    monkeypatch.setenv("UCX_LOG_FILE", "/dev/null")
    assert UcxTransportLog.install(str(tmp_path)) is None
    monkeypatch.delenv("UCX_LOG_FILE")
    log = UcxTransportLog.install(str(tmp_path))
    assert log is not None
    assert os.environ["UCX_PROTO_INFO"] == ucx_transports.PATTERN
    assert os.environ["UCX_LOG_FILE"] == str(log.path)


def test_parse_peer():
    assert parse_peer("198.18.0.2:8998") == ("198.18.0.2", 8998)
    assert parse_peer("prefill-0.pd.svc:8998") == ("prefill-0.pd.svc", 8998)
    assert parse_peer("[fd00::2]:8998") == ("fd00::2", 8998)
    for bad in ("198.18.0.2", ":8998", "h:0", "h:x", "h:70000"):
        with pytest.raises(ValueError, match="--peer"):
            parse_peer(bad)

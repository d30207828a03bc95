"""``pdserve bench transfer`` end to end on CPU (two processes, real NIXL): every row is
measured, decode's bytes equal prefill's, and the managed row is the managers' own
latency record of each room (so the harness's polling, which sleeps, adds nothing)."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.disagg.nixl.probe import nixl_problem


@pytest.mark.timeout(300)
def test_bench_transfer_moves_the_bytes_and_reports_every_row(tmp_path, capsys):
    problem = nixl_problem()
    if problem:
        pytest.fail(problem)  # CI has NIXL: fail, never skip
    out = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--model-shape", "smollm2-135m", "--prompt-len", "64"]
    argv += ["--pattern", "runs", "--run-len", "2", "--repeats", "2", "--json", str(out)]
    argv += ["--ab-env", "PDSERVE_DISAGGREGATION_PLANNED_POST=0"]  # the post path before
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["data_checked"] is True and r["pages"] == 4
    for row in ("nixl", "nixl_decode", "raw_nixl", "copy", "one_page", "one_page_decode"):
        assert len(r["times_s"][row]) == 2 and all(t > 0 for t in r["times_s"][row])
    assert r["ratio_to_raw_nixl"] == pytest.approx(
        r["median_s"]["raw_nixl"] / r["median_s"]["nixl"]
    )
    assert r["descriptors_posted"] == 4 and 1 <= r["descriptors_merged"] <= 4
    # the path stage by stage, in order, from the rooms' own timestamps (both processes)
    from pdserve.bench.transfer import STAGES

    for row in ("nixl", "one_page"):
        assert list(r["stages_s"][row]) == list(STAGES)
        # each in one process but notif_read (decode may read XferDone before prefill's
        # clock after send_notif)
        one_process = {k: v for k, v in r["stages_s"][row].items() if k != "notif_read"}
        assert all(v >= 0 for v in one_process.values()), r["stages_s"][row]
    # --ab-env: the request and the one-page request again every repeat, with it set
    ab = r["ab"]
    assert ab["env"] == "PDSERVE_DISAGGREGATION_PLANNED_POST=0"
    for row in ("nixl", "nixl_decode", "one_page", "one_page_decode"):
        assert len(ab["times_s"][row]) == 2 and all(t > 0 for t in ab["times_s"][row])
    assert ab["ratio"] == pytest.approx(r["median_s"]["copy"] / ab["median_s"]["nixl"])
    assert list(ab["stages_s"]["nixl"]) == list(STAGES)
    printed = capsys.readouterr().out
    assert "NIXL / raw NIXL" in printed and "with PDSERVE_DISAGGREGATION_PLANNED_POST=0" in printed
    assert "PDSERVE_DISAGGREGATION_PLANNED_POST" not in __import__("os").environ  # restored


@pytest.mark.parametrize("bad", ["PLANNED_POST=0", "PDSERVE_X", "=1"])
def test_ab_env_must_name_a_pdserve_variable(bad):
    from pdserve.bench.transfer_pool import TransferBenchConfig

    with pytest.raises(ValueError, match="ab_env"):
        TransferBenchConfig(ab_env=bad)
    assert TransferBenchConfig(ab_env="PDSERVE_X=").ab_env == "PDSERVE_X="

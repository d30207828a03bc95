"""Programmatic dependent launch of our Triton kernels (``pdserve/model/pdl.py``): when it is
asked for, and that every PDL-capable kernel builds for sm_90 with the grid-dependency
instructions exactly when ``PDL`` is set (no GPU needed: Triton's ahead-of-time compile)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.model import pdl


@pytest.fixture
def fresh_options():
    pdl._options.cache_clear()
    yield
    pdl._options.cache_clear()


def _on(device: str):
    return SimpleNamespace(device=torch.device(device))  # where a launch's tensors live


def test_pdl_is_on_by_default_and_only_on_cuda_sm90_without_the_interpreter(
    monkeypatch, fresh_options
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PDSERVE_TRITON_PDL", raising=False)
    assert pdl.launch_options(_on("cuda:0")) == {"PDL": True, "launch_pdl": True}  # default
    pdl._options.cache_clear()
    monkeypatch.setenv("PDSERVE_TRITON_PDL", "0")
    assert pdl.launch_options(_on("cuda:0")) == {"PDL": False}  # turned off
    pdl._options.cache_clear()
    monkeypatch.setenv("PDSERVE_TRITON_PDL", "1")
    assert pdl.launch_options(_on("cuda:0")) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch_options(_on("cuda")) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch_options(torch.zeros(1)) == {"PDL": False}  # CPU tensors never
    pdl._options.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 0))
    assert pdl.launch_options(_on("cuda:0")) == {"PDL": False}  # no grid control before sm_90
    pdl._options.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch_options(_on("cuda:0")) == {"PDL": False}  # the interpreter has none


@pytest.mark.timeout(600)
def test_every_pdl_kernel_builds_for_sm90_with_grid_control_exactly_when_asked(sm90_build):
    rows, log = sm90_build("--pdl", "--json", timeout=540)
    assert len(rows) == 2 * 10, log[-3000:]
    for row in rows:
        assert "error" not in row, row
        assert row["wait"] == row["launch_dependents"] == row["pdl"], row

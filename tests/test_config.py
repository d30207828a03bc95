"""EngineConfig.from_fields: the one builder of ``LLM(...)`` and the engine flags."""

from __future__ import annotations

import argparse

import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.server.engine_args import add_engine_args, engine_config_from_args


def test_from_fields_sends_each_name_to_the_part_that_declares_it():
    cfg = EngineConfig.from_fields(
        model="random:tiny",
        page_size=8,
        max_running_requests=3,
        tensor_parallel_size=2,
        gpu_ids=(0, 1),
    )
    assert cfg == EngineConfig(
        model=ModelConfig(model="random:tiny", tensor_parallel_size=2, gpu_ids=(0, 1)),
        cache=CacheConfig(page_size=8),
        scheduler=SchedulerConfig(max_running_requests=3),
    )
    assert EngineConfig.from_fields() == EngineConfig()


def test_from_fields_errors_name_the_field():
    with pytest.raises(TypeError, match="'page_sise'"):
        EngineConfig.from_fields(page_sise=8)
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig.from_fields(page_size=0)


def test_engine_flags_build_the_same_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--page-size", "8", "--tp", "3", "--max-running-requests", "5"])
    assert engine_config_from_args(args) == EngineConfig.from_fields(
        page_size=8, tensor_parallel_size=3, max_running_requests=5
    )
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()


def test_max_running_requests_defaults_by_device():
    """Unset, the engine resolves it from its device: 256 on CUDA (graphs up to it), 64 on
    CPU; read unresolved it is an error naming it, never a silent number."""
    from pdserve.config import default_max_running_requests
    from pdserve.engine.llm import LLM

    assert default_max_running_requests("cuda") == 256
    assert default_max_running_requests("cpu") == 64
    assert SchedulerConfig().max_running_requests is None
    with pytest.raises(ValueError, match="max_running_requests"):
        _ = SchedulerConfig().max_running
    assert SchedulerConfig(max_running_requests=3).max_running == 3
    llm = LLM("random:tiny", device="cpu", num_pages=16)
    try:
        assert llm.engine.config.scheduler.max_running_requests == 64
    finally:
        llm.shutdown()


def test_tp_timeout_is_read_from_the_env_when_the_config_is_built(monkeypatch):
    """PDSERVE_TP_TIMEOUT is read once, at the config (the process edge); the executor only
    reads ``ModelConfig.tp_timeout``.  A value that is not > 0 fails naming the field."""
    monkeypatch.delenv("PDSERVE_TP_TIMEOUT", raising=False)
    assert ModelConfig().tp_timeout == 120.0
    monkeypatch.setenv("PDSERVE_TP_TIMEOUT", "7.5")
    cfg = EngineConfig.from_fields(tensor_parallel_size=2)
    monkeypatch.setenv("PDSERVE_TP_TIMEOUT", "99")  # later changes do not reach a built config
    assert cfg.model.tp_timeout == 7.5
    assert EngineConfig.from_fields(tp_timeout=3.0).model.tp_timeout == 3.0
    with pytest.raises(ValueError, match="tp_timeout must be > 0"):
        ModelConfig(tp_timeout=0)
    monkeypatch.setenv("PDSERVE_TP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="PDSERVE_TP_TIMEOUT"):
        ModelConfig()

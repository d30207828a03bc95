"""`pdserve env` lists every declared environment variable with its current value."""

from pdserve import envs
from pdserve.cli import main


def test_env_lists_every_variable_with_current_value(monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "/tmp/somewhere-else")
    monkeypatch.delenv("PDSERVE_LOG_LEVEL", raising=False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for var in envs.ALL:
        assert var.name in out, var.name
    assert "PDSERVE_CACHE_DIR  (set: '/tmp/somewhere-else'" in out
    assert "PDSERVE_LOG_LEVEL  (unset; default 'INFO')" in out

"""Name registry of KV transfer backends; each backend module is imported only when chosen."""

from __future__ import annotations

import importlib

from pdserve.disagg.base import KVArgs, KVManager, pd_role
from pdserve.ports import check_port

# name -> (module, factory function(args, role, bootstrap_host=, bootstrap_port=) -> KVManager)
_BACKENDS: dict[str, tuple[str, str]] = {
    "nixl": ("pdserve.disagg.nixl.factory", "create_nixl_manager"),
    "fake": ("pdserve.disagg.fake", "FakeKVManager"),
}


def backend_names() -> tuple[str, ...]:
    """The names ``create_kv_manager`` takes (the ``transfer_backend`` choices)."""
    return tuple(_BACKENDS)


def create_kv_manager(
    name: str,
    args: KVArgs,
    role: str,
    *,
    bootstrap_host: str = "127.0.0.1",
    bootstrap_port: int = 0,
    advertise_host: str | None = None,
) -> KVManager:
    """Create the KV manager of backend ``name`` (``"nixl"`` or ``"fake"``) for ``role``
    (``"prefill"`` or ``"decode"``) over the memory described by ``args``.

    bootstrap_host/bootstrap_port: where a prefill manager's bootstrap server listens
    (port 0 picks a free port; read it back from ``manager.bootstrap_port``); decode
    ignores them. advertise_host: the address decode peers reach it by (``None``: derived
    from ``bootstrap_host``, see :mod:`pdserve.advertise`). Raises ValueError naming ``name`` or ``role`` when unknown; a NIXL
    backend that cannot start raises its own error (ValueError for bad parameters,
    TimeoutError naming the call, or NIXL's exception).
    """
    if name not in _BACKENDS:
        raise ValueError(f"transfer backend name must be one of {sorted(_BACKENDS)}, got {name!r}")
    pd = pd_role(role)
    check_port(bootstrap_port, "bootstrap_port", allow_zero=True)
    module_name, attr = _BACKENDS[name]
    factory = getattr(importlib.import_module(module_name), attr)
    if name == "fake":
        return factory(args, pd)
    return factory(
        args,
        pd,
        bootstrap_host=bootstrap_host,
        bootstrap_port=bootstrap_port,
        advertise_host=advertise_host,
    )

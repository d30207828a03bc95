"""Name registry of KV transfer backends; each backend module is imported only when chosen."""

from __future__ import annotations

import importlib

from pdserve.disagg.base import KVArgs, KVManager, pd_role
from pdserve.disagg.transfer_config import TransferConfig

# name -> (module, factory function(args, role[, cfg]) -> KVManager)
_BACKENDS: dict[str, tuple[str, str]] = {
    "nixl": ("pdserve.disagg.nixl.factory", "create_nixl_manager"),
    "fake": ("pdserve.disagg.fake", "FakeKVManager"),
}


def backend_names() -> tuple[str, ...]:
    """The names ``create_kv_manager`` takes (the ``transfer_backend`` choices)."""
    return tuple(_BACKENDS)


def create_kv_manager(
    name: str, args: KVArgs, role: str, cfg: TransferConfig | None = None
) -> KVManager:
    """Create the KV manager of backend ``name`` (``"nixl"`` or ``"fake"``) for ``role``
    (``"prefill"`` or ``"decode"``) over the memory described by ``args``.

    cfg: the worker's transfer settings, built at the process edge
    (:meth:`TransferConfig.from_env`): the bootstrap address (port 0 picks a free port;
    read it back from ``manager.bootstrap_port``), timeouts, the NIXL agent's spec. The
    ``nixl`` backend needs it; ``fake`` has no settings and ignores it. Raises ValueError
    naming ``name``, ``role`` or ``cfg`` when unknown or missing; a NIXL backend that
    cannot start raises its own error (ValueError for bad parameters, TimeoutError
    naming the call, or NIXL's exception).
    """
    if name not in _BACKENDS:
        raise ValueError(f"transfer backend name must be one of {sorted(_BACKENDS)}, got {name!r}")
    pd = pd_role(role)
    module_name, attr = _BACKENDS[name]
    factory = getattr(importlib.import_module(module_name), attr)
    if name == "fake":
        return factory(args, pd)
    if cfg is None:
        raise ValueError(f"the {name} transfer backend needs a TransferConfig (cfg)")
    return factory(args, pd, cfg)

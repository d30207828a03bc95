"""Entry point of the ``nixl`` backend for :func:`pdserve.disagg.registry.create_kv_manager`."""

from __future__ import annotations

from pdserve.disagg.base import KVArgs, KVManager, Role, pd_role
from pdserve.disagg.nixl.agent.api import load_nixl_api
from pdserve.disagg.transfer_config import TransferConfig


def create_nixl_manager(args: KVArgs, role: str, cfg: TransferConfig) -> KVManager:
    """A prefill or decode NIXL manager over ``args`` with the settings ``cfg`` (see
    :mod:`.prefill.manager`, :mod:`.decode.manager`). Raises NixlUnavailableError when
    NIXL cannot be imported."""
    role = pd_role(role)
    api = load_nixl_api()
    if role == Role.PREFILL:
        from pdserve.disagg.nixl.prefill.manager import NixlPrefillManager

        return NixlPrefillManager(args, cfg, api=api)
    from pdserve.disagg.nixl.decode.manager import NixlDecodeManager

    return NixlDecodeManager(args, cfg, api=api)

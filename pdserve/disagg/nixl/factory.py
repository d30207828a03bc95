"""Entry point of the ``nixl`` backend for :func:`pdserve.disagg.registry.create_kv_manager`."""

from __future__ import annotations

from pdserve.disagg.base import KVArgs, KVManager, Role, pd_role
from pdserve.disagg.nixl.agent.api import load_nixl_api


def create_nixl_manager(
    args: KVArgs,
    role: str,
    *,
    bootstrap_host: str = "127.0.0.1",
    bootstrap_port: int = 0,
    advertise_host: str | None = None,
) -> KVManager:
    """A prefill or decode NIXL manager over ``args`` (see :mod:`.prefill.manager`, :mod:`.decode.manager`).
    Raises NixlUnavailableError when NIXL cannot be imported."""
    api = load_nixl_api()
    if pd_role(role) == Role.PREFILL:
        from pdserve.disagg.nixl.prefill.manager import NixlPrefillManager

        return NixlPrefillManager(
            args,
            bootstrap_host=bootstrap_host,
            bootstrap_port=bootstrap_port,
            advertise_host=advertise_host,
            api=api,
        )
    from pdserve.disagg.nixl.decode.manager import NixlDecodeManager

    return NixlDecodeManager(args, api=api)

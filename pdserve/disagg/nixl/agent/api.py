"""The one module that imports NIXL (``nixl._api``), lazily, on first use.

Everything else gets the API object from :func:`load_nixl_api`, so tests can hand in a
fake one and a machine without NIXL fails with one clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NixlApi:
    """The parts of NIXL pdserve uses: ``nixl_agent(name, config)``,
    ``nixl_agent_config(...)``, the ``nixl_thread_sync_t`` enum, and the package version."""

    nixl_agent: Any
    nixl_agent_config: Any
    nixl_thread_sync_t: Any
    version: str


class NixlUnavailableError(ImportError):
    """NIXL cannot be imported here; the message says why and how to install it."""


def load_nixl_api() -> NixlApi:
    """Import NIXL. Raises NixlUnavailableError (with the import error) when it is missing."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except Exception as exc:  # ImportError, or a broken native library (OSError)
        raise NixlUnavailableError(
            f"NIXL cannot be imported ({type(exc).__name__}: {exc}); install it with "
            "`pip install nixl-cu13==1.5.1 && pip install --no-deps nixl==1.5.1`"
        ) from exc
    try:
        from importlib.metadata import version

        ver = version("nixl")
    except Exception:  # noqa: BLE001 - only informative
        ver = "unknown"
    return NixlApi(nixl_agent, nixl_agent_config, nixl_thread_sync_t, ver)

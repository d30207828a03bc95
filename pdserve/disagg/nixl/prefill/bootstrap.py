"""How one prefill rank is found by decode: the worker's HTTP bootstrap server and the
rank's registration there.

Rank 0 runs the bootstrap server (:class:`~pdserve.disagg.bootstrap.BootstrapServer`,
on ``bootstrap_host:bootstrap_port``, port 0 = a free one); every rank, rank 0 too,
registers its :class:`~pdserve.disagg.wire.RankInfo` there over HTTP, ranks >= 1 at
the port of rank 0 they are given. Decode reads ``/route/{rank}`` and heartbeats
``/health``, which lists every registered rank's instance id; a rank whose process died
is deregistered (:meth:`PrefillBootstrap.forget_rank`), so decode knows it gone.
"""

from __future__ import annotations

import base64
from collections.abc import Callable

from pdserve.disagg.base import PROTOCOL_VERSION
from pdserve.disagg.bootstrap import BootstrapClient, BootstrapServer
from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine
from pdserve.disagg.wire import HealthInfo, RankInfo
from pdserve.parallel import TPRank
from pdserve.ports import check_port


class PrefillBootstrap:
    """One prefill rank's side of the bootstrap (module doc).

    rank: this rank; host: where rank 0's server listens (and where every rank registers);
    port: rank 0's port to bind (0 = free), for a rank >= 1 the port of rank 0's server;
    health: ``/health``'s answer (rank 0). ValueError naming ``bootstrap_port`` when a
    rank >= 1 is given no usable port.
    """

    def __init__(
        self, rank: TPRank, host: str, port: int, health: Callable[[], HealthInfo]
    ) -> None:
        self.rank = rank
        self.host = host
        self._server: BootstrapServer | None = None
        self._port: int | None = None
        if rank.rank == 0:
            self._server = BootstrapServer(host, port, health)
        else:  # rank >= 1 registers at rank 0's bootstrap server: a peer's port
            self._port = check_port(
                port, f"bootstrap_port (rank 0's, for rank {rank.rank})", allow_zero=False
            )

    @property
    def port(self) -> int | None:
        """The bootstrap server's port (rank 0: once :meth:`serve` bound it)."""
        return self._port

    def serve(self) -> int:
        """Rank 0: start the server (OSError naming the port when it is taken). Returns
        the bootstrap port (any rank)."""
        if self._server is not None:
            self._port = self._server.start()
        assert self._port is not None  # rank 0 bound it; other ranks were given it
        return self._port

    def register(self, info: RankInfo) -> None:
        """Register this rank's info at the server over HTTP (rank 0 too);
        BootstrapError when the server does not take it."""
        assert self._port is not None, "serve() first"
        client = BootstrapClient()
        try:
            client.register(self.host, self._port, info)
        finally:
            client.close()

    def serving(self) -> bool:
        """False once rank 0's server thread ended (always True on other ranks)."""
        return self._server is None or self._server.is_alive()

    def forget_rank(self, engine_rank: int) -> None:
        """Rank 0: deregister ``engine_rank`` (its process died); a no-op on other ranks."""
        if self._server is not None:
            self._server.deregister(engine_rank)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


def rank_info(
    instance_id: str, engine: NixlTransferEngine, control_endpoint: str, tp_size: int
) -> RankInfo:
    """The :class:`RankInfo` a prefill rank registers: its protocol version, instance,
    rank, NIXL agent (name, metadata base64), control endpoint, KV layout, buffer
    descriptors, TP size and the KV heads it holds."""
    args = engine.kv_args
    return RankInfo(
        PROTOCOL_VERSION,
        instance_id,
        args.engine_rank,
        engine.name,
        base64.b64encode(engine.metadata()).decode(),
        control_endpoint,
        args.layout.to_dict(),
        engine.kv_descs,
        engine.aux_descs,
        tp_size,
        list(args.kv_heads),
    )

"""A child of ``pdserve up`` ends when ``up`` is gone.

``up`` stops its children on Ctrl-C, SIGTERM and its own failures, but a ``kill -9`` of
``up`` cannot be caught, and its children (each in its own process group) would serve on,
orphaned, holding their ports and the GPU. ``up`` names itself in each child's
``PDSERVE_SUPERVISOR_PID``; :func:`watch_supervisor` in the child then checks once a
second that this process is still the child's parent, and when it is not (the child was
handed to init or a subreaper), sends the child SIGTERM: the same orderly stop as from
``up``. A process started by hand (no variable) is never watched.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from pdserve import envs

log = logging.getLogger(__name__)


def watch_supervisor(interval_s: float = 1.0) -> threading.Thread | None:
    """Start the daemon thread that SIGTERMs this process once its supervisor (the pid in
    ``PDSERVE_SUPERVISOR_PID``) is no longer its parent; None (nothing started) when the
    variable is unset or 0. Raises ``ValueError`` naming the variable when it is not a pid."""
    pid = envs.SUPERVISOR_PID.get()
    if pid <= 0:
        return None
    if os.getppid() != pid:  # already gone (or never the parent): stop now
        log.warning("pdserve up (pid %d) is gone: stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)
        return None
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval_s):
            if os.getppid() != pid:
                log.warning("pdserve up (pid %d) is gone: stopping", pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="pdserve-supervisor-watch", daemon=True)
    thread.start()
    return thread

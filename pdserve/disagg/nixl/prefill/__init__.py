"""The prefill side of the NIXL backend: its manager, one sender per room, the transfer
threads that post the WRITEs, its decode peers and its bootstrap server."""

"""Benchmarks: ``pdserve bench offline`` (engine), ``transfer`` (KV transfer), ``serve`` (HTTP load)."""

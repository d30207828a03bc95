"""Llama-family model, paged attention and weight sources (see docs/architecture.md)."""

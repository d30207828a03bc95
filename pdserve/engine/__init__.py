"""The engine: paged KV pool, continuous-batching scheduler, model runner, sampling,
stop checks, detokenizer, ``EngineCore`` and the offline ``LLM`` (see docs/architecture.md)."""

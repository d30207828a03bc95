"""The engine, in two sides (see docs/architecture.md): ``core/`` runs once per worker on the
engine thread (``EngineCore``, scheduler, requests and their outputs, overlap, the PD flow,
stops and the detokenizer); ``worker/`` runs on every rank (executors, rank worker, model
runner and its staging, CUDA graphs, sampler); ``kv/`` holds the page layout, ids and their
owner; ``step.py`` is the plain data that crosses between them.  ``llm.py`` (the offline
``LLM``), ``sampling_params.py`` and ``structured/`` face the requests."""

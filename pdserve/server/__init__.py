"""The worker process: FastAPI app (OpenAI API, native ``/generate``, health, metrics) in
front of an engine thread (``AsyncEngine``)."""

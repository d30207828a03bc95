"""The engine thread, once per worker: the step loop (``engine.py``), the scheduler and its
requests, overlap scheduling, the PD flow, stops and detokenization.  It reaches the ranks
through ``worker.executor`` alone and exchanges only ``engine/step.py``'s plain data."""

"""Speculative decoding: drafters (``drafter.py``: the interface and the n-gram drafter)
and the acceptance rules of the verify step (``verify.py``)."""

"""pdserve: LLM serving with prefill/decode disaggregation over NIXL.

The offline API is ``from pdserve import LLM, SamplingParams`` (imported lazily so that
``import pdserve`` does not pull in torch).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name in ("SamplingParams",):
        from pdserve.engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pdserve.engine.core import request

        return getattr(request, name)
    raise AttributeError(name)

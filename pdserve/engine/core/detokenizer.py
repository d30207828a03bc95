"""Incremental detokenization with stop strings (OpenAI semantics) for one request.

Text is produced with ``tokenizers``' ``DecodeStream`` (it buffers tokens until they form
valid UTF-8, so a delta never holds half a character), primed with the last prompt
tokens so the first output token's leading space decodes as it does in context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens used as decoding context for the first output tokens (vLLM uses 5 too).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Accumulates one request's output text token by token and detects stop strings.

    tokenizer: a ``transformers`` fast tokenizer (``backend_tokenizer`` is used).
    stop: stop strings; when one appears in the text, the text is cut just before it.
    The streamable text holds back ``max(len(stop)) - 1`` characters until the request
    finishes, so a stop string split across tokens never leaks into a delta.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool,
        stop: Sequence[str] = (),
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT:]), skip_special_tokens=skip_special_tokens
        )
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._emitted = 0

    def add_token(self, token_id: int, *, check_stop: bool) -> str | None:
        """Append one output token's text.  Returns the stop string that now ends the
        text (the text is cut before it) if ``check_stop`` and one matched, else None."""
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        if not check_stop or not self._stop:
            self.text += piece
            return None
        # a stop string may start in the held-back tail of the text before this piece
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out that is safe to show (all of it once finished)."""
        text = self.text
        end = len(text)
        if not finished and self._hold:
            end = max(self._emitted, end - self._hold)
        if end == self._emitted:
            return ""
        delta = text[self._emitted : end]
        self._emitted = end
        return delta

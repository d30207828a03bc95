"""The grammar library behind structured outputs: xgrammar.

Chosen by measurement (``pdserve bench grammar``; figures in docs/benchmarks.md): at the
embedded model's vocabulary (49,152 ids) on CPU, xgrammar fills a token mask in ~10 us
per request (its token-mask cache is built at compile time) against ~40-60 us for
llguidance, and both are far below 1% of a decode step; xgrammar is also what vLLM and
SGLang use by default, so the same schema constrains the same way here.
``import xgrammar`` appears in this module only.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch

from pdserve.engine.structured.params import StructuredOutputsParams

_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices`` (each escaped literally)."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def json_schema_problem(schema: Any) -> str | None:
    """Why ``schema`` (a decoded JSON value) is not valid JSON Schema, checked against its
    meta-schema with ``jsonschema`` (``"<message> (at <path>)"``), or None when it is."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return f"{exc.message} (at {where})"
    return None


def _check_schema(spec: StructuredOutputsParams) -> None:
    """ValueError naming ``spec.field`` for a schema that is not valid JSON Schema
    (:func:`json_schema_problem`, before xgrammar sees it)."""
    import json

    assert isinstance(spec.json, str)  # StructuredOutputsParams stores the schema as JSON text
    problem = json_schema_problem(json.loads(spec.json))
    if problem is not None:
        raise ValueError(f"{spec.field} is not a valid JSON schema: {problem}")


class XGrammarBackend:
    """Compiles constraints for one tokenizer and makes matchers (thread-safe compile).

    tokenizer: the Hugging Face tokenizer; vocab_size: the model's logits width (may
    exceed the tokenizer's: the extra ids are never allowed); stop_token_ids: the
    engine's EOS ids, the only tokens allowed once the grammar is complete.
    Building the tokenizer info takes ~1.5 s for a 49k vocabulary, so it happens on the
    first compile, not at start-up.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._batcher: Any = None

    def _get_compiler(self) -> Any:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``; ValueError naming ``spec.field`` when the
        schema, regex or grammar is not accepted (the library's message included)."""
        compiler = self._get_compiler()
        kind = spec.kind
        if kind == "json":
            _check_schema(spec)
        try:
            if kind == "json":
                # One line, ", " / ": " separators: no free whitespace a small model could
                # loop in.
                return compiler.compile_json_schema(
                    spec.json, any_whitespace=False, strict_mode=spec.strict
                )
            if kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_regex(choice_regex(spec.choice or ()))
            return compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # noqa: BLE001 xgrammar raises RuntimeError/ValueError/...
            what = {"json": "JSON schema", "json_object": "JSON", "grammar": "EBNF grammar"}
            text = str(exc).strip() or type(exc).__name__
            # "[09:39:19] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> the error
            first = _LOG_PREFIX.sub("", text.splitlines()[0])
            raise ValueError(
                f"{spec.field} is not a valid {what.get(kind, 'regex')}: {first}"
            ) from None

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the start of the output."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        """Row ``i`` of the CPU ``bitmask[B, W]`` int32 := the tokens ``matchers[i]``
        allows next (batched over threads when there are several)."""
        import xgrammar as xgr

        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
            return
        if self._batcher is None:
            self._batcher = xgr.BatchGrammarMatcher()
        self._batcher.batch_fill_next_token_bitmask(list(matchers), bitmask)

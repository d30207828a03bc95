"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) compiled once per
tokenizer and cached, one matcher per request, and the batched token mask they give the
sampler (``bitmask.py``)."""

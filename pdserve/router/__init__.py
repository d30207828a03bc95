"""The router: OpenAI + native API in front of prefill/decode pairs (PD mode) or mixed
workers (regular mode). Talks to workers over HTTP only."""

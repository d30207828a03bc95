"""Accuracy evaluations against a serving URL: ``pdserve eval gsm8k``."""

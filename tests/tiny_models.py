"""Tiny random transformers models for tests (importable from every test folder: pyproject's
pytest ``pythonpath`` holds ``tests``)."""

from __future__ import annotations

import torch
import transformers


def random_tiny_model(
    config: transformers.PretrainedConfig, seed: int = 0
) -> transformers.PreTrainedModel:
    """A transformers model of ``config`` in fp32 with EVERY parameter random (std 0.1; norm
    weights 1 + N(0, 0.1)), so a wrong bias, norm or rotation shows in the logits and greedy
    choices are clear. Returned in eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model.eval()

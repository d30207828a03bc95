"""The embedded SmolLM2-135M-Instruct: cached conversion, tokenizer, logits vs. transformers' GGUF load."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.model import gguf_reader
from pdserve.model.attention import build_attention_metadata
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import load_model_source


def _forbid_gguf_reads(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_reader, "file_sha256", boom)
    monkeypatch.setattr(gguf_reader, "_convert", boom)


@pytest.mark.timeout(240)
def test_fresh_conversion_cached_and_matches_transformers_gguf(
    tmp_path, monkeypatch, capfd, embedded_source
):
    """Convert into an empty cache (spying on transformers' GGUF load to reuse it as the
    reference), check the cache layout and reuse, then compare logits with that GGUF model."""
    loaded = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    src = load_model_source("smollm2-135m-instruct")
    assert "converting" in capfd.readouterr().err  # the one-time progress line
    assert len(loaded) == 1 and loaded[0].config.model_type == "llama"
    root = tmp_path / "gguf"
    entries = sorted(
        p.name
        for p in root.iterdir()
        if not p.name.startswith(".") or p.name.startswith(".convert")
    )
    assert len(entries) == 2 and "by-stat" in entries, entries  # no temporary folder left behind
    folder = root / next(e for e in entries if e != "by-stat")
    assert folder.name.startswith(
        "SmolLM2-135M-Instruct.Q4_1-b179c952"
    )  # keyed by the GGUF's sha256
    assert {"config.json", "model.safetensors", "tokenizer.json", gguf_reader.MANIFEST} <= set(
        os.listdir(folder)
    )
    # same weights -> same fingerprint, whichever cache the copy came from (another process)
    assert src.fingerprint == embedded_source.fingerprint

    _forbid_gguf_reads(monkeypatch)
    again = load_model_source("smollm2-135m-instruct")
    assert "converting" not in capfd.readouterr().err
    assert again.fingerprint == src.fingerprint
    check_logits_against(loaded[0].eval(), again)


def test_embedded_tokenizer_and_eos(embedded_source):
    tok = embedded_source.tokenizer
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert tok.eos_token_id in embedded_source.eos_token_ids
    assert len(set(embedded_source.eos_token_ids)) == len(embedded_source.eos_token_ids)
    cfg = embedded_source.hf_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 30, 49152)


def check_logits_against(hf, embedded_source):
    """Prefill a chat prompt and greedy-decode 3 tokens through a scattered paged cache;
    every step's log-probs must match ``hf`` (fp32) within 1e-4."""
    model = LlamaForCausalLM(embedded_source.hf_config, torch.float32, "cpu")
    model.load_weights(embedded_source.weights())
    tok = embedded_source.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = torch.tensor(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    s, page_size = model.shapes, 16
    lay = KVCacheLayout(
        "page_major", s.n_layers, s.n_kv_heads, s.head_dim, page_size, 8, model.dtype
    )
    kv = lay.layer_views(lay.allocate("cpu"))
    table = [[5, 2, 7, 0, 3]]
    n = len(ids)
    md = build_attention_metadata([n], [n], table, page_size)
    lp = torch.log_softmax(
        model.compute_logits(model(ids, torch.arange(n), md, kv)), -1
    )  # every prompt row
    seq = ids
    for step in range(4):  # prefill, then greedy decode through the paged cache
        with torch.no_grad():
            ref = torch.log_softmax(hf(seq[None]).logits[0, -len(lp) :].float(), -1)
        assert (lp - ref).abs().max().item() < 1e-4, f"step {step}"
        if step == 3:
            break
        nxt = lp[-1:].argmax(-1)
        seq = torch.cat([seq, nxt])
        md = build_attention_metadata([1], [len(seq)], table, page_size)
        lp = torch.log_softmax(
            model.compute_logits(model(nxt, torch.tensor([len(seq) - 1]), md, kv)), -1
        )

"""GGUF -> cached Hugging Face folder (safetensors + config + tokenizer), converted once.

transformers reads and dequantises the GGUF (``from_pretrained(dir, gguf_file=name)``); we
save the fp32 state dict, config, tokenizer (with its chat template) and generation config
under ``envs.CACHE_DIR/gguf/<stem>-<sha256[:16]>/``, written to a temporary folder and renamed
into place, so concurrent workers never see a half-written copy. A pointer keyed by the
file's path, size and mtime finds the copy later without reading the GGUF again.

transformers' GGUF config mapping drops ``qwen3moe.expert_feed_forward_length`` (each
expert's intermediate size), so a Qwen3-MoE GGUF would get the config default (768, right
for Qwen3-30B-A3B only); :func:`gguf_config` reads it from the file's metadata.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from pdserve import envs

MANIFEST = "pdserve-source.json"


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    """Hex sha256 of the whole file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stat_key(path: str) -> str:
    st = os.stat(path)
    return hashlib.sha256(
        f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()
    ).hexdigest()[:24]


def _write_atomic(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# GGUF architecture -> (metadata key suffix, config field) that transformers does not map.
_MISSING_KEYS = {"qwen3moe": (("expert_feed_forward_length", "moe_intermediate_size"),)}


def gguf_config(gguf_path: str) -> Any:
    """The transformers config of the GGUF at ``gguf_path`` (metadata only, no tensors),
    with the fields of :data:`_MISSING_KEYS` read from the file. Raises what transformers
    raises for an unsupported GGUF."""
    import transformers

    directory, fname = os.path.split(os.path.abspath(gguf_path))
    cfg = transformers.AutoConfig.from_pretrained(directory, gguf_file=fname)
    fixes = _MISSING_KEYS.get(cfg.model_type.replace("_", ""), ())
    if fixes:
        from gguf import GGUFReader

        fields = GGUFReader(gguf_path).fields
        arch = str(fields["general.architecture"].contents())
        for key, attr in fixes:
            field = fields.get(f"{arch}.{key}")
            if field is not None:
                setattr(cfg, attr, int(field.contents()))
    return cfg


def find_cached_gguf_dir(gguf_path: str) -> str | None:
    """The cached HF folder of ``gguf_path`` if a complete one exists (stats the GGUF, never
    reads it), else ``None``. Raises ``ValueError`` when the file does not exist."""
    if not os.path.isfile(gguf_path):
        raise ValueError(f"model {gguf_path!r}: GGUF file not found")
    root = os.path.join(envs.CACHE_DIR.get(), "gguf")
    pointer = os.path.join(root, "by-stat", _stat_key(gguf_path))
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        target = os.path.join(root, f.read().strip())
    return target if os.path.isfile(os.path.join(target, MANIFEST)) else None


def cached_gguf_dir(gguf_path: str) -> str:
    """Return the cached HF folder of ``gguf_path``, converting it first when needed.

    The first call for a file prints one progress line and takes ~20 s for SmolLM2-135M;
    later calls only stat the GGUF. Raises ``ValueError`` when the file does not exist, does
    not start with the GGUF magic, or transformers cannot convert it (the message names the
    file).
    """
    found = find_cached_gguf_dir(gguf_path)
    if found is not None:
        return found
    with open(gguf_path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":  # before the hash, the lock file and the "converting" line
        raise ValueError(
            f"model {gguf_path!r}: not a GGUF file (it starts with {magic!r}, not b'GGUF')"
        )
    root = os.path.join(envs.CACHE_DIR.get(), "gguf")
    os.makedirs(os.path.join(root, "by-stat"), exist_ok=True)
    pointer = os.path.join(root, "by-stat", _stat_key(gguf_path))
    sha = file_sha256(gguf_path)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    name = f"{stem}-{sha[:16]}"
    target = os.path.join(root, name)
    with open(os.path.join(root, f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter per file; others wait, then reuse
        if not os.path.isfile(os.path.join(target, MANIFEST)):
            _convert(gguf_path, sha, root, target)
    _write_atomic(pointer, name)
    return target


def _convert(gguf_path: str, sha: str, root: str, target: str) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    t0 = time.monotonic()
    print(
        f"pdserve: converting {gguf_path} to safetensors under {target} (one-time, ~20 s)...",
        file=sys.stderr,
        flush=True,
    )
    directory, fname = os.path.split(os.path.abspath(gguf_path))
    tmp = tempfile.mkdtemp(dir=root, prefix=".convert-")
    try:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=fname)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=fname, config=gguf_config(gguf_path), dtype=torch.float32
            )
        except Exception as exc:  # transformers raises many types for unsupported GGUFs
            raise ValueError(
                f"model {gguf_path!r}: transformers could not read this GGUF: {exc}"
            ) from exc
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the copy is plain fp32, not GGUF-quantised
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop(
                "lm_head.weight", None
            )  # shared with embed_tokens; safetensors refuses aliases
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            os.path.join(tmp, "model.safetensors"),
            metadata={"format": "pt"},
        )
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        manifest = {
            "gguf_sha256": sha,
            "gguf_size": os.path.getsize(gguf_path),
            "gguf_name": fname,
            "transformers_version": transformers.__version__,
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        if os.path.isdir(target):  # a stale, manifest-less folder from a crashed run
            shutil.rmtree(target)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        os.rename(tmp, target)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"pdserve: converted in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)

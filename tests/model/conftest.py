"""Fixtures of the model tests: the embedded model source (converted once per cache dir) and
tiny random transformers models saved to disk.

The converted embedded copy lives under ``PDSERVE_CACHE_DIR`` (default ``~/.cache/pdserve``),
shared with every other test and process; on a clean machine the first load converts it.
On a machine without CUDA, ``TRITON_INTERPRET=1`` is set for Triton's CPU interpreter.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch
import transformers

# Without a GPU the triton backend's kernels run under Triton's interpreter; the variable is
# read when a kernel is defined, so it is set before any test imports the backend.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton_interp

    triton_interp.install()  # the interpreter without its redundant re-patching

from pdserve.model.loader import embedded_tokenizer, load_model_source
from tiny_models import random_tiny_model

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)

TINY_CONFIGS = {
    # GQA 4/2, tied embeddings, Llama 3.1 rope scaling (original context small so it matters)
    "llama": lambda: transformers.LlamaConfig(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    # q/k/v bias, untied lm_head, GQA 4/1
    "qwen2": lambda: transformers.Qwen2Config(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # per-head q/k RMSNorm, head_dim 32 != hidden / heads
    "qwen3": lambda: transformers.Qwen3Config(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}


@pytest.fixture(scope="session")
def embedded_source():
    """``ModelSource`` of the embedded SmolLM2-135M-Instruct (converts on first use)."""
    return load_model_source("smollm2-135m-instruct")


def build_tiny_hf(arch: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random transformers model of ``arch``; every parameter random (biases and norm
    weights included, std 0.1) so a wrong bias, norm or rotation shows in the logits."""
    return random_tiny_model(TINY_CONFIGS[arch](), seed)


@pytest.fixture(scope="session")
def tiny_hf_builder():
    """``build_tiny_hf`` as a fixture (test modules cannot import conftest)."""
    return build_tiny_hf


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir(arch)`` -> (folder with the saved model + SmolLM2 tokenizer, the HF model);
    ``tiny_dir(name, config, seed)``: the same of another config (test_moe.py's).

    Only the tokenizer is needed (``embedded_tokenizer``), so the GPU machine, which has the
    saved tokenizer folder but not the embedded GGUF package, runs these tests too."""
    cache: dict[str, tuple[str, transformers.PreTrainedModel]] = {}

    def get(arch: str, config: transformers.PretrainedConfig | None = None, seed: int = 0):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            model = build_tiny_hf(arch) if config is None else random_tiny_model(config, seed)
            model.save_pretrained(folder)
            embedded_tokenizer().save_pretrained(folder)
            cache[arch] = (str(folder), model)
        return cache[arch]

    return get


SM90_SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "sm90_build_check.py"
SM90_SERVE_END = "-- sm90_build_check: done --"  # the script's SERVE_END (not importable here:
# it refuses TRITON_INTERPRET, which this file sets)


class Sm90Build:
    """``scripts/sm90_build_check.py`` for a test process's sm_90 build checks, in one
    process (its ``--serve``; started at the first call): torch and Triton imported once, not
    once a call (~3 CPU s each). Run with ``TRITON_INTERPRET`` unset (Triton compiles)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    def _start(self) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self._lines = queue.Queue()  # a new one: nothing left over from a process killed
        proc = subprocess.Popen(
            [sys.executable, str(SM90_SCRIPT), "--serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        lines = self._lines

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)  # the process ended

        threading.Thread(target=read, daemon=True, name="sm90-build-check").start()
        return proc

    def __call__(self, *args: str, timeout: float) -> tuple[list[dict], str]:
        """The rows (JSON lines) of ``sm90_build_check.py *args``, and everything else it
        printed (warnings, tracebacks: stdout and stderr) for an assertion's message."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(list(args)) + "\n")
        self._proc.stdin.flush()
        rows, other = [], []
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                self.close(kill=True)
                msg = f"sm90_build_check.py {args}: no answer in {timeout} s"
                raise TimeoutError(msg) from None
            if line is None:
                self._proc = None
                break
            if line.rstrip("\n") == SM90_SERVE_END:
                break
            (rows if line.startswith("{") else other).append(line)
        return [json.loads(r) for r in rows], "".join(other)

    def close(self, kill: bool = False) -> None:
        """End the process: its stdin closed (it exits after the call in progress) or, with
        ``kill``, killed."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        elif proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def sm90_build() -> Iterator[Sm90Build]:
    """:class:`Sm90Build`: one build-check process for the test process's sm_90 checks."""
    build = Sm90Build()
    yield build
    build.close()

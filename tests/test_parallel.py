"""The TP split rules of ``pdserve/parallel.py``: every head, row and vocab id owned once
(or, for replicated KV heads, by exactly ``tp_size // num_kv_heads`` ranks)."""

from __future__ import annotations

import pytest

from pdserve.parallel import TPRank, even_range, kv_head_range, vocab_range, vocab_shard_rows


@pytest.mark.parametrize("n,size", [(8, 1), (8, 2), (8, 4), (8, 8), (12, 3)])
def test_even_range_partitions(n: int, size: int) -> None:
    covered = [i for r in range(size) for i in range(*even_range(n, TPRank(r, size), "x"))]
    assert covered == list(range(n))


def test_even_range_names_the_field() -> None:
    with pytest.raises(ValueError, match="intermediate_size=10 .* tensor_parallel_size=4"):
        even_range(10, TPRank(0, 4), "intermediate_size")


@pytest.mark.parametrize("kv,size", [(2, 1), (2, 2), (4, 2), (2, 4), (1, 2), (2, 8)])
def test_kv_heads_split_or_replicated(kv: int, size: int) -> None:
    ranges = [kv_head_range(kv, TPRank(r, size)) for r in range(size)]
    owners = {h: sum(1 for a, b in ranges if a <= h < b) for h in range(kv)}
    assert owners == {h: max(1, size // kv) for h in range(kv)}
    assert len({b - a for a, b in ranges}) == 1  # same shard shape on every rank


def test_kv_heads_neither_divides() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        kv_head_range(4, TPRank(0, 6))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        kv_head_range(6, TPRank(0, 4))


@pytest.mark.parametrize("vocab,size", [(10, 1), (10, 3), (10, 4), (3, 4), (49152, 2)])
def test_vocab_ranges_cover_once(vocab: int, size: int) -> None:
    ranges = [vocab_range(vocab, TPRank(r, size)) for r in range(size)]
    ids = [i for a, b in ranges for i in range(a, b)]
    assert ids == list(range(vocab))
    assert all(b - a <= vocab_shard_rows(vocab, size) for a, b in ranges)


def test_rank_validation() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        TPRank(0, 0)
    with pytest.raises(ValueError, match="tp_rank"):
        TPRank(2, 2)


@pytest.mark.parametrize(
    "preset,sizes", [("tiny", [1, 2, 4]), ("smollm2-135m", [1, 3]), ("qwen2.5-0.5b", [1, 2])]
)
def test_valid_tp_sizes_are_those_model_shapes_accepts(
    preset: str, sizes: list[int], tmp_path
) -> None:
    """SmolLM2: 9 query heads and 3 KV heads would allow 9, its 1536 MLP rows do not.  The
    config read from a folder (``model_config``, no weights there) gives the same sizes."""
    from pdserve.model.loader import model_config
    from pdserve.model.presets import preset_config
    from pdserve.model.shapes import valid_tp_sizes

    assert valid_tp_sizes(model_config(f"random:{preset}")) == sizes
    preset_config(preset).save_pretrained(tmp_path)
    assert valid_tp_sizes(model_config(str(tmp_path))) == sizes

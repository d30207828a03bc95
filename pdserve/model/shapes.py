"""A Llama-family model's dimensions as one tensor-parallel rank holds them.

Read once from an HF config; the split of heads, intermediate rows and vocabulary comes
from :mod:`pdserve.parallel` (never recomputed here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.parallel import TPRank, check_divisible, even_range, kv_head_range, vocab_range
from pdserve.parallel import vocab_shard_rows as _vocab_shard_rows

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")


class ModelShapes:
    """Dimensions and flags of a Llama-family config, for rank ``tp`` (default: TP=1).

    Rank-local counts (what this rank's parameters and KV pool hold): ``n_heads`` (query
    heads), ``n_kv_heads``, ``intermediate`` (MLP rows), ``vocab_shard`` (rows of the
    embedding / LM head shard, padded to ``ceil(vocab / tp.size)``). Global: ``total_heads``,
    ``total_kv_heads``, ``total_intermediate``, ``vocab`` (the full vocabulary: logits are
    ``[N, vocab]`` on every rank), ``hidden``, ``head_dim``, ``n_layers``. Ranges ``[start,
    end)`` in global numbering: ``head_range``, ``kv_head_range`` (a single replicated head
    when ``tp.size > total_kv_heads``), ``intermediate_range`` (``(0, 0)`` when no layer has
    a dense MLP), ``vocab_range``. Mixture-of-experts models (Qwen3-MoE, Mixtral) also set
    the expert facts of :meth:`_moe_shapes`; dense models leave them empty.

    Raises ``ValueError`` for unsupported model types / sliding window, and naming the field
    when a count does not split over ``tensor_parallel_size`` (e.g.
    ``num_attention_heads=9 is not divisible by tensor_parallel_size=2``).
    """

    def __init__(self, c: PretrainedConfig, tp: TPRank | None = None) -> None:
        tp = tp or TPRank()
        mt = getattr(c, "model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(c, "use_sliding_window", False) or (
            mt in ("mistral", "mixtral") and getattr(c, "sliding_window", None)
        ):
            raise ValueError(
                "sliding-window attention (use_sliding_window / sliding_window) is not supported"
            )
        self.tp = tp
        self.hidden = c.hidden_size
        self.n_layers = c.num_hidden_layers
        self.total_heads = c.num_attention_heads
        self.total_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.total_intermediate = c.intermediate_size
        self.vocab = c.vocab_size
        self.eps = float(c.rms_norm_eps)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        attn_bias = bool(getattr(c, "attention_bias", False))
        self.qkv_bias = mt == "qwen2" or attn_bias  # Qwen2 always has q/k/v bias
        self.o_bias = attn_bias and mt in ("llama", "mistral")  # Qwen2/3 never bias o_proj
        self.mlp_bias = bool(getattr(c, "mlp_bias", False))
        self.qk_norm = mt in ("qwen3", "qwen3_moe")
        self.scale = self.head_dim**-0.5
        self.max_positions = c.max_position_embeddings
        if self.total_heads % self.total_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.total_heads} is not a multiple of num_key_value_heads"
            )
        check_divisible(self.total_heads, tp.size, "num_attention_heads")
        self.head_range = even_range(self.total_heads, tp, "num_attention_heads")
        self.kv_head_range = kv_head_range(self.total_kv_heads, tp)
        self._moe_shapes(c, mt, tp)
        if self.dense_layers:
            self.intermediate_range = even_range(self.total_intermediate, tp, "intermediate_size")
        else:  # every MLP is sparse (Mixtral, where intermediate_size is the experts' size)
            self.intermediate_range = (0, 0)
        self.vocab_range = vocab_range(self.vocab, tp)
        self.vocab_shard = _vocab_shard_rows(self.vocab, tp.size)
        self.n_heads = self.head_range[1] - self.head_range[0]
        self.n_kv_heads = self.kv_head_range[1] - self.kv_head_range[0]
        self.intermediate = self.intermediate_range[1] - self.intermediate_range[0]

    def _moe_shapes(self, c: PretrainedConfig, mt: str, tp: TPRank) -> None:
        """The mixture-of-experts facts (all empty/zero for a dense model): ``moe_layers``
        (indices of the layers whose MLP is sparse; ``dense_layers`` the rest),
        ``n_experts``, ``top_k`` (experts per token), ``norm_topk_prob`` (renormalise the
        top-k probabilities to sum to 1), ``total_moe_intermediate`` (one expert's
        intermediate size) and this rank's ``moe_intermediate_range`` / ``moe_intermediate``
        (every rank holds that slice of every expert)."""
        layers = range(self.n_layers)
        self.n_experts = self.top_k = self.total_moe_intermediate = 0
        self.norm_topk_prob = False
        self.moe_layers: frozenset[int] = frozenset()
        if mt == "qwen3_moe":  # transformers' Qwen3MoeDecoderLayer: which layers are sparse
            self.n_experts = c.num_experts
            self.total_moe_intermediate = c.moe_intermediate_size
            self.norm_topk_prob = bool(c.norm_topk_prob)
            step, dense = c.decoder_sparse_step, set(c.mlp_only_layers or ())
            if self.n_experts > 0:
                self.moe_layers = frozenset(
                    i for i in layers if i not in dense and (i + 1) % step == 0
                )
        elif mt == "mixtral":
            self.n_experts = c.num_local_experts
            self.total_moe_intermediate = c.intermediate_size
            self.norm_topk_prob = True  # Mixtral: softmax over the chosen experts' logits
            self.moe_layers = frozenset(layers)
        self.dense_layers = frozenset(layers) - self.moe_layers
        if self.moe_layers:
            self.top_k = c.num_experts_per_tok
            if not 0 < self.top_k <= self.n_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.top_k} must be in [1, {self.n_experts}] (the experts)"
                )
            what = "moe_intermediate_size" if mt == "qwen3_moe" else "intermediate_size"
            self.moe_intermediate_range = even_range(self.total_moe_intermediate, tp, what)
        else:
            self.moe_intermediate_range = (0, 0)
        self.moe_intermediate = self.moe_intermediate_range[1] - self.moe_intermediate_range[0]


def valid_tp_sizes(c: PretrainedConfig) -> list[int]:
    """The tensor-parallel sizes config ``c`` splits over (those :class:`ModelShapes`
    accepts: query heads, KV heads and intermediate rows split by :mod:`pdserve.parallel`'s
    rules), ascending; ``[1, 3]`` for SmolLM2-135M (9 query heads, 3 KV heads,
    intermediate 1536).  Raises ``ValueError`` when ``c`` is not supported at all."""
    ModelShapes(c)  # an unsupported model raises its own error, not "no valid size"
    sizes = []
    for size in range(1, c.num_attention_heads + 1):
        try:
            ModelShapes(c, TPRank(0, size))
        except ValueError:
            continue
        sizes.append(size)
    return sizes

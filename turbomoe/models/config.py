"""The size and routing of a Qwen3-MoE-layout language model, named as Hugging Face's Qwen3MoeConfig."""
import math
from dataclasses import asdict, dataclass, field, fields
from typing import List

MOE_IMPLS = ("turbomoe", "deepspeed")


@dataclass
class ModelConfig:
    vocab_size: int = 320
    hidden_size: int = 128
    intermediate_size: int = 512  # dense SwiGLU MLP of the layers that are not MoE
    moe_intermediate_size: int = 128  # SwiGLU MLP of each expert
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % decoder_sparse_step == 0
    mlp_only_layers: List[int] = field(default_factory=list)
    norm_topk_prob: bool = True  # renormalise the k chosen router probabilities to sum to 1
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v/o projections, as Hugging Face's Qwen3MoeAttention
    # turbomoe.integrations.deepspeed.MoE, or DeepSpeed's own deepspeed.moe.layer.MoE (same constructor).
    moe_impl: str = "turbomoe"

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known keys: {sorted(known)}")
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self):
        positive = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                    "decoder_sparse_step", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive int, got {value!r}")
        for name, positive in (("rope_theta", True), ("rms_norm_eps", True), ("initializer_range", False)):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not (number and (value > 0 if positive else value >= 0)):
                raise ValueError(f"model.{name} must be a {'positive' if positive else 'non-negative'} "
                                 f"finite number, got {value!r}")
        for name in ("norm_topk_prob", "tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name} must be true or false, got {getattr(self, name)!r}")
        if not (isinstance(self.mlp_only_layers, (list, tuple))
                and all(isinstance(i, int) and not isinstance(i, bool) for i in self.mlp_only_layers)):
            raise ValueError(f"model.mlp_only_layers must be a list of layer indices, got {self.mlp_only_layers!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model.num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"model.mlp_only_layers {bad} are outside [0, {self.num_hidden_layers})")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"model.moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        from ..ops import MAX_K
        if self.moe_impl == "turbomoe" and self.num_experts_per_tok > MAX_K:
            raise ValueError(f"model.num_experts_per_tok ({self.num_experts_per_tok}) exceeds {MAX_K}, the most experts "
                             f"turbomoe's MoE layers route a token")
        if not self.moe_layers():
            raise ValueError("the model has no MoE layer; check decoder_sparse_step and mlp_only_layers")

    def is_moe_layer(self, i: int) -> bool:
        """Hugging Face Qwen3-MoE's rule for which decoder layers hold a sparse MoE block."""
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def moe_layers(self) -> List[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count of the whole model; active=True counts only the k experts a token uses."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2) + 2 * d + 2 * h
        if self.attention_bias:
            attn += d * (self.num_attention_heads + 2 * self.num_key_value_heads) + h
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        dense = 3 * h * self.intermediate_size
        n_moe = len(self.moe_layers())
        layers = self.num_hidden_layers * attn + n_moe * moe + (self.num_hidden_layers - n_moe) * dense
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + embed + h

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active matmul parameters + causal attention (half PaLM's non-causal term)."""
        matmul = self.num_parameters(active=True) - self.vocab_size * self.hidden_size  # the embedding lookup is free
        if self.tie_word_embeddings:
            matmul += self.vocab_size * self.hidden_size  # ... but the tied lm_head is a matmul
        attention = 6 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        return 6.0 * matmul + attention

"""A decoder-only MoE language model in Hugging Face's Qwen3-MoE layout.

Module names follow Qwen3MoeForCausalLM (model.embed_tokens, model.layers.N.self_attn.q_proj, ...,
lm_head), so a trained model maps one-to-one onto a Qwen3-MoE checkpoint (see hf_names.py). The
sparse block is a DeepSpeed-compatible MoE layer (turbomoe's, or DeepSpeed's own), so the
DeepSpeed engine handles expert parallelism, ZeRO parameter groups and per-expert checkpoints.

Shapes: B batch, T tokens, H hidden, N query heads, G key/value heads, D head dim, V vocab, E experts.
"""
import hashlib
import inspect
import math
import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..integrations.deepspeed_experts import SwiGLUExpert
from .config import ModelConfig


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor  # [B, T, V]
    loss: Optional[torch.Tensor]  # mean next-token cross entropy, None without labels
    aux_loss: torch.Tensor  # load-balancing loss, mean over the MoE layers (not yet scaled by its coefficient)
    expert_counts: torch.Tensor  # [num MoE layers, E] routes per expert on this rank, before capacity


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """norm(x), or norm(x + residual) (the sum as the layers' residual adds round it)."""
        if residual is not None:
            x = x + residual
        # fp32 statistics, as Qwen3's RMSNorm, whatever the activation dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device):
    """cos, sin [T, D] in fp32 for rotate-half rotary embeddings (Hugging Face's layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x_BNTD, cos_TD, sin_TD):
    x1, x2 = x_BNTD.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BNTD.float() * cos_TD + rotated.float() * sin_TD).to(x_BNTD.dtype)


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm, through scaled_dot_product_attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(self, x_BTH, cos_TD, sin_TD):
        """q [B, N, T, D], k and v [B, G, T, D]: normed and rotated. cos and sin broadcast against
        [B, heads, T, D]."""
        return self.heads(self.q_proj(x_BTH), self.k_proj(x_BTH), self.v_proj(x_BTH), cos_TD, sin_TD)

    def heads(self, q_BTF, k_BTF, v_BTF, cos_TD, sin_TD):
        """project's heads from the projections made (the inference engine makes them in one GEMM)."""
        B, T, _ = q_BTF.shape
        q = self.q_norm(q_BTF.view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k_BTF.view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v_BTF.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos_TD, sin_TD), apply_rotary(k, cos_TD, sin_TD), v

    def forward(self, x_BTH, cos_TD, sin_TD):
        B, T, _ = x_BTH.shape
        q, k, v = self.project(x_BTH, cos_TD, sin_TD)
        # SDPA's own GQA, not k and v repeated to every query head: 0.82x the time of the repeat at
        # small-1gpu's shapes (fwd+bwd, H100; notes/recipe_profile.md), and dk, dv summed over the
        # group in fp32 inside the kernel.
        out_BNTD = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out_BNTD.transpose(1, 2).reshape(B, T, -1))


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: Qwen3-MoE's dense MLP (the experts compute the same)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def moe_class(impl: str):
    """The DeepSpeed-compatible MoE layer class for model.moe_impl, and its name."""
    if impl == "turbomoe":
        try:
            from turbomoe.integrations.deepspeed import MoE
        except ImportError as e:
            raise ImportError("model.moe_impl is 'turbomoe' but turbomoe.integrations.deepspeed.MoE cannot be "
                              f"imported ({e}); set model.moe_impl: deepspeed to use DeepSpeed's MoE") from e
        return MoE, "turbomoe"
    if impl == "deepspeed":
        from deepspeed.moe.layer import MoE
        return MoE, "deepspeed"
    raise ValueError(f"model.moe_impl must be 'turbomoe' or 'deepspeed', got {impl!r}")


def renormalizes_topk(moe_cls, k: int) -> Optional[bool]:
    """Whether a MoE class renormalises the top-k scores, when it has no switch for it.

    DeepSpeed's gates renormalise the chosen probabilities for k >= 2 and keep the raw softmax
    probability for k = 1. Returns None when the class takes norm_topk_prob itself.
    """
    if "norm_topk_prob" in inspect.signature(moe_cls.__init__).parameters:
        return None
    return k >= 2


class MoEArgs(NamedTuple):
    """The parallel and capacity settings of every MoE layer (the recipe's `moe` section)."""
    ep_size: int = 1
    capacity_factor: Optional[float] = None  # None is dropless
    eval_capacity_factor: Optional[float] = None  # None: same as capacity_factor
    min_capacity: int = 4
    recompute: bool = False  # turbomoe's MoE only: expert rows and activation remade in backward

    def validate(self):
        """Raises ValueError naming the field (the recipe's moe.* key): an ep_size < 1 failed deep inside
        the layer, and a capacity factor <= 0 silently capped every expert at min_capacity tokens."""
        if not isinstance(self.ep_size, int) or isinstance(self.ep_size, bool) or self.ep_size < 1:
            raise ValueError(f"moe.ep_size must be a positive int, got {self.ep_size!r}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if value is not None and not (number and value > 0):
                raise ValueError(f"moe.{name} must be a positive finite number or None (dropless), got {value!r}")


def build_moe(cfg: ModelConfig, args: MoEArgs) -> nn.Module:
    moe_cls, _ = moe_class(cfg.moe_impl)
    fixed = renormalizes_topk(moe_cls, cfg.num_experts_per_tok)
    kwargs = {}
    if fixed is None:
        kwargs["norm_topk_prob"] = cfg.norm_topk_prob
    elif fixed != cfg.norm_topk_prob:
        raise ValueError(f"{moe_cls.__module__}.MoE with k={cfg.num_experts_per_tok} always uses "
                         f"norm_topk_prob={fixed}; set model.norm_topk_prob: {str(fixed).lower()} or another moe_impl")
    if args.recompute:
        if "recompute" not in inspect.signature(moe_cls.__init__).parameters:
            raise ValueError(f"moe.recompute needs model.moe_impl: turbomoe ({moe_cls.__module__}.MoE has no recompute)")
        kwargs["recompute"] = True
    dropless = args.capacity_factor is None
    if dropless and args.eval_capacity_factor is not None:  # drop_tokens off: evaluation is dropless too
        raise ValueError(f"eval_capacity_factor {args.eval_capacity_factor} needs a capacity_factor, got None "
                         f"(dropless)")
    eval_cf = args.capacity_factor if args.eval_capacity_factor is None else args.eval_capacity_factor
    # turbomoe's SwiGLUExpert (w1 gate, w3 up, w2 down) is the expert its grouped-GEMM fast path knows.
    return moe_cls(hidden_size=cfg.hidden_size,
                   expert=SwiGLUExpert(cfg.hidden_size, cfg.moe_intermediate_size),
                   num_experts=cfg.num_experts,
                   ep_size=args.ep_size,
                   k=cfg.num_experts_per_tok,
                   capacity_factor=1.0 if dropless else args.capacity_factor,
                   eval_capacity_factor=1.0 if dropless else eval_cf,
                   min_capacity=args.min_capacity,
                   noisy_gate_policy=None,
                   drop_tokens=not dropless,
                   use_rts=False,  # Qwen3 drops nothing at random; capacity drops go by position/probability
                   top2_2nd_expert_sampling=False,  # Qwen3 takes the true second choice
                   **kwargs)


class ExpertsMoved(nn.Module):
    """What stays of an MoE block whose router and experts a turbomoe.inference.Engine took (it serves
    from its own stacked copy): any use of the block, or saving the model, says so."""
    MESSAGE = ("this model's MoE blocks were handed to a turbomoe.inference.Engine, which holds their router "
               "and experts now; load the model again, or build the engine with Engine(model, keep_model=True)")

    def forward(self, *args, **kwargs):
        raise RuntimeError(ExpertsMoved.MESSAGE)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, moe_args: MoEArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = build_moe(cfg, moe_args) if self.is_moe else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)

    def attention_half(self, x_BTH, cos_TD, sin_TD, residual_BTH=None):
        """x' + attention(norm(x')) with x' = x + residual (the layer before's MLP output, if any),
        and the MLP's normed input from it. One function, so that a compile (models.compile) fuses
        both residual adds into the norms after them (the first one was an eager add of two
        activations each way before: 46 us a layer at small-1gpu's shapes on an H100), and in
        backward the residual's gradient into the norms' gradients."""
        if residual_BTH is not None:
            x_BTH = x_BTH + residual_BTH
        x_BTH = x_BTH + self.self_attn(self.input_layernorm(x_BTH), cos_TD, sin_TD)
        return x_BTH, self.post_attention_layernorm(x_BTH)

    def forward(self, x_BTH, cos_TD, sin_TD, residual_BTH=None):
        """-> (x', the MLP's output, aux, counts): the layer's output is x' + the MLP's output, which
        the next layer (or the final norm) adds as its residual_BTH."""
        x_BTH, h = self.attention_half(x_BTH, cos_TD, sin_TD, residual_BTH)
        if not self.is_moe:
            return x_BTH, self.mlp(h), None, None
        out, aux, counts_E = self.mlp(h)
        return x_BTH, out, aux, counts_E


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_args: MoEArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, moe_args) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(nn.Module):
    """input_ids [B, T] (+ labels [B, T], -100 ignored) -> CausalLMOutput."""

    def __init__(self, cfg: ModelConfig, moe_args: MoEArgs = MoEArgs()):
        super().__init__()
        cfg.validate()
        moe_args.validate()
        if cfg.num_experts % moe_args.ep_size:
            raise ValueError(f"ep_size {moe_args.ep_size} does not divide num_experts {cfg.num_experts}")
        self.config = cfg
        self.moe_args = moe_args
        self.hf_source = None  # the Hugging Face directory its weights were read from: save_pretrained's tokenizer
        self.moe_impl = moe_class(cfg.moe_impl)[1]
        self.model = Qwen3MoeModel(cfg, moe_args)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def check_whole(self):
        """Raises where an inference Engine took this model's MoE blocks (see ExpertsMoved)."""
        if any(isinstance(layer.mlp, ExpertsMoved) for layer in self.model.layers):
            raise RuntimeError(ExpertsMoved.MESSAGE)

    @torch.no_grad()
    def init_weights(self, seed: int, ep_rank: int = 0):
        """Normal(0, initializer_range) weights, unit norms.

        Every expert draws from its own generator, seeded by (seed, layer, global expert id), so
        experts differ from one another (DeepSpeed's Experts deep-copies one module) and the
        initial model is the same whatever ep_size; ep_rank says which experts this rank holds.
        """
        std = self.config.initializer_range
        dense = torch.Generator().manual_seed(seed)
        num_local = self.config.num_experts // self.moe_args.ep_size
        for layer_idx, layer in enumerate(self.model.layers):
            expert_ids = set()
            if layer.is_moe:
                for local_id, expert in enumerate(layer.mlp.deepspeed_moe.experts.deepspeed_experts):
                    global_id = ep_rank * num_local + local_id
                    key = f"{seed}/{layer_idx}/{global_id}".encode()
                    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
                    for p in expert.parameters():
                        p.copy_(torch.randn(p.shape, generator=g) * std)
                        expert_ids.add(id(p))
            for name, p in layer.named_parameters():
                if id(p) in expert_ids:
                    continue
                if name.endswith(".bias"):  # attention biases start at zero, as Hugging Face's
                    p.zero_()
                elif name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=dense) * std)
        self.model.embed_tokens.weight.copy_(torch.randn(self.model.embed_tokens.weight.shape, generator=dense) * std)
        self.model.norm.weight.fill_(1.0)
        if not self.config.tie_word_embeddings:
            self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=dense) * std)

    def forward(self, input_ids_BT: torch.Tensor, labels_BT: Optional[torch.Tensor] = None) -> CausalLMOutput:
        T = input_ids_BT.shape[1]
        if T > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings {self.config.max_position_embeddings}")
        x = self.model.embed_tokens(input_ids_BT)
        cos, sin = rotary_cos_sin(T, self.config.head_dim, self.config.rope_theta, x.device)
        auxes, counts, out = [], [], None
        for layer in self.model.layers:
            x, out, aux, counts_E = layer(x, cos, sin, out)
            if aux is not None:
                auxes.append(aux)
                counts.append(counts_E)
        logits = self.lm_head(self.model.norm(x, out))
        loss = None
        if labels_BT is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels_BT.flatten(), ignore_index=-100)
        return CausalLMOutput(logits, loss, torch.stack(auxes).mean(), torch.stack(counts))

    @classmethod
    def from_pretrained(cls, path: str, *, moe_impl: str = "turbomoe", dtype: Optional[torch.dtype] = None,
                        device=None, moe_args: MoEArgs = MoEArgs(), ep_rank: Optional[int] = None):
        """A Hugging Face Qwen3-MoE directory (config.json + safetensors) -> this model, in eval mode.

        dtype None keeps config.json's dtype (where it names none, the stored embedding's, as transformers).
        With moe_args.ep_size > 1 the model holds, and reads, only the experts of ep_rank (default: the
        process group's rank % ep_size, the recipe's placement).
        """
        from . import hf_checkpoint as hf
        # the model is built under torch.set_default_dtype(dtype), which takes these alone (an FP8 dtype
        # failed there as "couldn't find storage object"); FP8 checkpoints are dequantized to one of them
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"dtype must be a floating-point torch.dtype the model computes in (float16, bfloat16, "
                            f"float32 or float64; FP8 checkpoints are dequantized to it), got {dtype!r}")
        moe_args.validate()  # before ep_size places this rank
        if ep_rank is None:
            ep_rank = hf.default_ep_rank(moe_args.ep_size)
        hf.check_ep_rank(ep_rank, moe_args.ep_size)  # before any file is read
        raw = hf.read_config(path)
        cfg = hf.config_from_hf(raw, os.path.join(path, hf.CONFIG), moe_impl)
        with hf.CheckpointReader(path) as reader:  # the files are checked before the model is built
            # Built on the meta device in the target dtype (the default dtype while building: modules
            # that ask for fp32 explicitly, as DeepSpeed's gate does, keep it), then allocated where it
            # runs: no fp32 copy, no random initialisation of weights the checkpoint overwrites.
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype or hf.config_dtype(raw, reader))
            try:
                with torch.device("meta"):
                    model = cls(cfg, moe_args)
            finally:
                torch.set_default_dtype(default_dtype)
            model.to_empty(device=device or "cpu")
            if cfg.tie_word_embeddings:  # to_empty gives every parameter a new tensor: tie them again
                model.lm_head.weight = model.model.embed_tokens.weight
            hf.load_weights(model, reader, ep_rank)
        model.hf_source = os.path.abspath(path)
        return model.eval()

    def load_hf_weights(self, path: str, ep_rank: int = 0):
        """Copy a Hugging Face directory's weights (this rank's experts) into this model, in place."""
        from . import hf_checkpoint as hf
        self.check_whole()
        hf.check_ep_rank(ep_rank, self.moe_args.ep_size)  # before any file is read
        with hf.CheckpointReader(path) as reader:
            hf.load_weights(self, reader, ep_rank)
        self.hf_source = os.path.abspath(path)

    def save_pretrained(self, out_dir: str, *, dtype: Optional[torch.dtype] = None, max_shard_size="5GB",
                        force: bool = False, tokenizer=None):
        """Write a directory that transformers' AutoModelForCausalLM and AutoTokenizer load (see hf_checkpoint).

        dtype None keeps the parameters' dtype. tokenizer None: a model read from a Hugging Face directory
        (from_pretrained, load_hf_weights) takes that directory's tokenizer files, token ids and
        generation_config.json along; any other gets the byte tokenizer when the vocabulary holds it.
        An existing out_dir is an error unless force.
        """
        from . import hf_checkpoint as hf
        self.check_whole()
        dtype = dtype or self.lm_head.weight.dtype
        hf.save_dir(out_dir, self.config, hf.hf_tensors(self), dtype, max_shard_size, force, tokenizer,
                    source=self.hf_source)

"""Helpers of the Megatron-core tests (tests/test_megatron*.py, tests/megatron_ep_script.py and
tests/megatron_train_script.py): a one-process (or launched) model-parallel set-up, small configs,
stock <-> turbomoe weight copies, a stock / turbomoe GPT model pair and its token batches."""
import contextlib
import dataclasses
import os

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from launching import free_port
from turbomoe.integrations import megatron as tm


_ENV_SET_HERE = False  # RANK and its peers set by model_parallel, not by a launcher


@contextlib.contextmanager
def model_parallel(backend: str = "gloo", ep: int = 1, tp: int = 1):
    """torch.distributed (world size from the launcher's env, else 1; kept if already initialised) +
    Megatron's parallel state: tensor parallel tp (experts not: expert tensor parallel 1), expert
    parallel ep, data parallel the rest."""
    global _ENV_SET_HERE
    owned = not torch.distributed.is_initialized()
    if "RANK" not in os.environ or (_ENV_SET_HERE and owned):
        # a fresh port at every group this process makes: one kept from the first test could be taken,
        # between tests, by another process on the machine (EADDRINUSE for every later test)
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        _ENV_SET_HERE = True
    if owned:
        torch.distributed.init_process_group(backend)
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owned:
            torch.distributed.destroy_process_group()


def moe_config(**overrides) -> TransformerConfig:
    """A small SwiGLU MoE transformer config; overrides win."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=6, moe_router_topk=2,
              moe_ffn_hidden_size=24, ffn_hidden_size=48, gated_linear_unit=True, activation_func=F.silu,
              add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32,
              moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    kw.update(overrides)
    return TransformerConfig(**kw)


def expert_pairs(moe, grads: bool = False):
    """[(fc1 [2F, H], fc2 [H, F])] of a MoE layer's local experts (or their gradients), whatever holds them:
    turbomoe's GroupedMLP layout (weight1 [H, El * 2F] is w1 [El, H, 2F], weight2 [El * F, H] is
    w2 [El, F, H]: views), stock's SequentialMLP (local or Transformer Engine linears) or Transformer
    Engine's TEGroupedMLP (linear_fc1.weight0, weight1, ...)."""
    ex = moe.experts
    pick = (lambda p: p.grad) if grads else (lambda p: p)
    if isinstance(moe, tm.TurboMoELayer):
        H = ex.config.hidden_size
        w1 = pick(ex.weight1).view(ex.num_local_experts, H, -1)
        w2 = pick(ex.weight2).view(ex.num_local_experts, -1, H)
        return [(w1[i].t(), w2[i].t()) for i in range(ex.num_local_experts)]
    if hasattr(ex, "local_experts"):
        return [(pick(e.linear_fc1.weight), pick(e.linear_fc2.weight)) for e in ex.local_experts]
    return [(pick(getattr(ex.linear_fc1, f"weight{i}")), pick(getattr(ex.linear_fc2, f"weight{i}")))
            for i in range(ex.num_local_experts)]


@torch.no_grad()
def copy_stock_moe_to_turbomoe(stock_moe, turbo_moe):
    """Router and expert weights of a stock MoELayer (any expert module) into turbomoe's."""
    turbo_moe.router.weight.copy_(stock_moe.router.weight)
    if getattr(stock_moe.router, "expert_bias", None) is not None:
        turbo_moe.router.expert_bias.copy_(stock_moe.router.expert_bias)
    for (t1, t2), (s1, s2) in zip(expert_pairs(turbo_moe), expert_pairs(stock_moe), strict=True):
        t1.copy_(s1)
        t2.copy_(s2)


def experts_as_stock(moe, grads: bool = False):
    """A MoE layer's expert weights (or their gradients) in SequentialMLP's names and shapes."""
    out = {}
    for i, (w1, w2) in enumerate(expert_pairs(moe, grads)):
        out[f"experts.local_experts.{i}.linear_fc1.weight"] = w1
        out[f"experts.local_experts.{i}.linear_fc2.weight"] = w2
    return out


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm for a Megatron layer spec under sequence parallelism. Without apex or Transformer
    Engine the local spec's norm is WrappedTorchNorm, which refuses sequence_parallel (its parameters would
    miss the mark); this one sets `sequence_parallel` on its parameters, as apex's FusedLayerNorm and TE's
    norms do, so finalize_model_grads sums their gradients over the tensor-parallel ranks."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)


def with_sequence_parallel_norms(block):
    """The block spec with its WrappedTorchNorm norms (layers' and the final one) SequenceParallelLayerNorm."""
    for sub in [layer.submodules for layer in block.layer_specs] + [block]:
        for field in dataclasses.fields(sub):
            if getattr(sub, field.name) is WrappedTorchNorm:
                setattr(sub, field.name, SequenceParallelLayerNorm)
    return block


def gpt_pair(cfg, vocab: int, seq: int, te: bool = False, **turbomoe_kwargs):
    """(stock GPT, turbomoe GPT) on the GPU from the same seed (local specs, or with te Transformer
    Engine's: its linears, norms and attention, and stock's experts TEGroupedMLP where
    cfg.moe_grouped_gemm, else SequentialMLP on its linears; local specs under sequence parallelism
    get SequenceParallelLayerNorm norms), turbomoe's weights then set to stock's; both cast to
    cfg.params_dtype as Float16Module casts them (embeddings start fp32)."""
    models = []
    for spec in (get_gpt_decoder_block_spec(cfg, use_transformer_engine=te),
                 tm.get_turbomoe_gpt_decoder_block_spec(cfg, use_transformer_engine=te, **turbomoe_kwargs)):
        if cfg.sequence_parallel and not te:
            spec = with_sequence_parallel_norms(spec)
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq).cuda()
        models.append(model.to(cfg.params_dtype))
    stock, turbo = models
    own = dict(turbo.named_parameters())
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if name in own:
                own[name].copy_(p)
    for ls, lt in zip(stock.decoder.layers, turbo.decoder.layers):
        if isinstance(lt.mlp, tm.TurboMoELayer):
            copy_stock_moe_to_turbomoe(ls.mlp, lt.mlp)
    return stock, turbo


def gpt_tensors_as_stock(model, grads: bool = False):
    """A GPT model's parameters (or their gradients, those that have one) by stock's local names: the
    experts of any MoE layer (turbomoe's, TEGroupedMLP) as SequentialMLP's."""
    out = {n: p.grad if grads else p for n, p in model.named_parameters()
           if (p.grad is not None or not grads) and ".mlp.experts." not in n}
    for i, layer in enumerate(model.decoder.layers):
        if isinstance(layer.mlp, MoELayer):
            out.update({f"decoder.layers.{i}.mlp.{k}": t for k, t in experts_as_stock(layer.mlp, grads).items()})
    return out


def gpt_batch(vocab: int, seq: int, batch: int, seed: int = 1):
    """(tokens, position ids, causal mask) of random tokens on the GPU, drawn from seed."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
    pos = torch.arange(seq, device="cuda").expand(batch, seq)
    mask = torch.ones(batch, 1, seq, seq, dtype=torch.bool, device="cuda").triu(1)
    return tokens, pos, mask

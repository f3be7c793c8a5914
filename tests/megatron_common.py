"""Helpers of the Megatron-core tests (tests/test_megatron*.py and tests/megatron_ep_script.py):
a one-process (or launched) model-parallel set-up, small configs, stock <-> turbomoe weight copies."""
import contextlib
import os
import socket

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def model_parallel(backend: str = "gloo", ep: int = 1):
    """torch.distributed (world size from the launcher's env, else 1) + Megatron's parallel state."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    owned = not torch.distributed.is_initialized()
    if owned:
        torch.distributed.init_process_group(backend)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
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


@torch.no_grad()
def copy_stock_moe_to_turbomoe(stock_moe, turbo_moe):
    """Router and SequentialMLP expert weights of a stock MoELayer into turbomoe's (GroupedMLP layout:
    weight1 [H, El * 2F] is w1 [El, H, 2F], weight2 [El * F, H] is w2 [El, F, H])."""
    turbo_moe.router.weight.copy_(stock_moe.router.weight)
    if getattr(stock_moe.router, "expert_bias", None) is not None:
        turbo_moe.router.expert_bias.copy_(stock_moe.router.expert_bias)
    ex = turbo_moe.experts
    H = ex.config.hidden_size
    w1, w2 = ex.weight1.view(ex.num_local_experts, H, -1), ex.weight2.view(ex.num_local_experts, -1, H)
    for i, e in enumerate(stock_moe.experts.local_experts):
        w1[i].copy_(e.linear_fc1.weight.t())
        w2[i].copy_(e.linear_fc2.weight.t())


def expert_grads_as_stock(turbo_moe):
    """turbomoe's expert weight gradients in SequentialMLP's names and shapes."""
    ex = turbo_moe.experts
    H = ex.config.hidden_size
    g1 = ex.weight1.grad.view(ex.num_local_experts, H, -1)
    g2 = ex.weight2.grad.view(ex.num_local_experts, -1, H)
    out = {}
    for i in range(ex.num_local_experts):
        out[f"experts.local_experts.{i}.linear_fc1.weight"] = g1[i].t()
        out[f"experts.local_experts.{i}.linear_fc2.weight"] = g2[i].t()
    return out

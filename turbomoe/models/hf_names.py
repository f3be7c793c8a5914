"""Parameter names of this model <-> a Hugging Face Qwen3-MoE checkpoint.

The only names that differ are those of the DeepSpeed MoE layer:
  model.layers.N.mlp.deepspeed_moe.gate.wg.weight                          <-> model.layers.N.mlp.gate.weight
  model.layers.N.mlp.deepspeed_moe.experts.deepspeed_experts.J.w1.weight <-> model.layers.N.mlp.experts.J.gate_proj.weight
  (w1 gate_proj, w3 up_proj, w2 down_proj: turbomoe's SwiGLUExpert, which its grouped-GEMM path knows)
J is the global expert id, as in DeepSpeed's per-expert checkpoint files; a rank's own state_dict
numbers its experts locally (0 .. E/ep_size - 1), so an expert-parallel model must be consolidated
(or its ids offset by ep_rank * E/ep_size) first.
"""
import re

_EXPERT_LINEARS = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
_TO_HF = [(re.compile(r"\.mlp\.deepspeed_moe\.gate\.wg\.weight$"), ".mlp.gate.weight")] + [
    (re.compile(rf"\.mlp\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.{ours}\."), rf".mlp.experts.\1.{hf}.")
    for ours, hf in _EXPERT_LINEARS]
_FROM_HF = [(re.compile(r"\.mlp\.gate\.weight$"), ".mlp.deepspeed_moe.gate.wg.weight")] + [
    (re.compile(rf"\.mlp\.experts\.(\d+)\.{hf}\."), rf".mlp.deepspeed_moe.experts.deepspeed_experts.\1.{ours}.")
    for ours, hf in _EXPERT_LINEARS]


def _rename(name: str, rules) -> str:
    for pattern, repl in rules:
        name = pattern.sub(repl, name)
    return name


def to_hf_name(name: str) -> str:
    return _rename(name, _TO_HF)


def from_hf_name(name: str) -> str:
    return _rename(name, _FROM_HF)


def to_hf_state_dict(state_dict: dict) -> dict:
    """Rename a (consolidated) state dict to Hugging Face Qwen3-MoE keys; tensors are shared, not copied."""
    return {to_hf_name(k): v for k, v in state_dict.items()}


def from_hf_state_dict(state_dict: dict) -> dict:
    return {from_hf_name(k): v for k, v in state_dict.items()}

"""Language models built on turbomoe's MoE layers."""
from .config import ModelConfig
from .hf_names import from_hf_name, from_hf_state_dict, to_hf_name, to_hf_state_dict
from .qwen3_moe import CausalLMOutput, MoEArgs, Qwen3MoeForCausalLM, moe_class

__all__ = ["ModelConfig", "MoEArgs", "Qwen3MoeForCausalLM", "CausalLMOutput", "moe_class",
           "to_hf_name", "from_hf_name", "to_hf_state_dict", "from_hf_state_dict"]

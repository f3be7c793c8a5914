"""turbomoe: fused Mixture-of-Experts gating with hand-written backward passes."""
from . import ops, reference
from .ops import assign_slots, capacity, gather_tokens, scatter_tokens, topk_gating

__version__ = "0.1.0"
__all__ = ["ops", "reference", "topk_gating", "assign_slots", "scatter_tokens", "gather_tokens", "capacity"]

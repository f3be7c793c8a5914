"""Serving on the shuffled (expert-contiguous) layout: index_shuffling, the SparseMoE block, and the
generation engine (load, Engine.generate, generation_defaults)."""
from .engine import Engine, load
from .moe import SparseMoE
from .sampling import generation_defaults
from .shuffling import index_shuffling

__all__ = ["index_shuffling", "SparseMoE", "Engine", "load", "generation_defaults"]

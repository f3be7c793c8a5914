"""Triton kernels and their launchers, no autograd: the Triton backend of the gating ops.

The five launchers below are the interface every backend module provides (turbomoe/csrc is the
CUDA C++ one); the autograd Functions in turbomoe/autograd call whichever module ops chose.
"""
from .gating import gating_backward, gating_forward
from .rows import pull_rows, push_rows
from .sampling import second_expert_backward, second_expert_forward
from .slots import assign_slots

__all__ = ["gating_forward", "gating_backward", "assign_slots", "push_rows", "pull_rows", "second_expert_forward",
           "second_expert_backward"]

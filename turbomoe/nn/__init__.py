"""turbomoe.nn: TopKRouter, GroupedExperts and MoELayer."""
from .experts import GroupedExperts
from .layer import MoELayer
from .router import TopKRouter

__all__ = ["TopKRouter", "GroupedExperts", "MoELayer"]

"""Token dispatch for turbomoe's Megatron-core MoE layer: turbomoe's slots, scatter and gather, over the
expert-parallel group with Megatron's all-to-all.

    tokens_RH, tokens_per_expert_E, probs_R = dispatcher.dispatch(x_TH, routing)
    y_RH, _ = experts(tokens_RH, tokens_per_expert_E, probs_R)     # probs applied inside, before fc2
    out_TH = dispatcher.combine(y_RH)

The local buffer is turbomoe's scatter of the T local tokens by routing.slots: dropless, the T*k
routes expert-contiguous over the E global experts; with a capacity C, E blocks of C rows (empty
rows zero, with prob 0). combine gathers each token's kept rows with weight 1 (the experts applied
the probs). With probs_in_combine=True, dispatch hands the experts probs None instead and combine
weighs the rows by the probs inside turbomoe's gather kernel (equal in exact arithmetic for experts
without a bias: fc2 is linear; it saves the [R, F] multiply and its backward). tokens_per_expert
stays on the device.
Expert parallelism (ep > 1), El = E / ep local experts:
  capacity  every rank sends El*C rows to every rank (equal splits: no host sync); the received
            [ep, El, C] blocks are reordered to [El, ep, C], so each local expert owns ep*C rows
  dropless  the per-expert counts go through one all-to-all and then to the host, once per forward,
            because all_to_all_single takes its split sizes as Python ints (Megatron's dispatchers
            read them too); the received [source, expert] chunks are reordered expert-major with
            Megatron's sort_chunks_by_idxs. Only the kept rows travel (a non-finite router row routes
            nowhere and leaves empty rows at the buffer's end)
  The capacity exchange needs one capacity on every rank of the group, i.e. equal token counts (as
  Megatron's training has: the same [s, b] on every rank); dropless takes any counts. Checked where
  that costs no host sync (CPU tensors, or TURBOMOE_DEBUG=1: ops.debug_checks): a ValueError on
  every rank instead of mismatched all-to-alls.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import all_to_all
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

from .. import ops


class TurboTokenDispatcher:
    """See the module doc. One dispatch, then one combine, per forward (state kept in between)."""

    def __init__(self, num_local_experts: int, num_experts: int, ep_group, backend: Optional[str] = None,
                 probs_in_combine: bool = False):
        self.num_local_experts, self.num_experts, self.ep_group = num_local_experts, num_experts, ep_group
        self.ep_size = ep_group.size()
        self.backend, self.probs_in_combine = backend, probs_in_combine
        self._slots = self._weights_TK = self._splits = None

    def dispatch(self, x_TH: torch.Tensor, routing):
        """x [T, H] -> (tokens [R, H], tokens_per_expert [El] int32 on the device, probs [R] or None)."""
        s = routing.slots
        self._slots = s
        self._weights_TK = None
        if self.probs_in_combine:  # the gather weighs in fp32 (fp64 when the router works in fp64)
            p = routing.probs
            self._weights_TK = p if p.dtype in (torch.float32, torch.float64) else p.float()
        if self.ep_size > 1 and ops.debug_checks(x_TH):
            self._check_one_capacity(x_TH.shape[0], s.capacity, x_TH.device)
        buf_RH = ops.scatter_tokens(x_TH, s, backend=self.backend)
        probs_R = None if self.probs_in_combine else ops.row_scores(s, routing.probs, self.backend)
        if self.ep_size == 1:
            return buf_RH, ops.buffer_counts(s), probs_R
        if s.capacity is not None:
            return self._dispatch_blocks(buf_RH, probs_R, s.capacity)
        return self._dispatch_chunks(buf_RH, probs_R, s.kept_counts)

    def combine(self, y_RH: torch.Tensor) -> torch.Tensor:
        """Expert outputs [R, H] -> out [T, H] = sum of each token's kept rows."""
        s = self._slots
        if self.ep_size > 1:
            y_RH = (self._combine_blocks(y_RH, s.capacity) if s.capacity is not None
                    else self._combine_chunks(y_RH, s.num_rows))
        # weights None: the experts applied the probs; the gather sums with weight 1 and keeps no y.
        out_TH = ops.gather_tokens(y_RH, s, self._weights_TK, backend=self.backend)
        self._slots = self._weights_TK = self._splits = None
        return out_TH

    def _check_one_capacity(self, num_tokens: int, capacity, device):
        """ValueError on every rank unless all ranks route with one capacity or all are dropless (a
        rank with fewer tokens gets a smaller capacity, or none: the equal-split all-to-all would then
        mismatch, a crash deep in the collective or a hang)."""
        mine = torch.tensor([num_tokens, -1 if capacity is None else capacity], device=device)
        every = [torch.empty_like(mine) for _ in range(self.ep_size)]
        torch.distributed.all_gather(every, mine, group=self.ep_group)
        tokens, caps = torch.stack(every).t().tolist()
        if len(set(caps)) > 1:
            raise ValueError(
                f"turbomoe's Megatron dispatcher: the expert-parallel ranks route {tokens} tokens, which give "
                f"capacities {caps} (-1: nothing can drop, dropless); the capacity exchange needs one capacity on "
                "every rank: give every rank the same token count, or set moe_expert_capacity_factor=None")

    # Capacity: fixed blocks of C rows, equal splits.
    def _dispatch_blocks(self, buf_RH, probs_R, C: int):
        ep, El = self.ep_size, self.num_local_experts
        recv_RH = all_to_all(self.ep_group, buf_RH)  # [source, El, C] -> local experts' rows
        tokens = recv_RH.view(ep, El, C, -1).transpose(0, 1).reshape(El * ep * C, -1)
        probs = None
        if probs_R is not None:
            probs = all_to_all(self.ep_group, probs_R).view(ep, El, C).transpose(0, 1).reshape(-1)
        counts_E = torch.full((El,), ep * C, dtype=torch.int32, device=buf_RH.device)
        return tokens, counts_E, probs

    def _combine_blocks(self, y_RH, C: int):
        ep, El = self.ep_size, self.num_local_experts
        y_RH = y_RH.view(El, ep, C, -1).transpose(0, 1).reshape(ep * El * C, -1)
        return all_to_all(self.ep_group, y_RH)

    # Dropless: variable chunks, split sizes on the host.
    def _dispatch_chunks(self, buf_RH, probs_R, kept_counts_E):
        ep, El = self.ep_size, self.num_local_experts
        recv_counts = torch.empty_like(kept_counts_E)  # [source, local expert]
        torch.distributed.all_to_all_single(recv_counts, kept_counts_E, group=self.ep_group)
        # The one host sync of the dropless expert-parallel forward: split sizes must be Python ints.
        host = torch.cat([kept_counts_E, recv_counts]).cpu().view(2, ep, El)
        send_splits, recv_SE = host[0].sum(1).tolist(), host[1]
        recv_splits = recv_SE.sum(1).tolist()
        sent = sum(send_splits)  # the kept rows, first in the buffer; unrouted routes leave rows past them
        tokens = all_to_all(self.ep_group, buf_RH[:sent], recv_splits, send_splits)
        probs = None if probs_R is None else all_to_all(self.ep_group, probs_R[:sent], recv_splits, send_splits)
        to_expert_major = torch.arange(ep * El).view(ep, El).t().reshape(-1)
        tokens, probs = sort_chunks_by_idxs(tokens, recv_SE.reshape(-1), to_expert_major, probs)
        self._splits = (send_splits, recv_splits, recv_SE)
        return tokens, recv_counts.view(ep, El).sum(0, dtype=torch.int32), probs

    def _combine_chunks(self, y_RH, num_rows: int):
        ep, El = self.ep_size, self.num_local_experts
        send_splits, recv_splits, recv_SE = self._splits
        to_source_major = torch.arange(El * ep).view(El, ep).t().reshape(-1)
        y_RH, _ = sort_chunks_by_idxs(y_RH, recv_SE.t().reshape(-1), to_source_major)
        back_RH = all_to_all(self.ep_group, y_RH, send_splits, recv_splits)
        # the gather reads the whole buffer's rows: the empty ones back as zeros
        return F.pad(back_RH, (0, 0, 0, num_rows - back_RH.shape[0])) if back_RH.shape[0] < num_rows else back_RH

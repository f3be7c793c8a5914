"""turbomoe vs stock DeepSpeed MoE under Megatron-style tensor parallelism (tests/test_deepspeed_tp.py).

    deepspeed --num_gpus 2 tests/ds_tp_script.py --workdir DIR [--expert-tp]

Two ranks, one tensor-parallel group of size 2 (pp = 1, dp = 1), described by a minimal Megatron
"mpu" (model parallel unit) and handed to `deepspeed.initialize(mpu=...)`, as Megatron-DeepSpeed
does. In DeepSpeed 0.19.8 the engine then sets `deepspeed.utils.groups.mpu = mpu`
(DeepSpeedEngine._configure_distributed_model) before it calls `set_deepspeed_parallelism()` on
every MoE layer, which creates the expert groups (`groups._create_expert_and_data_parallel`, or
with enable_expert_tensor_parallelism `groups._create_expert_data_and_model_parallel`, which also
sets `groups.expert_tensor_parallel_world_size` to tp). With groups.mpu set, MOELayer keeps a 1/tp
share of the capacity dim before the all-to-all (`mappings.drop_tokens`) and gathers it back after
(`mappings.gather_tokens`), and dropless gating pads C to a multiple of tp.

Every case builds a stock `deepspeed.moe.layer.MoE` and turbomoe's MoE with the same weights (each
expert its own random weights, seeded by its global index, so a routing mistake cannot hide behind
identical experts), feeds both the same input on both TP ranks (as Megatron's non-expert tensor
parallelism gives), runs forward and backward of sum(out^2) + l_aux under the same seed, and
records per rank the relative difference max|turbo - stock| / max|stock| of the output, l_aux, the
input gradient and every parameter gradient, and whether exp_counts are equal. As a check that
tensor parallelism really is on, the same stock layer is also run with groups.mpu = None (tp = 1)
and turbomoe's output and input gradient are compared with it; with ep_size = 1 each TP rank's
expert gradients are then a part of the tp = 1 ones, and their sum over the TP group equals them.

Without --expert-tp: expert tensor parallelism off (Megatron-DeepSpeed's default), ep_size 1 and 2.
ep_size 2 puts the experts' all-to-all over the same two ranks as the TP group: DeepSpeed allows
it (groups._create_expert_and_data_parallel, the path without expert TP, ignores the mpu), and it
is exact: each rank sends its 1/tp share of every expert's C rows to the expert's owner, so an
expert sees each of its rows once.
With --expert-tp: enable_expert_tensor_parallelism=True; DeepSpeed then keeps the expert TP size
in a global (groups.expert_tensor_parallel_world_size) that changes every layer, hence a launch of
its own. _create_expert_data_and_model_parallel requires ep_size to divide the data parallel
size, 1 here, so ep_size = 1. Stock does not pad dropless C under expert TP (its gating pads only
without it) although MOELayer still drops to 1/tp, so an odd largest count fails drop_tokens'
divisibility assert: the stock comparison uses an input with an even largest count, and turbomoe
(which pads) is also checked against tp = 1 on an odd one.
Each rank writes DIR/result_{main|expert_tp}_rank{r}.json.
"""
import argparse
import json
import math
import os
import zlib

import deepspeed
import torch
import torch.distributed as tdist
from deepspeed.moe.layer import MoE as StockMoE
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
from torch import nn

from turbomoe.integrations import deepspeed as tds
from turbomoe.integrations.deepspeed_gating import expert_capacity

M, F, E, B, T = 16, 24, 4, 2, 16  # S = B * T = 32 tokens per rank, the same on both TP ranks


class MegatronStyleMPU:
    """Megatron's parallel_state interface, the part DeepSpeed calls, over torch.distributed:
    all ranks form one tensor-parallel group; pipeline and data parallel sizes are 1.

    Used by DeepSpeed through: bwc_tensor_model_parallel_{world_size,rank,group} (mappings.py,
    sharded_moe.py; they prefer get_tensor_model_parallel_*), groups._get_data_parallel_{group,
    world_size} and _get_data_parallel_group_ranks (get_data_parallel_*), groups._get_model_parallel_
    world_size and the engine's checkpoint rank (get_model_parallel_*), bwc_pipeline_parallel_world_size
    (get_pipeline_model_parallel_world_size) and DeepSpeedConfig (get_data_parallel_world_size).
    """

    def __init__(self):
        world, rank = tdist.get_world_size(), tdist.get_rank()
        self._tp_group = tdist.new_group(list(range(world)))
        dp_groups = [tdist.new_group([r]) for r in range(world)]  # every rank takes part in each new_group
        self._dp_group, self._dp_ranks = dp_groups[rank], [rank]
        self._pp_group = dp_groups[rank]

    # tensor model parallel (Megatron-LM >= 2 names; DeepSpeed's bwc helpers try these first)
    def get_tensor_model_parallel_group(self):
        return self._tp_group

    def get_tensor_model_parallel_world_size(self):
        return tdist.get_world_size(self._tp_group)

    def get_tensor_model_parallel_rank(self):
        return tdist.get_rank(self._tp_group)

    def get_tensor_model_parallel_src_rank(self):
        return 0

    # model parallel (the older names; with pp = 1 the same as tensor parallel)
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank

    # data parallel: each rank alone
    def get_data_parallel_group(self):
        return self._dp_group

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group_ranks(self):
        return self._dp_ranks

    # pipeline parallel: one stage
    def get_pipeline_model_parallel_group(self):
        return self._pp_group

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0


def gloo_all_gather_into_tensor_shim():
    """DeepSpeed's mappings._gather_tokens all-gathers into a flat [tp * numel] buffer. NCCL takes
    that (it checks sizes only); gloo (torch 2.13) wants the output shaped [tp * d0, ...] and raises
    "invalid tensor size". View the flat buffer that way (same memory, same order: the gather
    concatenates along dim 0). Test harness only: turbomoe and stock both call the same mappings."""
    cdb = deepspeed.comm.comm.cdb
    inner = cdb.all_gather_function

    def all_gather_function(output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.dim() == 1 and input_tensor.dim() > 1:
            n = output_tensor.numel() // input_tensor.numel()
            output_tensor = output_tensor.view(n * input_tensor.shape[0], *input_tensor.shape[1:])
        return inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)

    cdb.all_gather_function = all_gather_function


def expert(kind):
    return tds.SwiGLUExpert(M, F) if kind == "swiglu" else nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M))


# name -> (ep_size, expert kind, MoE kwargs). Capacity factor E: C = S (k=1) or 2S (k=2), nothing
# drops and C is even (stock asserts C % tp == 0 when dropping). "top2_drops": C = 8 < the busiest
# expert's load. Dropless: the input is chosen so that the largest count is odd, so C is padded.
# k=1 uses the first-come ("position") policy, use_rts=False. Both expert kinds run on turbomoe's
# grouped GEMMs; dropless with ep_size 1 must leave turbomoe's rows layout for the capacity one
# under tp > 1 (otherwise no drop_tokens: each TP rank's expert gradients would differ from stock's).
MAIN_CASES = {
    "a_ep1_top1_capacity": (1, "mlp", dict(k=1, capacity_factor=float(E), use_rts=False)),
    "a_ep1_top2_capacity": (1, "mlp", dict(k=2, capacity_factor=float(E))),
    "a_ep1_top2_drops": (1, "swiglu", dict(k=2, capacity_factor=0.5)),
    "b_ep2_top1_capacity": (2, "mlp", dict(k=1, capacity_factor=float(E), use_rts=False)),
    "b_ep2_top2_capacity": (2, "swiglu", dict(k=2, capacity_factor=float(E))),
    "c_ep1_top1_dropless": (1, "mlp", dict(k=1, drop_tokens=False)),
    "c_ep1_top2_dropless": (1, "swiglu", dict(k=2, drop_tokens=False)),
    "c_ep2_top2_dropless": (2, "mlp", dict(k=2, drop_tokens=False)),
}
EXPERT_TP_CASES = {
    "d_etp_top1_capacity": (1, "mlp", dict(k=1, capacity_factor=float(E), use_rts=False)),
    "d_etp_top2_capacity": (1, "swiglu", dict(k=2, capacity_factor=float(E))),
    "d_etp_top2_dropless": (1, "mlp", dict(k=2, drop_tokens=False)),
}


def init_weights(layer, case, ep_rank, num_local):
    """Deterministic weights, the same on both TP ranks; each expert's depend on its global index."""
    for name, p in layer.named_parameters():
        key = name
        parts = name.split(".")
        if "deepspeed_experts" in parts:
            i = parts.index("deepspeed_experts") + 1
            parts[i] = str(ep_rank * num_local + int(parts[i]))
            key = ".".join(parts)
        g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{key}".encode()))
        scale = 1 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.1
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def build_pair(case, ep_size, kind, kw, expert_tp):
    kw = dict(hidden_size=M, num_experts=E, ep_size=ep_size, min_capacity=0,
              enable_expert_tensor_parallelism=expert_tp, **kw)
    stock = StockMoE(expert=expert(kind), **kw)
    turbo = tds.MoE(expert=expert(kind), **kw)
    assert type(stock) is StockMoE and type(turbo) is tds.MoE
    # The expert-parallel rank is the global rank: ep groups are [0, 1] (ep 2) or [0], [1] (ep 1).
    init_weights(stock, case, tdist.get_rank() if ep_size > 1 else 0, stock.num_local_experts)
    turbo.load_state_dict(stock.state_dict())
    return nn.ModuleDict({"stock": stock, "turbo": turbo})


def make_input(case, seed):
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/x".encode()) + seed)
    return torch.randn(B, T, M, generator=g)  # not rank-dependent: TP ranks hold the same tokens


def run(layer, x):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(11)  # the gate's draws (top-2 sampling) are the same on both TP ranks, as Megatron's
    out, l_aux, counts = layer(x)
    (out.square().sum() + l_aux).backward()
    grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in layer.named_parameters()}
    return dict(out=out.detach(), l_aux=l_aux.detach(), counts=counts.detach(), dx=x.grad.detach(), grads=grads)


def rel(a, b):
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def gate_counts(stock, x):
    """Stock's exp_counts and C from its gate alone (no drop_tokens, which an unpadded C fails)."""
    with torch.no_grad():
        torch.manual_seed(11)
        gate_output = stock.deepspeed_moe.gate(x.reshape(-1, M), None, True)
    return gate_output[-1], int(gate_output[1])


def input_with_max_count(case, stock, parity):
    """An input whose largest expert count (over the ep group; the ranks' inputs are equal) is odd
    (parity 1: dropless C gets padded to a multiple of tp, C = max + 1) or even (parity 0)."""
    for seed in range(64):
        x = make_input(case, seed)
        counts, _ = gate_counts(stock, x)
        if int(counts.max()) % 2 == parity:
            return x
    raise RuntimeError(f"no input whose largest count has parity {parity}")


def capacities(stock, turbo, x):
    counts, stock_c = gate_counts(stock, x)
    turbo_c = expert_capacity(turbo.deepspeed_moe.gate, B * T, counts.to(torch.int32), turbo.deepspeed_moe.ep_group)
    return dict(max_count=int(counts.max()), stock=stock_c, turbo=turbo_c)


def vs_tp1(stock, got, x, ep_size):
    """turbomoe's results under TP against stock's with groups.mpu = None (tp = 1: no drop_tokens
    or gather_tokens): output, l_aux, input and gate gradients equal; with ep_size 1, each TP
    rank's expert gradients are partial (no expert TP) or full (expert TP), their TP sum (no
    expert TP) or themselves (expert TP) equal tp = 1's."""
    mpu, groups.mpu = groups.mpu, None
    try:
        ref = run(stock, x)
    finally:
        groups.mpu = mpu
    rec = {"vs_tp1": {k: rel(got[k], ref[k]) for k in ("out", "l_aux", "dx")}}
    if ep_size == 1:
        experts = [n for n in ref["grads"] if "deepspeed_experts" in n]
        etp = groups._get_expert_model_parallel_world_size() > 1
        err = 0.0
        for n in experts:
            g = got["grads"][n].clone()
            if not etp:
                tdist.all_reduce(g, group=mpu.get_tensor_model_parallel_group())
            err = max(err, rel(g, ref["grads"][n]))
        rec["vs_tp1_expert_grads"] = err
        rec["expert_grads_are_partial"] = any(rel(got["grads"][n], ref["grads"][n]) > 1e-3 for n in experts)
        rec["gate_grad_vs_tp1"] = rel(got["grads"]["deepspeed_moe.gate.wg.weight"],
                                      ref["grads"]["deepspeed_moe.gate.wg.weight"])
    return rec


def run_case(case, pair, ep_size, kw, expert_tp):
    stock, turbo = pair["stock"], pair["turbo"]
    rec = {}
    dropless = not kw.get("drop_tokens", True)
    # Under expert TP stock does not pad dropless C (see deepspeed_gating.expert_capacity): it
    # needs an even largest count. turbomoe also runs on an odd one, checked against tp = 1 below.
    x = input_with_max_count(case, stock, 0 if expert_tp else 1) if dropless else make_input(case, 0)
    if dropless:
        rec["capacity"] = capacities(stock, turbo, x)
    a, b = run(stock, x), run(turbo, x)
    assert a["grads"].keys() == b["grads"].keys()
    rec["counts_equal"] = torch.equal(a["counts"], b["counts"]) and a["counts"].dtype == b["counts"].dtype
    rec["err"] = {k: rel(b[k], a[k]) for k in ("out", "l_aux", "dx")}
    rec["err"].update({f"grad:{n}": rel(b["grads"][n], a["grads"][n]) for n in a["grads"]})
    rec["grad_names"] = sorted(a["grads"])
    rec["tokens_dropped"] = bool((a["out"].reshape(-1, M).abs().sum(1) == 0).any())
    rec.update(vs_tp1(stock, b, x, ep_size))
    if dropless and expert_tp:
        x = input_with_max_count(case, stock, 1)
        odd = {"capacity": capacities(stock, turbo, x)}
        odd.update(vs_tp1(stock, run(turbo, x), x, ep_size))
        try:  # both ranks fail (or not) alike: same input, and the assert comes before any collective
            run(stock, x)
            odd["stock_runs"] = True
        except AssertionError:
            odd["stock_runs"] = False
        rec["odd_max_count"] = odd
    return rec


def init_two_ranks():
    """The launched script's arguments (--workdir DIR [--expert-tp]), once gloo is up with the shim."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--expert-tp", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    gloo_all_gather_into_tensor_shim()
    return args


def main():
    args = init_two_ranks()
    rank = tdist.get_rank()
    assert tdist.get_world_size() == 2
    torch.set_num_threads(1)

    mpu = MegatronStyleMPU()
    cases = EXPERT_TP_CASES if args.expert_tp else MAIN_CASES
    torch.manual_seed(0)
    model = nn.ModuleDict({case: build_pair(case, ep, kind, kw, args.expert_tp)
                           for case, (ep, kind, kw) in cases.items()})
    # As Megatron-DeepSpeed: the engine registers mpu in deepspeed.utils.groups and creates the
    # expert groups of every MoE layer (set_deepspeed_parallelism).
    engine, *_ = deepspeed.initialize(model=model, mpu=mpu, config={"train_micro_batch_size_per_gpu": 1,
                                                                     "steps_per_print": 10**6})
    result = {
        "mpu_registered": groups.mpu is mpu,
        "tp": bwc_tensor_model_parallel_world_size(groups.mpu),
        "expert_tp": groups._get_expert_model_parallel_world_size(),
        "cases": {},
    }
    for case, (ep, _, kw) in cases.items():
        pair = engine.module[case]
        assert pair["stock"].deepspeed_moe.ep_size == ep and pair["turbo"].deepspeed_moe.ep_group is not None
        result["cases"][case] = run_case(case, pair, ep, kw, args.expert_tp)
    tag = "expert_tp" if args.expert_tp else "main"
    with open(os.path.join(args.workdir, f"result_{tag}_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""turbomoe's grouped ParallelMLP experts vs stock (one by one) under tensor parallelism
(tests/test_megatron_mlp_tp.py).

    deepspeed --num_gpus 2 tests/megatron_tp_script.py --workdir DIR [--expert-tp]

Two CPU ranks (gloo) forming one tensor-parallel group, described to DeepSpeed by the minimal
Megatron mpu of tests/ds_tp_script.py, as Megatron-DeepSpeed passes its own to deepspeed.initialize.
The experts are tests/megatron_parallel_mlp.py's ParallelMLP on megatron-core's linears:
  without --expert-tp (Megatron-DeepSpeed's default): the linears hold all of each expert (a group of
      one rank: no slicing, no communication); MOELayer splits the capacity rows over the TP ranks.
      ep_size 1 and 2.
  with --expert-tp (enable_expert_tensor_parallelism): the linears are sliced over the TP group
      (column: ffn/2 rows of W1 and b1; row: ffn/2 columns of W2), the input gradient and the output
      are summed over it; MOELayer gathers all rows onto both ranks. In one case turbomoe's copies
      of the linears hold no group, as Megatron-DeepSpeed's: it sums over the registered mpu's.
Each case builds stock's and turbomoe's MoE with the same weights (each rank its own slices), the
same input on both ranks, forward and backward of sum(out^2) + l_aux, and records the relative
difference of the output, l_aux, the input gradient and every parameter gradient.
Each rank writes DIR/result_{main|expert_tp}_rank{r}.json.
"""
import json
import math
import os
import zlib

import deepspeed
import torch
import torch.distributed as tdist
from deepspeed.moe.layer import MoE as StockMoE
from torch import nn

from ds_tp_script import MegatronStyleMPU, init_two_ranks, rel, run
from megatron_parallel_mlp import ParallelMLP
from turbomoe.integrations import deepspeed as tds

M, F, E, B, T = 16, 20, 4, 2, 16  # S = 32 tokens per rank, the same on both TP ranks

# name -> (ep_size, activation, MoE kwargs). Capacity factor E: nothing drops, C even (stock
# asserts C % tp == 0 when it splits the rows).
MAIN_CASES = {
    "ep1_top2_bias_gelu": (1, "bias_gelu", dict(k=2, capacity_factor=float(E))),
    "ep1_top2_swiglu_drops": (1, "swiglu", dict(k=2, capacity_factor=0.5)),
    "ep2_top2_gelu": (2, "gelu", dict(k=2, capacity_factor=float(E))),
}
EXPERT_TP_CASES = {
    "etp_top2_bias_gelu": (1, "bias_gelu", dict(k=2, capacity_factor=float(E))),
    "etp_top1_squared_relu": (1, "squared_relu", dict(k=1, capacity_factor=float(E), use_rts=False)),
    "etp_top2_swiglu_drops": (1, "swiglu", dict(k=2, capacity_factor=0.5)),
}
GROUP_FROM_MPU = {"etp_top1_squared_relu"}


def build_pair(case, ep_size, act, kw, expert_tp, tp_group):
    kw = dict(hidden_size=M, num_experts=E, ep_size=ep_size, min_capacity=0,
              enable_expert_tensor_parallelism=expert_tp, **kw)
    expert = lambda: ParallelMLP(M, F, act=act, tp_group=tp_group, dtype=torch.float32)  # noqa: E731
    stock, turbo = StockMoE(expert=expert(), **kw), tds.MoE(expert=expert(), **kw)
    rank = tdist.get_rank()
    for name, p in stock.named_parameters():  # each rank's own slices, each expert its own values
        g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}/{name}".encode()))
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * (1 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.1))
    turbo.load_state_dict(stock.state_dict())
    if case in GROUP_FROM_MPU:
        # As Megatron-DeepSpeed's own linears, which keep no group: turbomoe then sums over the
        # tensor-parallel group of the mpu registered with DeepSpeed (stock's keep theirs).
        for e in turbo.deepspeed_moe.experts.deepspeed_experts:
            e.dense_h_to_4h.tp_group = e.dense_4h_to_h.tp_group = None
    return nn.ModuleDict({"stock": stock, "turbo": turbo})


def main():
    args = init_two_ranks()
    torch.set_num_threads(1)
    mpu = MegatronStyleMPU()
    # Expert TP: the linears sum over the TP group; otherwise each rank's experts are whole.
    tp_group = mpu.get_tensor_model_parallel_group() if args.expert_tp else mpu.get_data_parallel_group()
    cases = EXPERT_TP_CASES if args.expert_tp else MAIN_CASES
    torch.manual_seed(0)
    model = nn.ModuleDict({case: build_pair(case, ep, act, kw, args.expert_tp, tp_group)
                           for case, (ep, act, kw) in cases.items()})
    engine, *_ = deepspeed.initialize(model=model, mpu=mpu, config={"train_micro_batch_size_per_gpu": 1,
                                                                     "steps_per_print": 10**6})
    result = {"cases": {}}
    for case in cases:
        stock, turbo = engine.module[case]["stock"], engine.module[case]["turbo"]
        fc1 = turbo.deepspeed_moe.experts.deepspeed_experts[0].dense_h_to_4h
        g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
        x = torch.randn(B, T, M, generator=g)  # not rank-dependent: TP ranks hold the same tokens
        a, b = run(stock, x), run(turbo, x)
        err = {k: rel(b[k], a[k]) for k in ("out", "l_aux", "dx")}
        err.update({f"grad:{n}": rel(b["grads"][n], a["grads"][n]) for n in a["grads"]})
        result["cases"][case] = {
            "fast_path": turbo.deepspeed_moe.expert_fast_path,
            "fc1_rows": fc1.weight.shape[0], "tp_group_size": tdist.get_world_size(tp_group),
            "ep_size": turbo.deepspeed_moe.ep_size, "counts_equal": torch.equal(a["counts"], b["counts"]),
            "tokens_dropped": bool((a["out"].reshape(-1, M).abs().sum(1) == 0).any()),
            "err": err, "grad_names": sorted(a["grads"]),
        }
    tag = "expert_tp" if args.expert_tp else "main"
    with open(os.path.join(args.workdir, f"result_{tag}_rank{tdist.get_rank()}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""turbomoe's DeepSpeed layer against stock's over an expert-parallel group, float64
(tests/test_deepspeed_layer_review.py).

    deepspeed --num_gpus 2 tests/ds_layer_review_script.py --workdir DIR

Two gloo ranks, ep_size = 2 (E = 8: four local experts a rank, each with its own weights). Each case
builds a stock and a turbomoe layer on the same weights, runs forward and backward of
sum(out^2) + l_aux on both under the same rank-dependent seed and records per rank the relative
error of the output, l_aux, the input gradient and every parameter gradient, whether exp_counts
are equal (values and dtype), and whether the generator is left where stock leaves it (the next
draw). Each rank writes DIR/result_rank{r}.json.
"""
import argparse
import json
import os

import deepspeed
import torch

from conftest import rel_err
from test_deepspeed_fidelity import M, make_pair, run
from test_deepspeed_layer_review import route_first_choices_to

D = torch.float64

# name -> (expert kind, MoE kwargs, input). Inputs: "randn" [2, 20, M]; "skewed" (an offset skews
# the router: over-full experts, so drops); "one_expert" (every token's first choice expert 5, on
# rank 1, by a logit gap of ~20: at top-2 the tokens it drops keep a second route whose probability,
# ~2e-9, is below fp32's eps); "uneven" (24 tokens on rank 0, 40 on rank 1: dropless C is the
# largest count over the group).
CASES = {
    "top1_rts_drops": ("mlp", dict(k=1, capacity_factor=0.5), "skewed"),
    "top1_rsample_drops": ("mlp", dict(k=1, capacity_factor=0.5, noisy_gate_policy="RSample"), "skewed"),
    "top1_jitter_dropless": ("custom", dict(k=1, drop_tokens=False, noisy_gate_policy="Jitter"), "randn"),
    "top1_eval": ("swiglu", dict(k=1, capacity_factor=0.5, eval_capacity_factor=0.7, train=False), "skewed"),
    "top2_drops": ("mlp", dict(k=2, capacity_factor=0.5), "skewed"),
    "top2_drops_swiglu_residual": ("swiglu", dict(k=2, capacity_factor=0.5, use_residual=True), "skewed"),
    "top2_unsampled_mincap": ("custom", dict(k=2, top2_2nd_expert_sampling=False, min_capacity=3), "randn"),
    "top2_one_expert_drops": ("mlp", dict(k=2, capacity_factor=1.0), "one_expert"),
    "top2_dropless_uneven": ("mlp", dict(k=2, drop_tokens=False), "uneven"),
    "top3_drops": ("swiglu", dict(k=3, capacity_factor=0.5), "skewed"),
    "top3_dropless_uneven": ("custom", dict(k=3, drop_tokens=False), "uneven"),
}


def make_input(kind, rank):
    g = torch.Generator().manual_seed(100 + rank)
    if kind == "uneven":
        return torch.randn((24, 40)[rank], M, generator=g, dtype=D)
    if kind == "one_expert":
        return 0.5 + 0.1 * torch.rand(2, 20, M, generator=g, dtype=D)
    x = torch.randn(2, 20, M, generator=g, dtype=D)
    return x + 0.5 if kind == "skewed" else x


def run_case(expert, kw, input_kind, rank):
    kw = dict(kw)
    train = kw.pop("train", True)
    stock, turbo = make_pair(expert, dtype=D, ep_size=2, **kw)
    with torch.no_grad():  # each rank's local experts their own weights
        g = torch.Generator().manual_seed(rank)
        for p in stock.deepspeed_moe.experts.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=D), alpha=0.3)
    if input_kind == "one_expert":
        route_first_choices_to((stock, ), 5, 20.0)
    turbo.load_state_dict(stock.state_dict())
    x = make_input(input_kind, rank)
    results, next_draws = [], []
    for layer in (stock, turbo):
        layer.set_deepspeed_parallelism()
        layer.train(train)
        results.append(run(layer, x, seed=7 + rank))
        next_draws.append(torch.rand(4))
    (out_a, aux_a, counts_a, dx_a, grads_a), (out_b, aux_b, counts_b, dx_b, grads_b) = results
    err = {"out": rel_err(out_b, out_a), "l_aux": rel_err(aux_b, aux_a), "dx": rel_err(dx_b, dx_a)}
    err.update({n: rel_err(grads_b[n], grads_a[n]) for n in grads_a})
    return {"err": err, "same_grad_names": sorted(grads_a) == sorted(grads_b),
            "counts_equal": counts_a.dtype == counts_b.dtype and torch.equal(counts_a, counts_b),
            "rng_equal": torch.equal(*next_draws), "max_count": int(counts_a.max()), "tokens": x.numel() // M}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    assert deepspeed.comm.get_world_size() == 2
    torch.set_num_threads(1)
    result = {name: run_case(*case, rank) for name, case in CASES.items()}
    with open(os.path.join(args.workdir, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

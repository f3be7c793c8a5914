"""Megatron-core's own training step, stock vs turbomoe GPT (run by tests/test_megatron_gpu.py):

    torchrun --nproc_per_node 2 tests/megatron_train_script.py   # tp = 2 (+ sequence parallel), dp = 2
    torchrun --nproc_per_node 1 tests/megatron_train_script.py   # the tp = 1 cases with dp = 1
    MEGATRON_SPEC=te torchrun ...                                 # on Transformer Engine's spec

Each case builds the same small GPT twice from one seed (stock's local spec: SequentialMLP experts, or
with MEGATRON_SPEC=te Transformer Engine's: TE linears, norms and attention, TEGroupedMLP experts;
turbomoe's spec on the same, its experts and every other weight copied from stock's), wraps each as Megatron's
training does (Float16Module for bf16, DistributedDataParallel), builds its optimizer with
get_megatron_optimizer (Adam, clip 1.0, weight decay; bf16 keeps fp32 main params; the distributed
optimizer in two cases) and runs STEPS steps of Megatron's train_step on one fixed random batch per
data-parallel rank: zero_grad_buffer, forward + backward of the mean token loss,
finalize_model_grads (data-parallel reduction, sequence-parallel grads summed over tp, the expert-bias
update), optimizer.step(). Experts: tensor parallel 1 (turbomoe needs it), expert parallel 1. The tp = 2
cases use sequence parallelism (Megatron's MoELayer refuses to train with tp > 1 without it) and so
megatron_common.SequenceParallelLayerNorm: the local spec's torch norm refuses sequence parallelism
when neither apex nor Transformer Engine is installed.
Asserted: equal per-step losses (fp32 rtol 2e-5), the loss going down, close final parameters and
expert biases (the bias case: moved by finalize_model_grads),
data-parallel replicas identical; in the capacity cases, no host sync in turbomoe's forward + backward
(set_sync_debug_mode("error")); with tp = 2 and no sequence parallelism both MoE layers refuse to train.
Rank 0 prints one "LOSSES <case>" line per case (data-parallel means); each rank ends with "TRAIN PASS <rank>".
"""
import os
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,  # noqa: E402
                                       finalize_model_grads)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

from megatron_common import gpt_batch, gpt_pair, gpt_tensors_as_stock, model_parallel, moe_config  # noqa: E402

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None  # stock 0.16.1 without Transformer Engine (see test_megatron_gpu.py)

VOCAB, SEQ, BATCH, STEPS, LR = 128, 64, 4, 5, 1e-3
TE = os.environ.get("MEGATRON_SPEC", "local") == "te"


class Case(NamedTuple):
    tp: int  # data parallel: the world size / tp
    overrides: dict
    dtype: torch.dtype = torch.float32
    distributed_optimizer: bool = False


CAPACITY_POSITION = dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position")
CASES = {
    "tp2-sp dropless": Case(2, {}),
    "tp2-sp capacity-position sigmoid expert-bias seq-aux": Case(2, dict(
        CAPACITY_POSITION, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss")),
    "dp dropless distributed-optimizer": Case(1, {}, distributed_optimizer=True),
    "dp capacity-probs": Case(1, dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs")),
    # bf16: one MoE layer, the first (a later one routes near-tied tokens apart: test_megatron_gpu.gpt_config)
    "dp bf16 distributed-optimizer": Case(1, dict(moe_layer_freq=[1, 0]), torch.bfloat16, True),
}


def gpt_config(case: Case, sequence_parallel: bool):
    return moe_config(num_moe_experts=8, moe_router_topk=2, hidden_size=64, num_attention_heads=4,
                      ffn_hidden_size=128, moe_ffn_hidden_size=48, params_dtype=case.dtype,
                      bf16=case.dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                      moe_router_dtype="fp32", tensor_model_parallel_size=case.tp,
                      sequence_parallel=sequence_parallel, expert_tensor_parallel_size=1, moe_grouped_gemm=TE,
                      **case.overrides)


def wrap(gpt, cfg, case: Case):
    """(DistributedDataParallel model, Megatron optimizer), as megatron's training set-up builds them."""
    module = Float16Module(cfg, gpt) if cfg.bf16 else gpt
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=case.distributed_optimizer), module)
    opt = get_megatron_optimizer(OptimizerConfig(
        lr=LR, weight_decay=0.01, clip_grad=1.0, bf16=cfg.bf16, params_dtype=cfg.params_dtype,
        use_distributed_optimizer=case.distributed_optimizer), [ddp])
    return ddp, opt


def train_step(ddp, opt, data) -> torch.Tensor:
    ddp.zero_grad_buffer()
    opt.zero_grad()
    tokens, pos, mask = data
    loss = ddp(tokens, pos, mask, labels=tokens).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    ok, grad_norm, _ = opt.step()
    assert ok and torch.isfinite(torch.as_tensor(grad_norm)), f"optimizer step failed (grad norm {grad_norm})"
    return loss.detach()


def assert_no_host_sync(ddp, gpt, data, name: str):
    """One forward + backward of turbomoe's GPT under set_sync_debug_mode("error"), from the embedding's
    output to the (vocab-parallel) logits: stock's VocabParallelEmbedding (tp > 1) and its vocab-parallel
    cross-entropy index by boolean masks, host syncs that are not the MoE layer's."""
    tokens, pos, mask = data
    emb = gpt.embedding(input_ids=tokens, position_ids=pos).detach()
    ddp.zero_grad_buffer()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ddp(tokens, pos, mask, decoder_input=emb).float().square().mean().backward()
    except RuntimeError as e:
        raise AssertionError(f"{name}: host sync in turbomoe's GPT forward + backward: {e}") from e
    finally:
        torch.cuda.set_sync_debug_mode("default")


def replica_spread(tensors: dict, group) -> float:
    """Largest |difference| of the tensors between the ranks of group (0 when they are replicas)."""
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors.values()])
    gathered = [torch.empty_like(flat) for _ in range(group.size())]
    dist.all_gather(gathered, flat, group=group)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def run_case(name: str, case: Case, rank: int):
    cfg = gpt_config(case, sequence_parallel=case.tp > 1)
    stock_gpt, turbo_gpt = gpt_pair(cfg, VOCAB, SEQ, te=TE)
    dp_group = parallel_state.get_data_parallel_group()
    data = gpt_batch(VOCAB, SEQ, BATCH, seed=1 + parallel_state.get_data_parallel_rank())  # same over tp
    losses, final = [], []
    for gpt in (stock_gpt, turbo_gpt):
        ddp, opt = wrap(gpt, cfg, case)
        losses.append(torch.stack([train_step(ddp, opt, data) for _ in range(STEPS)]))
        biases = {n: b for n, b in gpt.named_buffers() if n.endswith("expert_bias")}
        final.append(dict(gpt_tensors_as_stock(gpt), **biases))
        if gpt is turbo_gpt and cfg.moe_expert_capacity_factor is not None:
            assert_no_host_sync(ddp, gpt, data, name)
    fp32 = case.dtype == torch.float32
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-5 if fp32 else 2e-2, atol=0,
                               msg=lambda m: f"{name}: per-step losses differ\n{m}")
    assert losses[0][-1] < losses[0][0], f"{name}: stock's loss did not go down: {losses[0].tolist()}"
    assert final[0].keys() == final[1].keys(), f"{name}: parameter names differ"
    if cfg.moe_router_enable_expert_bias:  # finalize_model_grads updated it
        assert all(t.abs().sum() > 0 for k, t in final[0].items() if k.endswith("expert_bias")), f"{name}: no bias"
    # fp32: Adam turns a grad's rounding difference d into an update difference of at most ~lr * d / eps.
    # bf16: the routes of near-tied tokens may differ after the first step; Adam moves a weight by ~lr a step.
    atol = 1e-4 if fp32 else 2 * LR * STEPS
    for key, p in final[0].items():
        torch.testing.assert_close(final[1][key].float(), p.float(), rtol=1e-4 if fp32 else 2e-2, atol=atol,
                                   msg=lambda m: f"{name}: final {key}\n{m}")
    param_diff = max((final[1][k].float() - p.float()).abs().max().item() for k, p in final[0].items())
    if dp_group.size() > 1:  # data-parallel replicas stay identical (DDP reduced every grad)
        for which, tensors in zip(("stock", "turbomoe"), final):
            assert replica_spread(tensors, dp_group) == 0, f"{name}: {which}'s data-parallel replicas differ"
    note = ""
    if case.tp > 1:  # expert weights are replicated over tp (etp = 1); printed, not asserted (see the notes)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        spread = [replica_spread({k: t for k, t in f.items() if ".experts." in k}, tp_group) for f in final]
        note = f"; expert weights across tp ranks differ by up to stock {spread[0]:.3g}, turbomoe {spread[1]:.3g}"
    for ls in losses:
        dist.all_reduce(ls, group=dp_group)
        ls /= dp_group.size()
    if rank == 0:
        stock, turbo = ([round(v, 6) for v in ls.tolist()] for ls in losses)
        print(f"LOSSES {name} ({'te' if TE else 'local'} spec, tp {case.tp}, dp {dp_group.size()}, "
              f"{str(case.dtype)[6:]}): stock {stock} "
              f"turbomoe {turbo}; final params max |diff| {param_diff:.3g}{note}", flush=True)


def check_tp_needs_sequence_parallel(rank: int):
    """tp = 2 without sequence parallelism: Megatron's MoELayer.forward refuses to train; turbomoe's
    layer keeps that forward, so both raise the same ValueError."""
    cfg = gpt_config(Case(2, {}), sequence_parallel=False)
    data = gpt_batch(VOCAB, SEQ, BATCH)
    errors = []
    for gpt in gpt_pair(cfg, VOCAB, SEQ, te=TE):
        try:
            gpt(*data, labels=data[0])
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    assert errors[0] is not None and errors[0] == errors[1], f"tp 2 without sequence parallelism: {errors}"
    if rank == 0:
        print(f"tp2 without sequence_parallel: stock and turbomoe both raise ValueError: {errors[0]}", flush=True)


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    for name, case in CASES.items():
        if world % case.tp:
            continue
        with model_parallel("nccl", tp=case.tp):
            run_case(name, case, rank)
    if world >= 2:
        with model_parallel("nccl", tp=2):
            check_tp_needs_sequence_parallel(rank)
    dist.barrier()
    dist.destroy_process_group()
    print(f"TRAIN PASS {rank}", flush=True)


if __name__ == "__main__":
    main()

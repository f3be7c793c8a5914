"""Resume a checkpoint on another number of ranks or another ep_size: train on 4 GPUs at ep_size 4,
continue on 2 at ep_size 2 (or the other way), the same run.

DeepSpeed's load_checkpoint reads each rank's ZeRO partition back into the same rank, so it needs
the layout that wrote it. Here every rank instead reads the whole parameters it now holds (the
non-expert ones and its experts, by global expert id) from the files all the old ranks wrote:
the fp32 master weights and Adam's two moments reassembled from their ZeRO 1/2 (or bf16 optimizer)
partitions (turbomoe.export's reader), and writes them into its own new partition through
DeepSpeed's fragment mapping of each parameter; the module's weights are the masters in the
training dtype, as the optimizer's step leaves them. The step count, the learning-rate schedule
and the engine's counters come along. The data stream continues where it stopped as long as a
step's samples stay the same (micro_batch_size x grad_accum x ranks: checked by the recipe).
Not bit for bit the run that would have gone on (gradients are summed over other ranks, in
another order), but the same parameters, optimizer state and data.
"""
import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from turbomoe.export import RunCheckpoint, global_expert_name

ADAM_STATES = ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def load_resharded(engine, model, tag_dir: str, ep_rank: int, ep_size: int) -> int:
    """Load tag_dir (written by any number of ranks and ep_size, ZeRO 1/2) into this rank's engine
    and model; returns the step it was written at."""
    ckpt = RunCheckpoint(tag_dir)
    num_local = ckpt.config.num_experts // ep_size
    names = {name: global_expert_name(name, ep_rank, num_local) for name, _ in model.named_parameters()}
    states = ckpt.zero_states(("master",) + ADAM_STATES, set(names.values()))
    step = ckpt.optimizer_step()
    if states is None or step is None:
        raise ValueError(f"{tag_dir}: no ZeRO 1/2 optimizer partitions (written with zero_stage 0?), so it "
                         f"resumes only on the ranks and ep_size that wrote it")
    opt = engine.optimizer
    inner = opt.optimizer
    flats = opt.fp32_groups_flat_partition if isinstance(opt, BF16_Optimizer) else opt.single_partition_of_fp32_groups
    # One flat partition a parameter group, the base optimizer's only parameter of that group.
    targets = [dict(_adam_state(inner, flat, group, step), master=flat)
               for group, flat in zip(inner.param_groups, flats)]
    for name, param in model.named_parameters():
        full = {key: states[key][names[name]] for key in states}
        param.copy_(full["master"])
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # wholly in other ranks' partitions
            continue
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        for key, value in full.items():
            dst = targets[mapping.param_group_index][key]
            dst.narrow(0, hp.start, hp.numel).copy_(value.reshape(-1).narrow(0, lp.start, lp.numel))
    module = ckpt.states["module"]
    for name, buf in model.named_buffers():
        if name in module:
            buf.copy_(module[name])
    _restore_schedule(engine, ckpt.states)
    return ckpt.step


def _adam_state(inner, flat, group, step) -> dict:
    """The base optimizer's state of one flat partition, made if it has none yet (DeepSpeed's bf16
    optimizer makes it at the first step), with the checkpoint's step count."""
    state = inner.state[flat]
    for key in ADAM_STATES:
        if key not in state:
            state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
    # torch's AdamW keeps the step on the parameter's device when fused or capturable, else on the CPU.
    on_device = group.get("fused") or group.get("capturable")
    state["step"] = step.detach().to(torch.float32).to(flat.device if on_device else "cpu").clone()
    return state


def _restore_schedule(engine, saved: dict):
    """The learning-rate schedule at the checkpoint's step, its rate already in the optimizer's groups
    (as loading the optimizer's state would leave them), and the engine's step and sample counters."""
    sched = engine.lr_scheduler
    if sched is not None and saved.get("lr_scheduler") is not None:
        set_schedule(sched, saved["lr_scheduler"]["last_epoch"])
    engine.global_steps = saved["global_steps"]
    engine.global_samples = saved.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = saved["skipped_steps"]


def set_schedule(sched, last_epoch: int):
    """The learning-rate schedule at last_epoch, by this run's settings (train.steps may have grown since
    the checkpoint), its rate in the optimizer's groups for the next step."""
    sched.last_epoch = last_epoch
    lrs = [base * fn(last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs

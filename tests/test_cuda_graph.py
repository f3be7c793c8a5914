"""The model's training forward and backward replayed from CUDA graphs (turbomoe.models.cuda_graph,
the recipe's train.cuda_graph): the same bits as the eager model, step after step, with gradients
kept or set to None between backwards, accumulated over micro-batches, and with random routing
(capacity with RTS); eager where the call does not match the capture; clear errors otherwise."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
from tests.launching import deepspeed_launch, launcher_env  # noqa: E402
from tests.test_grouped_gemm import rel_err  # noqa: E402
from tests.test_models import build, tiny  # noqa: E402
from turbomoe.models.cuda_graph import _scratch_like, coalesce_adds, graph_training_forward  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def batch(B, T, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T + 1), generator=g).cuda()


def train(model, steps, micro, set_to_none, seed=0, B=4, T=32):
    """steps optimizer steps of micro micro-batches each; the per-micro-batch losses, on the host."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        for m in range(micro):
            torch.manual_seed(1000 * step + m)  # RTS draws: a function of the step, as in the recipe
            b = batch(B, T, model.config.vocab_size, seed + 10 * step + m)
            out = model(b[:, :-1], b[:, 1:])
            (out.loss + 0.01 * out.aux_loss).backward()
            losses.append(out.loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return torch.stack(losses).cpu()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("micro,set_to_none", [(1, True), (1, False), (3, False), (2, True)])
@pytest.mark.parametrize("moe", [{}, {"capacity_factor": 1.0}], ids=["dropless", "capacity_rts"])
def test_graphs_train_as_eager(dtype, micro, set_to_none, moe):
    cfg = tiny(num_experts=8, num_hidden_layers=3, max_position_embeddings=64)
    eager = build(cfg, **moe).cuda().to(dtype)
    graphed = copy.deepcopy(eager)
    sample = batch(4, 32, cfg.vocab_size, seed=99)
    graph_training_forward(graphed, sample[:, :-1], sample[:, 1:])
    # Capture runs forwards and backwards but changes no parameter and leaves no gradient.
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), graphed.parameters()))
    assert all(p.grad is None for p in graphed.parameters())
    a = train(eager, 3, micro, set_to_none)
    b = train(graphed, 3, micro, set_to_none)
    assert torch.equal(a, b), (a, b)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p, q), name
    # Other calls run eager: evaluation, no_grad, another shape.
    x = batch(2, 16, cfg.vocab_size, seed=5)
    with torch.no_grad():
        assert torch.equal(eager(x[:, :-1], x[:, 1:]).loss, graphed(x[:, :-1], x[:, 1:]).loss)
    eager.eval(), graphed.eval()
    x = batch(4, 32, cfg.vocab_size, seed=6)
    with torch.no_grad():
        assert torch.equal(eager(x[:, :-1]).logits, graphed(x[:, :-1]).logits)


def flat_buffers(params, device=None):
    """One fp32 buffer, a view of it per parameter in order: BF16_Optimizer's fp32 gradients."""
    flat = torch.zeros(sum(p.numel() for p in params), device=device)
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    return {p: flat[a:b] for p, a, b in zip(params, offsets, offsets[1:])}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout,accumulate", [("apart", True), ("flat", True), ("flat", False)])
def test_grad_buffers_take_the_gradients(dtype, layout, accumulate, monkeypatch):
    """Parameters with a grad buffer (an fp32 main grad, as DeepSpeed's BF16_Optimizer keeps): the
    backward graph adds each micro-batch's gradient into it, bit for bit the eager gradients'
    fp32 sum (or with accumulate=False writes it: the last micro-batch's), and .grad stays None;
    the others accumulate in .grad as eager does. Buffers apart (the experts' gradients made and
    added one by one), or views of one flat buffer in parameter order: there the grouped experts'
    weight-gradient GEMMs write or add into the buffers themselves, in fp32 (not rounded to the
    model's dtype first, and with the Triton kernel's fused add summed in another order, so equal to
    the eager sums within rounding, not bit for bit)."""
    from turbomoe.integrations import expert_stack
    sinks = []  # what each grouped GEMM of the captured forward was given to write its weight gradient into
    stacked = expert_stack.stacked_grad_buffer

    def spy(blocks):
        sink = stacked(blocks)
        # the capture's forward only: its warm-up forwards write into scratch buffers of the same layout
        if expert_stack._GRAD_BUFFERS is not None and torch.cuda.is_current_stream_capturing():
            sinks.append(sink)
        return sink
    monkeypatch.setattr(expert_stack, "stacked_grad_buffer", spy)
    cfg = tiny(num_experts=8, num_hidden_layers=3)
    eager = build(cfg).cuda().to(dtype)
    graphed = copy.deepcopy(eager)
    if layout == "apart":
        bufs = {p: torch.zeros(p.numel(), device="cuda") for p in list(graphed.parameters())[::2]}
    else:
        bufs = flat_buffers(list(graphed.parameters())[1:], "cuda")  # the embedding keeps its .grad
    replays = []
    sample = batch(4, 32, cfg.vocab_size, seed=99)
    graph_training_forward(graphed, sample[:, :-1], sample[:, 1:], grad_buffers=bufs,
                           before_replay=lambda: replays.append(1), accumulate=accumulate)
    assert all(not b.any() for b in bufs.values())  # capture added nothing
    # both expert weights of each layer go to their buffers in the flat layout, none when apart
    assert len(sinks) == 2 * cfg.num_hidden_layers and all((s is not None) == (layout == "flat") for s in sinks)
    ref32 = [torch.zeros(p.numel(), device="cuda") for p in eager.parameters()]
    ref = [None] * len(ref32)
    for m in range(3):
        b = batch(4, 32, cfg.vocab_size, seed=m)
        for model in (eager, graphed):
            out = model(b[:, :-1], b[:, 1:])
            (out.loss + 0.01 * out.aux_loss).backward()
        for i, p in enumerate(eager.parameters()):
            ref32[i].mul_(accumulate).add_(p.grad.reshape(-1))
            ref[i] = p.grad if ref[i] is None else ref[i] + p.grad
            p.grad = None
    assert replays == [1, 1, 1]
    for i, ((name, p), want32, want) in enumerate(zip(graphed.named_parameters(), ref32, ref)):
        if p in bufs and layout == "flat" and "experts" in name:
            assert p.grad is None and rel_err(bufs[p], want32) < (1e-2 if dtype == torch.bfloat16 else 1e-5), name
        elif p in bufs:
            assert p.grad is None and torch.equal(bufs[p], want32), name
        else:
            assert torch.equal(p.grad, want), name
    if not accumulate:  # an eager training step would add to the last replay's gradients
        b = batch(2, 32, cfg.vocab_size, seed=5)
        with pytest.raises(RuntimeError, match="graphs write the gradient buffers"):
            graphed(b[:, :-1], b[:, 1:])
        with torch.no_grad():
            graphed(b[:, :-1], b[:, 1:])  # evaluation still runs eager


def test_warm_up_buffers_keep_the_layout():
    """The capture's warm-up sends weight gradients to zeroed buffers laid out as the real ones, so
    that it runs (and compiles) the kernels the capture will: views of one flat buffer stay views of
    one new buffer at the same offsets and strides (the grouped experts' buffers are found the same
    way), separate buffers stay separate, and the real buffers are neither read nor written."""
    from turbomoe.integrations.deepspeed_experts import SwiGLUExpert
    from turbomoe.integrations.expert_stack import pack_expert_params, stacked_grad_buffer, weight_grad_buffers
    experts = torch.nn.ModuleList([SwiGLUExpert(8, 12) for _ in range(3)])
    pack_expert_params(experts)
    params = list(experts.parameters())
    flat = torch.randn(sum(p.numel() for p in params) + 5)
    real, offset = {}, 5
    for p in params:
        real[p] = flat[offset:offset + p.numel()]
        offset += p.numel()
    apart = torch.nn.Parameter(torch.randn(4, 3))
    real[apart] = torch.randn(12)
    before = {p: b.clone() for p, b in real.items()}
    mirror = _scratch_like(real)
    assert mirror.keys() == real.keys()
    for p, b in real.items():
        m = mirror[p]
        assert (m.shape, m.stride(), m.storage_offset(), m.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)
        assert m.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() and not m.any()
    assert len({mirror[p].untyped_storage().data_ptr() for p in params}) == 1
    assert mirror[apart].untyped_storage().data_ptr() != mirror[params[0]].untyped_storage().data_ptr()
    blocks = [[e.w1.weight, e.w3.weight] for e in experts]
    with weight_grad_buffers(real, True):
        want, _ = stacked_grad_buffer(blocks)
    with weight_grad_buffers(mirror, True):
        got, _ = stacked_grad_buffer(blocks)
        got.add_(1)
    assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
    assert all(torch.equal(b, before[p]) for p, b in real.items())
    assert _scratch_like({}) == {}


def test_coalesce_adds_merges_strided_runs():
    """Pairs whose dsts and srcs lie at constant strides become strided [L, n] views; the sums are
    the same bits as one add per pair. Interleaved runs (w1 and w3 of each expert in one stacked
    gradient, their buffers apart), a run broken by a gap, pairs in shuffled order, lone pairs,
    non-contiguous and empty tensors, one pair given twice."""
    g = torch.Generator().manual_seed(0)
    n, E = 6, 5
    stacked = torch.randn(E, 2, n, generator=g, dtype=torch.float64).to(torch.bfloat16)  # [w1; w3] per expert
    down = torch.randn(E, n, generator=g).to(torch.bfloat16)
    flat = torch.randn(E * 3 * n + 40, generator=g)  # w1, w3, w2 of expert 0, then of expert 1, ...
    pairs = []
    for e in range(E):
        base = 3 * n * e
        pairs += [(flat[base:base + n], stacked[e, 0]), (flat[base + n:base + 2 * n], stacked[e, 1]),
                  (flat[base + 2 * n:base + 3 * n], down[e])]
    other = torch.randn(40, generator=g).to(torch.bfloat16)
    tail = flat[E * 3 * n:]
    pairs += [(tail[0:4], other[0:4]), (tail[10:14], other[8:12]), (tail[30:34], other[30:34]),
              (tail[20:26], other[::7][:6]),  # strided src: alone
              (tail[26:26], other[0:0]), (tail[36:40], other[36:40]), (tail[36:40], other[36:40])]  # twice: added twice
    pairs = [pairs[i] for i in torch.randperm(len(pairs), generator=g).tolist()]
    want = flat.clone()
    for dst, src in pairs:
        dst_ = want[dst.storage_offset():dst.storage_offset() + dst.numel()]
        dst_.add_(src)
    runs = coalesce_adds(pairs)
    for dst, src in runs:
        dst.add_(src)
    assert torch.equal(flat, want)
    rows = sorted(d.shape[0] if d.ndim == 2 else 1 for d, _ in runs)
    assert rows[-3:] == [E, E, E] and sum(rows) == len(pairs) and len(runs) <= len(pairs) - 3 * (E - 1)


def test_coalesce_adds_on_the_model_gradients():
    """The model's gradients into flat buffers in parameter order: each MoE layer's expert weights
    take three adds (w1, w3, w2 over all experts), every other parameter one."""
    cfg = tiny(num_experts=8, num_hidden_layers=3)
    model = build(cfg)
    params = list(model.parameters())
    bufs = flat_buffers(params)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    out = model(ids, ids)
    grads = torch.autograd.grad(out.loss + 0.01 * out.aux_loss, params)
    pairs = [(bufs[p].view(-1), gr.reshape(-1)) for p, gr in zip(params, grads)]
    runs = coalesce_adds(pairs)
    experts = 3 * cfg.num_experts * cfg.num_hidden_layers
    assert len(runs) == len(params) - experts + 3 * cfg.num_hidden_layers
    for dst, src in runs:
        dst.add_(src)
    for p, gr in zip(params, grads):
        assert torch.equal(bufs[p], gr.reshape(-1).float())


def launches(model, x):
    """Kernel launches of one training forward and backward, counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x[:, :-1], x[:, 1:]).loss.backward()
    events = prof.key_averages()
    return (sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")),
            sum(e.count for e in events if e.key == "cudaGraphLaunch"))


@pytest.mark.gpu
@needs_cuda
def test_graph_replays_instead_of_launching():
    """A replayed step launches two graphs and a few kernels around them (the loss's gradient, the
    parameters' gradients into .grad), not the eager step's hundreds."""
    cfg = tiny(num_experts=8, num_hidden_layers=3)
    model = build(cfg).cuda()
    x = batch(4, 32, cfg.vocab_size, seed=1)
    eager_kernels, _ = launches(copy.deepcopy(model), x)
    graph_training_forward(model, x[:, :-1], x[:, 1:])
    kernels, graphs = launches(model, x)
    assert graphs == 2 and kernels * 5 < eager_kernels, (kernels, graphs, eager_kernels)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_graphs_on_a_device_not_current():
    """A model on cuda:1 captured and trained with cuda:0 current, after a graph captured on cuda:0
    (which puts torch's default capture stream there, once per process): the same bits as the eager
    model trained with cuda:1 current; cuda:0 stays current."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ones(1, device="cuda:0").add_(1)
    cfg = tiny(num_experts=8, num_hidden_layers=2, max_position_embeddings=64)
    eager = build(cfg).to("cuda:1")
    graphed = copy.deepcopy(eager)
    sample = batch(4, 32, cfg.vocab_size, seed=99).to("cuda:1")
    torch.cuda.set_device(0)
    graph_training_forward(graphed, sample[:, :-1], sample[:, 1:])
    assert torch.cuda.current_device() == 0
    losses = []
    for model in (graphed, eager):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run = []
        for step in range(3):
            b = batch(4, 32, cfg.vocab_size, seed=step).to("cuda:1")
            with torch.cuda.device(1 if model is eager else 0):  # eager: the usual contract, its device current
                out = model(b[:, :-1], b[:, 1:])
                (out.loss + 0.01 * out.aux_loss).backward()
                opt.step()
                opt.zero_grad()
            run.append(out.loss.detach().cpu())
        losses.append(torch.stack(run))
    assert torch.equal(*losses), losses
    assert all(torch.equal(p, q) for p, q in zip(eager.parameters(), graphed.parameters()))
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@needs_cuda
def test_a_replay_waits_for_the_last_ones_backward():
    """A second replay before the first one's backward would overwrite the activations that backward
    reads (the graphs' memory) and give it the second's gradients: an error. Outputs dropped without a
    backward, or kept after it, free the way. Under autocast, which the capture did not see, the call
    runs eager."""
    cfg = tiny(num_experts=8, num_hidden_layers=2, max_position_embeddings=64)
    model = build(cfg).cuda()
    eager = copy.deepcopy(model)
    x = batch(2, 16, cfg.vocab_size, seed=3)
    graph_training_forward(model, x[:, :-1], x[:, 1:])
    out = model(x[:, :-1], x[:, 1:])
    with pytest.raises(RuntimeError, match="backward has not run"):
        model(x[:, :-1], x[:, 1:])
    del out
    out = model(x[:, :-1], x[:, 1:])
    out.loss.backward()
    model(x[:, :-1], x[:, 1:]).loss.backward()  # out is kept, its backward ran
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = [m(x[:, :-1], x[:, 1:]).loss for m in (model, eager)]
    assert torch.equal(*losses), losses


def test_bad_uses_raise():
    cfg = tiny()
    model = build(cfg)
    x = torch.zeros(2, 9, dtype=torch.long)
    with pytest.raises(ValueError, match="CUDA tensors"):
        graph_training_forward(model, x[:, :-1], x[:, 1:])
    if torch.cuda.is_available():
        x = x.cuda()
        with pytest.raises(ValueError, match="parameters must be on"):
            graph_training_forward(model, x[:, :-1], x[:, 1:])
        with pytest.raises(ValueError, match="differ in shape"):
            graph_training_forward(model.cuda(), x[:, :-1], x[:, 2:])
        with pytest.raises(ValueError, match="moe_impl 'turbomoe', ep_size 1 or a capacity factor, and no recompute"):
            graph_training_forward(build(cfg, recompute=True).cuda(), x[:, :-1], x[:, 1:])
        with pytest.raises(ValueError, match="model.train"):
            graph_training_forward(model.eval(), x[:, :-1], x[:, 1:])
        model.train()
        with pytest.raises(ValueError, match="not a trainable parameter"):
            graph_training_forward(model, x[:, :-1], x[:, 1:], grad_buffers={torch.zeros(3, device="cuda"): None})
        p = next(model.parameters())
        with pytest.raises(ValueError, match="float tensor of its parameter's numel"):
            graph_training_forward(model, x[:, :-1], x[:, 1:], grad_buffers={p: torch.zeros(p.numel() + 1, device="cuda")})
        graph_training_forward(model, x[:, :-1], x[:, 1:])
        with pytest.raises(ValueError, match="already captured"):
            graph_training_forward(model, x[:, :-1], x[:, 1:])


@pytest.mark.gpu
@needs_cuda
def test_capture_failure_is_named_and_leaves_the_model_eager():
    """A step that syncs with the host (an item() in a forward hook) runs in the warm-up but fails the
    capture: turbomoe's message, and the model is left as it was (not marked captured, its forward its
    class's, no grad buffers active, no .grad), training as an untouched copy does. Without the hook it
    then captures, and the replays train as the copy."""
    from turbomoe.integrations import expert_stack
    cfg = tiny(num_experts=8, num_hidden_layers=2, max_position_embeddings=64)
    model = build(cfg).cuda()
    eager = copy.deepcopy(model)
    x = batch(2, 16, cfg.vocab_size, seed=5)

    def sync(module, inputs, out):  # reads a device value on the host; returns None, the output unchanged
        out[0].sum().item()

    hook = model.model.layers[0].register_forward_hook(sync)
    # (?s): CUDA's part of the message spans lines
    failed = "(?s)capturing the model's forward and backward failed: .*syncs with the host"
    with pytest.raises(RuntimeError, match=failed):
        graph_training_forward(model, x[:, :-1], x[:, 1:])
    hook.remove()
    assert not getattr(model, "cuda_graphed", False) and "forward" not in vars(model)
    assert expert_stack._GRAD_BUFFERS is None
    assert all(p.grad is None for p in model.parameters())
    torch.cuda.synchronize()  # the failed capture left the device usable
    graph_training_forward(model, x[:, :-1], x[:, 1:])
    assert torch.equal(train(model, 2, 1, True), train(eager, 2, 1, True))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("grad_accum,ep", [(1, 1), (2, 1), pytest.param(
    2, 2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="expert parallelism over NCCL needs 2 GPUs"))])
def test_recipe_step_with_graphs_matches_eager(tmp_path, grad_accum, ep):
    """The recipe's engine (bf16, DeepSpeed's BF16_Optimizer, whose fp32 gradients the backward graph
    adds into, or at one micro-batch a step writes, left uncleared by the step; its norm taken over
    flat buffers) trains as the eager step does, and the graphed step syncs with the host nowhere:
    losses, gradient norms and parameters after 4 steps of 1 or 2 micro-batches agree within bf16
    noise (flash attention's backward sums with atomics: not bitwise). ep 2: two ranks under the
    deepspeed launcher, capacity factor 1.25, the all-to-all in the graphs."""
    script = os.path.join(os.path.dirname(__file__), "recipe_graph_script.py")
    if ep == 1:
        env = dict(os.environ, MASTER_PORT=str(29700 + os.getpid() % 200))
        proc = subprocess.run([sys.executable, script, str(tmp_path), str(grad_accum)], capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        proc = deepspeed_launch(script, tmp_path, grad_accum, ep, env=launcher_env(cpu=False), nproc=ep,
                                launcher_args=["--no_local_rank"], timeout=600)
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])  # the launcher logs after it
    assert r["optimizer"] == ["BF16_Optimizer", "BF16_Optimizer"], r
    assert r["eager_loss"][0] == r["graph_loss"][0], r  # the first step's forward: same weights, same kernels
    for key in ("loss", "norm"):
        for a, b in zip(r[f"eager_{key}"], r[f"graph_{key}"]):
            assert abs(a - b) <= 2e-2 * abs(a), r
    assert r["max_param_diff"] < 5e-2, r
    # pretrain.norms_over_flat_gradients: DeepSpeed's norm, from one tensor per group, expert groups kept apart.
    for flat, own, same_groups in r["flat_vs_own_norm"]:
        assert same_groups and abs(flat - own) <= 1e-5 * own, r
    # A graphed step (forward, backward, pretrain.step_without_host_sync) under sync debug mode "error".
    assert r["graph_step_sync_free"] is True, r


@pytest.mark.gpu
@needs_cuda
def test_recipe_resume_with_graphs(tmp_path):
    """Stop and resume with train.cuda_graph: the capture after load_checkpoint works (the load runs under
    no_grad: before, it left an autograd graph over the parameters and the backward capture failed) and
    the resumed steps train as the uninterrupted run (tiny-cpu at ep_size 1, bf16, one GPU)."""
    from tests.test_recipes import launch, records
    sets = [a for kv in ("moe.ep_size=1", "train.precision=bf16", "train.cuda_graph=true", "log.every=1")
            for a in ("--set", kv)]  # over test_recipes' shortened tiny-cpu: 8 steps, checkpoints every 4
    launch(tmp_path / "full", *sets, gpus=1)
    launch(tmp_path / "part", *sets, "--stop-at-step", "4", gpus=1)
    launch(tmp_path / "part", *sets, "--resume", gpus=1)
    full, part = records(tmp_path / "full", "train"), records(tmp_path / "part", "train")
    assert [r["step"] for r in part] == list(range(1, 9))
    for a, b in zip(full, part):  # equal in the run of record; 1e-3 leaves room for attention's atomics
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * a["loss"], (a, b)

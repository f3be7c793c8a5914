"""turbomoe's Megatron-core integration on the GPU, against stock megatron-core 0.16.1 (local spec:
TopKRouter, allgather dispatcher, SequentialMLP):
- a small GPT model built twice from the same seed (the expert weights then copied from stock's
  SequentialMLP into turbomoe's GroupedMLP layout): equal losses and gradients, fp32 (tight) and bf16;
- with a capacity and the "probs" and "position" drop policies: the same routes dropped;
- the expert bias updated by Megatron's rule the same way;
- distributed checkpoints saved by one model loaded into the other, both ways;
- no host sync in turbomoe's layer (torch.cuda.set_sync_debug_mode("error"));
- expert parallelism over 2 GPUs: tests/megatron_ep_script.py under torchrun;
- Megatron's training step (DistributedDataParallel, get_megatron_optimizer, finalize_model_grads)
  with tensor (+ sequence) and data parallelism over 2 GPUs, and on one: tests/megatron_train_script.py.
With Transformer Engine installed (2.11, the last release megatron-core 0.16.1 accepts; the GPU
machine gets it from scripts/gpu_te_wheels.sh and gpu_env.sh's gpu_te), the same model pair on TE's
spec (its linears, norms and attention on both sides; stock's experts TEGroupedMLP or SequentialMLP on
TE linears), its checkpoints both ways, and Megatron's training step on it (megatron_train_script.py
with MEGATRON_SPEC=te). Stock 0.16.1 without Transformer Engine stops in router_gating_linear
(NameError: te_general_gemm is bound only by TE's import); the stock side here binds it to None, the
value the code tests for.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="megatron-core's MoE layer needs CUDA")]

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

from conftest import rel_err  # noqa: E402
from launching import free_port  # noqa: E402
from megatron_common import (expert_pairs, gpt_batch, gpt_pair, gpt_tensors_as_stock, model_parallel,  # noqa: E402
                             moe_config)
from turbomoe.integrations import megatron as tm  # noqa: E402

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None  # see the module doc

VOCAB, SEQ, BATCH = 128, 64, 4
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
# TE runs fp32 GEMMs on TF32 tensor cores unless NVIDIA_TF32_OVERRIDE=0 (set before CUDA starts): on
# both sides, but the MoE layers' small differences then cross TF32 rounding (gradients measured up to
# 4.4e-4 apart on an H100 with it, within 2e-5 without), so fp32 on TE is compared at TF32's tolerance.
TE_TF32 = os.environ.get("NVIDIA_TF32_OVERRIDE") != "0"
needs_te = pytest.mark.skipif(not HAVE_TE, reason="Transformer Engine is not installed (on the GPU machine: "
                              "scripts/gpu_te_wheels.sh here, gpu_te of scripts/gpu_env.sh there)")


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    if torch.cuda.is_available():
        with model_parallel("nccl"):
            yield
    else:
        yield


def gpt_config(dtype, **overrides):
    # bf16: one MoE layer, the first, so both models route the same input. A later MoE layer sees hidden
    # states that differ by bf16 rounding (stock's and turbomoe's kernels round differently), and a few
    # near-tied tokens then pick other experts: the loss still agrees, but those experts' gradients move
    # by 10-20% (measured on an H100 with MoE layers 0 and 2: layer 2's expert grads only).
    freq = [1, 0, 1] if dtype == torch.float32 else [1, 0, 0]
    kw = dict(num_layers=3, moe_layer_freq=freq, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
              num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48, params_dtype=dtype,
              bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, moe_router_dtype="fp32")
    kw.update(overrides)
    return moe_config(**kw)


def loss_and_grads(model, data):
    model.zero_grad(set_to_none=True)
    tokens, pos, mask = data
    loss = model(tokens, pos, mask, labels=tokens).float().mean()
    loss.backward()
    return loss.detach(), gpt_tensors_as_stock(model, grads=True)


CASES = {  # name: config overrides (the probs_before_fc2 case: turbomoe spec keywords)
    "dropless": dict(),
    "probs-before-fc2": dict(),
    "dropless-k1": dict(moe_router_topk=1, moe_router_pre_softmax=True),
    "capacity-probs": dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"),
    "capacity-position": dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position"),
    "sigmoid-bias-seqaux": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                moe_router_topk=4, moe_router_load_balancing_type="seq_aux_loss"),
    "global-aux": dict(moe_router_load_balancing_type="global_aux_loss", moe_router_topk=3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpt_matches_stock(case, dtype):
    check_gpt_matches_stock(gpt_config(dtype, **CASES[case]), probs_before_fc2=case == "probs-before-fc2")


@needs_te
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("experts", ["TEGroupedMLP", "SequentialMLP"])
@pytest.mark.parametrize("case", ["dropless", "capacity-probs", "sigmoid-bias-seqaux"])
def test_gpt_matches_stock_on_transformer_engine(case, experts, dtype):
    """Both models on Transformer Engine's layer spec; stock's experts its grouped GEMM or a loop."""
    cfg = gpt_config(dtype, moe_grouped_gemm=experts == "TEGroupedMLP", **CASES[case])
    check_gpt_matches_stock(cfg, te=True)


def check_gpt_matches_stock(cfg, te: bool = False, **turbomoe_kwargs):
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = cfg.params_dtype
    stock, turbo = gpt_pair(cfg, VOCAB, SEQ, te=te, **turbomoe_kwargs)
    if te:  # TE's modules on both sides, and stock's experts of the kind asked for
        for model in (stock, turbo):
            assert any(type(m).__module__ == "megatron.core.extensions.transformer_engine" for m in model.modules())
        kinds = {type(layer.mlp.experts).__name__ for layer in stock.decoder.layers if hasattr(layer.mlp, "router")}
        assert kinds == {"TEGroupedMLP" if cfg.moe_grouped_gemm else "SequentialMLP"}, kinds
    data = gpt_batch(VOCAB, SEQ, BATCH)
    (l1, g1), (l2, g2) = loss_and_grads(stock, data), loss_and_grads(turbo, data)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4 if te and TE_TF32 else 2e-5
    assert abs(l1.item() - l2.item()) <= tol * abs(l1.item()), (l1.item(), l2.item())
    assert g1.keys() == g2.keys()
    bad = {n: rel_err(g2[n], g1[n], floor=1e-6) for n in g1 if rel_err(g2[n], g1[n], floor=1e-6) > 5 * tol}
    assert not bad, bad
    # The same routes kept (and dropped), router by router, on the same hidden states.
    x = torch.randn(SEQ, BATCH, cfg.hidden_size, device="cuda", dtype=dtype)
    for ls, lt in zip(stock.decoder.layers, turbo.decoder.layers):
        if isinstance(lt.mlp, tm.TurboMoELayer):
            (p1, m1), (p2, m2) = ls.mlp.router(x), lt.mlp.router(x)
            assert torch.equal(m1, m2)
            torch.testing.assert_close(p2.float(), p1.float(), rtol=tol, atol=tol)
            if cfg.moe_expert_capacity_factor is not None:
                assert (m1.sum(0) < torch.topk(lt.mlp.router.gating(x).view(-1, 8), cfg.moe_router_topk)
                        .indices.flatten().bincount(minlength=8)).any(), "nothing was dropped"
    if cfg.moe_router_enable_expert_bias:
        for model in (stock, turbo):
            _update_router_expert_bias([model], cfg)
        for ls, lt in zip(stock.decoder.layers, turbo.decoder.layers):
            if isinstance(lt.mlp, tm.TurboMoELayer):
                assert torch.equal(ls.mlp.router.expert_bias, lt.mlp.router.expert_bias)
                assert ls.mlp.router.expert_bias.abs().sum() > 0


def assert_same_experts(stock, turbo):
    for ls, lt in zip(stock.decoder.layers, turbo.decoder.layers):
        if isinstance(lt.mlp, tm.TurboMoELayer):
            for (s1, s2), (t1, t2) in zip(expert_pairs(ls.mlp), expert_pairs(lt.mlp), strict=True):
                assert torch.equal(s1, t1) and torch.equal(s2, t2)


@pytest.mark.parametrize("spec", ["local", pytest.param("te", marks=needs_te)])
def test_checkpoints_load_both_ways(spec):
    """A distributed checkpoint of stock's model loads into turbomoe's (perturbed first) and gives
    stock's weights and loss; and back, turbomoe's into a perturbed stock model. On Transformer Engine's
    spec stock's experts are TEGroupedMLP."""
    cfg = gpt_config(torch.bfloat16, moe_grouped_gemm=spec == "te")
    stock, turbo = gpt_pair(cfg, VOCAB, SEQ, te=spec == "te")
    data = gpt_batch(VOCAB, SEQ, BATCH)
    for src, dst in ((stock, turbo), (turbo, stock)):
        with torch.no_grad():
            for p in dst.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        ref, _ = loss_and_grads(src, data)
        with tempfile.TemporaryDirectory() as d:
            dist_checkpointing.save(src.sharded_state_dict(), d)
            dst.load_state_dict(dist_checkpointing.load(dst.sharded_state_dict(), d))
        assert_same_experts(stock, turbo)
        dst_sd = dst.state_dict()
        for name, t in src.state_dict().items():  # every tensor the two share by name (all but the experts)
            if isinstance(t, torch.Tensor) and name in dst_sd:
                assert torch.equal(t, dst_sd[name]), name
        got, _ = loss_and_grads(dst, data)
        assert abs(got.item() - ref.item()) <= 2e-2 * abs(ref.item()), (ref.item(), got.item())


@pytest.mark.parametrize("cf", [None, 1.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("lb", ["aux_loss", "seq_aux_loss"])
def test_layer_has_no_host_sync(cf, lb):
    cfg = gpt_config(torch.bfloat16, moe_expert_capacity_factor=cf, moe_router_load_balancing_type=lb)
    from megatron.core.transformer.spec_utils import build_module
    layer = build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg).cuda()
    layer.train()
    x = torch.randn(SEQ, BATCH, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    for debug in ("default", "error"):  # the first step warms up (kernel builds, the aux-loss scale)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(debug)
        try:
            out, _ = layer(x)
            out.backward(g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_accumulation_fusion_under_ddp(dtype):
    """Megatron's DistributedDataParallel around turbomoe's MoE layer (fp32 gradient buffers, reduction
    overlapped with the backward, so every weight's hook must fire), two micro-batches: with
    config.gradient_accumulation_fusion the expert weights' main_grad, added inside the GEMM, equals
    the unfused layer's, whose gradients DDP's hook adds (bf16: rounded to bf16 first, hence the
    tolerance); the placeholder gradient is dropped by the hook, unread."""
    import contextlib

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.spec_utils import build_module
    torch.backends.cuda.matmul.allow_tf32 = False
    main_grads = []
    for fusion in (False, True):
        cfg = gpt_config(dtype, gradient_accumulation_fusion=fusion)
        torch.manual_seed(0)
        layer = build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg).cuda()
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                         overlap_grad_reduce=True), layer)
        ddp.zero_grad_buffer()
        gen = torch.Generator(device="cuda").manual_seed(1)
        for micro in range(2):
            x = torch.randn(SEQ, BATCH, cfg.hidden_size, device="cuda", dtype=dtype, generator=gen)
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                out, _ = ddp(x)
                out.float().square().mean().backward()
        ddp.finish_grad_sync()
        experts = layer.experts
        assert experts.weight1.grad is None and experts.weight1.grad_added_to_main_grad == fusion
        main_grads.append({n: getattr(experts, n).main_grad.clone() for n in ("weight1", "weight2")})
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, want in main_grads[0].items():
        assert want.abs().sum() > 0
        assert rel_err(main_grads[1][name], want) < tol, name


def torchrun(script: str, nproc: int, timeout: int = 400, **env_vars) -> str:
    """Runs tests/<script> under torchrun on nproc local GPUs (this tree and tests/ on the path, env_vars
    added to the environment); its stdout."""
    path = os.path.join(os.path.dirname(__file__), script)
    env = dict(os.environ, **env_vars, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(path)),
                                                       os.path.dirname(path), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        "--master_port", str(free_port()), path],
                       env=env, capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-6000:], r.stderr[-4000:])
    assert r.returncode == 0, f"{script} on {nproc} GPU(s) exited with {r.returncode}"
    return r.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="expert parallelism needs 2 GPUs")
def test_expert_parallel_two_gpus():
    assert torchrun("megatron_ep_script.py", 2).count("EP PASS") == 2


@pytest.mark.parametrize("spec", ["local", pytest.param("te", marks=needs_te)])
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="tensor and data parallelism over 2 GPUs need 2 GPUs"))],
    ids=["nproc1", "nproc2"])
def test_training_step_two_gpus(nproc, spec):
    """Megatron's DDP, optimizer and finalize_model_grads over stock's and turbomoe's GPT, on the local
    or Transformer Engine's spec: equal losses and parameters (tests/megatron_train_script.py says which
    cases run on 1 and on 2 GPUs)."""
    # fp32 cases compare final weights after 5 Adam steps: without TF32 (on TE: the override, see TE_TF32)
    out = torchrun("megatron_train_script.py", nproc, timeout=500, MEGATRON_SPEC=spec, NVIDIA_TF32_OVERRIDE="0")
    assert out.count("TRAIN PASS") == nproc

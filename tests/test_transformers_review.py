"""The "turbomoe" experts over more of transformers' MoE families than test_transformers_integration.py
(Qwen2-MoE, OLMoE, DeepSeek-V3, Lfm2-MoE, NemotronH without a gate, Gemma4's GELU, DeepSeek-V4's clamped
gate) and edge routes (ids == E as transformers' expert parallelism and LongCat's zero experts send,
one token, a repeated expert), against transformers' "eager" loop in float64, forward and backward;
bf16 on the CPU; whole models with shared experts (padding, gradient checkpointing, train and eval,
save_pretrained unchanged); and the defects this review fixed: a bf16 input into fp32 experts (autocast),
F.silu experts off the fused SwiGLU, and the error for 1-D expert ids."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_transformers_integration import routes, run  # noqa: E402

import turbomoe.integrations.transformers as tt  # noqa: E402

M = transformers.models


def qwen2_experts():
    cfg = transformers.Qwen2MoeConfig(hidden_size=14, moe_intermediate_size=9, num_experts=6, num_experts_per_tok=3)
    return M.qwen2_moe.modeling_qwen2_moe.Qwen2MoeExperts(cfg), cfg


def olmoe_experts():
    cfg = transformers.OlmoeConfig(hidden_size=16, intermediate_size=11, num_experts=7, num_experts_per_tok=2)
    return M.olmoe.modeling_olmoe.OlmoeExperts(cfg), cfg


def deepseek_v3_experts():
    cfg = transformers.DeepseekV3Config(hidden_size=12, moe_intermediate_size=10, n_routed_experts=8,
                                        num_experts_per_tok=4)
    return M.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts(cfg), cfg


def lfm2_experts():
    """act_fn is the function F.silu, not a module."""
    cfg = transformers.Lfm2MoeConfig(hidden_size=12, moe_intermediate_size=10, num_experts=5, num_experts_per_tok=2)
    return M.lfm2_moe.modeling_lfm2_moe.Lfm2MoeExperts(cfg), cfg


def nemotron_h_experts():
    """has_gate=False: up_proj [E, F, L] and relu2, on the latent size L (hidden_size 16 -> 6)."""
    cfg = transformers.NemotronHConfig(hidden_size=16, moe_latent_size=6, moe_intermediate_size=9, n_routed_experts=5,
                                       num_experts_per_tok=2)
    experts = M.nemotron_h.modeling_nemotron_h.NemotronHExperts(cfg)
    cfg.hidden_size = 6  # the experts' input width
    return experts, cfg


def gemma4_experts():
    """gelu (tanh) [gate | up] experts: the module's own gate, weights in the gather."""
    cfg = transformers.Gemma4TextConfig(hidden_size=10, moe_intermediate_size=7, num_experts=6, top_k_experts=2,
                                        enable_moe_block=True)
    cfg.num_experts_per_tok = 2
    return M.gemma4.modeling_gemma4.Gemma4TextExperts(cfg), cfg


def deepseek_v4_experts():
    """Its own _apply_gate: gate and up clamped to swiglu_limit before silu(gate) * up."""
    cfg = transformers.DeepseekV4Config(hidden_size=12, moe_intermediate_size=8, n_routed_experts=6,
                                        num_experts_per_tok=2, swiglu_limit=0.7)
    return M.deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts(cfg), cfg


FAMILIES = [qwen2_experts, olmoe_experts, deepseek_v3_experts, lfm2_experts, nemotron_h_experts, gemma4_experts,
            deepseek_v4_experts]


def fp64_case(family, S, seed):
    g = torch.Generator().manual_seed(seed)
    experts, cfg = family()
    experts = experts.double()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    x = torch.randn(S, cfg.hidden_size, generator=g, dtype=torch.float64)
    ids, w = routes(S, experts.num_experts, cfg.num_experts_per_tok, g)
    return experts, x, ids, w


def assert_all_close(got, expected, **tol):
    for a, b in zip([*got[:3], *got[3]], [*expected[:3], *expected[3]]):
        torch.testing.assert_close(a, b, **tol)


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["random", "one token", "ids == E", "repeated expert"])
def test_more_families_against_eager(family, case):
    tt.register()
    experts, x, ids, w = fp64_case(family, 1 if case == "one token" else 23, seed=FAMILIES.index(family))
    if case == "ids == E":  # routed to no expert, weight 0 (transformers' EP sentinel, LongCat's zero experts)
        ids[::3, -1] = experts.num_experts
        w[::3, -1] = 0
        ids[5] = experts.num_experts  # a token routed nowhere at all
        w[5] = 0
    if case == "repeated expert":
        ids[::2, 1] = ids[::2, 0]
    assert_all_close(run(experts, "turbomoe", x, ids, w), run(experts, "eager", x, ids, w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", [qwen2_experts, nemotron_h_experts, gemma4_experts])
def test_bf16_on_the_cpu_near_fp64(family):
    """bf16 experts, input and routing weights: as near the fp64 result as transformers' eager bf16 loop is."""
    tt.register()
    experts, x, ids, w = fp64_case(family, 31, seed=3)
    exact = run(experts, "eager", x, ids, w)
    experts = experts.bfloat16()
    got = run(experts, "turbomoe", x.bfloat16(), ids, w.bfloat16())
    theirs = run(experts, "eager", x.bfloat16(), ids, w.bfloat16())
    assert got[0].dtype == torch.bfloat16
    for a, t, b in zip([*got[:3], *got[3]], [*theirs[:3], *theirs[3]], [*exact[:3], *exact[3]]):
        assert a.dtype == t.dtype
        assert rel_err(a, b) < max(2 * rel_err(t, b), 1e-2)


@pytest.mark.parametrize("family", [nemotron_h_experts, qwen2_experts])
def test_bf16_input_into_fp32_experts_under_autocast(family):
    """bf16 mixed precision over fp32 weights (Trainer's bf16=True) where the experts' input is a linear's
    output, bf16 under autocast (NemotronH's latent MoE: fc1_latent_proj). transformers' eager, batched_mm
    and grouped_mm run it (F.linear autocasts; grouped_mm casts the input to the weights' dtype); turbomoe's
    grouped GEMM raised "x and w must share one float dtype". Now it computes in the weights' dtype."""
    tt.register()
    experts, x, ids, w = fp64_case(family, 27, seed=7)
    x = x.bfloat16().double()  # bf16 values, exact in fp64: the reference sees the same input
    exact = run(experts, "eager", x, ids, w)
    experts = experts.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(experts, "turbomoe", x.bfloat16(), ids, w.float())
    assert got[0].dtype == got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in got[3])
    for a, b in zip([*got[:3], *got[3]], [*exact[:3], *exact[3]]):
        assert rel_err(a, b) < 1e-2  # bf16 output and grad_out roundings, fp32 math


def test_function_silu_experts_take_the_fused_swiglu(monkeypatch):
    """Bias-free [gate | up] silu experts get the routing weights inside turbomoe's SwiGLU (the gather then
    keeps no expert output for backward). Lfm2-MoE's act_fn is F.silu itself, not an nn.Module: it took
    the unfused gate and the weighted gather."""
    tt.register()
    calls = []
    fused = tt.swiglu

    def counted(h, scale_R=None):
        calls.append(scale_R is not None)
        return fused(h, scale_R)

    monkeypatch.setattr(tt, "swiglu", counted)
    experts, x, ids, w = fp64_case(lfm2_experts, 19, seed=2)
    assert experts.act_fn is torch.nn.functional.silu
    got = run(experts, "turbomoe", x, ids, w)
    assert calls == [True]
    assert_all_close(got, run(experts, "eager", x, ids, w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("ids_shape", [(9,), (3, 3, 2)])
def test_expert_ids_not_2d_are_named(ids_shape):
    """1-D ids of 9 tokens were reported as "routes 9 experts a token; ... at most 8" (their last dim is
    no k; 3-D ids had assign_slots' own, clear error). Both now name top_k_index and its [S, k]."""
    tt.register()
    experts, x, _, _ = fp64_case(olmoe_experts, 9, seed=4)
    experts.config._experts_implementation = "turbomoe"
    ids = torch.randint(0, experts.num_experts, ids_shape, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match=r"top_k_index must be a 2-D \[S, k\] tensor of expert ids, got " +
                       str(ids_shape).replace("(", r"\(").replace(")", r"\)")):
        experts(x, ids, torch.rand(ids_shape, dtype=torch.float64))


def tiny_model(name, seed):
    common = dict(vocab_size=61, hidden_size=16, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=64)
    extra = {
        "qwen2_moe": dict(num_key_value_heads=1, head_dim=8, moe_intermediate_size=10,
                          shared_expert_intermediate_size=12, num_experts=6, num_experts_per_tok=2,
                          norm_topk_prob=False),
        "deepseek_v3": dict(num_key_value_heads=2, head_dim=4, moe_intermediate_size=10, n_routed_experts=8,
                            n_shared_experts=1, num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=1,
                            kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                            norm_topk_prob=True, routed_scaling_factor=2.5),
    }[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(name, **common, **extra))
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3"])
def test_models_with_shared_experts(name):
    """Whole models, shared experts beside the routed ones (Qwen2-MoE's gated shared expert without
    norm_topk_prob; DeepSeek-V3's group-limited routing, renormalised and scaled): left-padded batch,
    loss and every gradient in train mode with gradient checkpointing, logits in eval, equal to eager."""
    tt.register()
    model = tiny_model(name, seed=1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 61, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = mask[2, :1] = 0
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing

    def train_step(impl):
        model.set_experts_implementation(impl)
        model.train()
        model.zero_grad()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        model.eval()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
        return loss.detach(), logits, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref_loss, ref_logits, ref_grads = train_step("eager")
    loss, logits, grads = train_step("turbomoe")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-12)
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_save_pretrained_is_unchanged_and_reloads(tmp_path):
    """Switching a model to turbomoe changes nothing save_pretrained writes (config.json, tensors), and a
    reload with experts_implementation="turbomoe" gives eager's logits."""
    tt.register()
    from safetensors.torch import load_file
    model = tiny_model("qwen2_moe", seed=5)
    model.save_pretrained(tmp_path / "before")
    model.set_experts_implementation("turbomoe")
    model.set_experts_implementation("turbomoe")  # twice: no-op
    model.save_pretrained(tmp_path / "after")
    assert (tmp_path / "before/config.json").read_text() == (tmp_path / "after/config.json").read_text()
    before, after = load_file(tmp_path / "before/model.safetensors"), load_file(tmp_path / "after/model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(6))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "after", experts_implementation="turbomoe",
                                                             dtype=torch.float64).eval()
    assert back.config._experts_implementation == "turbomoe"
    model.set_experts_implementation("eager")
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model.eval()(ids).logits, rtol=1e-10, atol=1e-12)

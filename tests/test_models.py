"""The Qwen3-MoE-layout model: shapes, causality, attention and rotary maths, initialisation across
expert-parallel ranks, parameter counts, the turbomoe vs DeepSpeed MoE choice, and the Hugging Face
name map."""
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed")
from turbomoe.models import (ModelConfig, MoEArgs, Qwen3MoeForCausalLM, from_hf_name,  # noqa: E402
                             from_hf_state_dict, moe_class, to_hf_name, to_hf_state_dict)
from turbomoe.models.qwen3_moe import Attention, apply_rotary, rotary_cos_sin  # noqa: E402


def tiny(**kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                max_position_embeddings=64)
    base.update(kw)
    return ModelConfig.from_dict(base)


def build(cfg, seed=0, **moe):
    model = Qwen3MoeForCausalLM(cfg, MoEArgs(**moe))
    model.init_weights(seed)
    return model


def hf_twin(model, cfg):
    """Hugging Face's own Qwen3MoeForCausalLM holding the same weights (its experts fused as
    gate_up_proj [E, 2I, H] and down_proj [E, H, I]), and the map of its parameter names to ours."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{k: v for k, v in cfg.to_dict().items() if k != "moe_impl"}))
    ours = to_hf_state_dict(dict(model.named_parameters()))
    if set(hf.state_dict()) == set(ours):  # transformers 4: one module per expert, our names
        hf.load_state_dict({n: p.detach() for n, p in ours.items()}, strict=True)
        return hf.to(next(model.parameters()).dtype)
    sd, experts = {}, {}
    for name, p in ours.items():
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.J.{gate,up,down}_proj.weight
            prefix, rest = name.split(".experts.")
            j, proj = rest.split(".")[:2]
            experts.setdefault(prefix, {}).setdefault(proj, {})[int(j)] = p.detach()
        else:
            sd[name] = p.detach()
    for prefix, projs in experts.items():
        E = len(projs["gate_proj"])
        sd[prefix + ".experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(E)])
        sd[prefix + ".experts.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(E)])
    hf.load_state_dict(sd, strict=True)
    return hf.to(next(model.parameters()).dtype)


def test_forward_matches_hugging_face():
    """Logits, loss, every gradient and the expert counts against Hugging Face's Qwen3-MoE on the
    same weights (dropless, renormalised top-k: Qwen3-MoE's routing). Before, the forward tests
    checked shapes and finiteness only."""
    cfg = tiny()
    model = build(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    out = model(ids, ids)
    assert out.logits.shape == (3, 10, cfg.vocab_size) and out.expert_counts.shape == (2, cfg.num_experts)
    hf = hf_twin(model, cfg)
    ref = hf(input_ids=ids, output_router_logits=True)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    # Our labels are the targets as given (the recipe shifts them); HF's loss shifts, so form it here.
    ref_loss = F.cross_entropy(ref.logits.flatten(0, 1), ids.flatten())
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-6)
    # Every route is computed (dropless): counts are the top-k of each layer's router logits.
    for layer, router_logits in enumerate(ref.router_logits):
        topk = router_logits.topk(cfg.num_experts_per_tok, dim=-1).indices
        assert torch.equal(out.expert_counts[layer].cpu(), torch.bincount(topk.flatten(), minlength=cfg.num_experts))
    out.loss.backward()
    ref_loss.backward()
    grads = to_hf_state_dict({n: p.grad for n, p in model.named_parameters()})
    for name, p in hf.named_parameters():
        if name.endswith("experts.gate_up_proj"):  # transformers 5: experts fused
            prefix = name[:-len("gate_up_proj")]
            ours = torch.stack([torch.cat([grads[f"{prefix}{e}.gate_proj.weight"], grads[f"{prefix}{e}.up_proj.weight"]])
                                for e in range(cfg.num_experts)])
        elif name.endswith("experts.down_proj"):
            prefix = name[:-len("down_proj")]
            ours = torch.stack([grads[f"{prefix}{e}.down_proj.weight"] for e in range(cfg.num_experts)])
        else:
            ours = grads[name]
        torch.testing.assert_close(ours, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # Small initial weights: the first loss is close to uniform over the vocabulary.
    assert abs(out.loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_causal():
    cfg = tiny()
    model = build(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % cfg.vocab_size
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_attention_matches_explicit_gqa():
    cfg = tiny()
    attn = Attention(cfg)
    x = torch.randn(2, 7, cfg.hidden_size)
    cos, sin = rotary_cos_sin(7, cfg.head_dim, cfg.rope_theta, x.device)
    q = attn.q_norm(attn.q_proj(x).view(2, 7, 4, 8)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(2, 7, 2, 8)).transpose(1, 2)
    v = attn.v_proj(x).view(2, 7, 2, 8).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    heads = []
    for h in range(4):  # query head h reads key/value head h // 2
        s = q[:, h] @ k[:, h // 2].transpose(-1, -2) / math.sqrt(8)
        s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(s, -1) @ v[:, h // 2])
    expected = attn.o_proj(torch.stack(heads, 2).reshape(2, 7, 32))
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-5, atol=1e-6)


def test_rotary_depends_on_relative_position():
    cos, sin = rotary_cos_sin(16, 8, 10000.0, "cpu")
    q, k = torch.randn(8), torch.randn(8)

    def score(i, j):
        rq = apply_rotary(q.expand(1, 1, 16, 8), cos, sin)[0, 0, i]
        rk = apply_rotary(k.expand(1, 1, 16, 8), cos, sin)[0, 0, j]
        return (rq * rk).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10))
    torch.testing.assert_close(apply_rotary(q.expand(1, 1, 16, 8), cos, sin).norm(dim=-1),
                               q.norm().expand(1, 1, 16))


def test_init_is_seeded_and_the_same_for_every_ep_size():
    cfg = tiny()
    full, again = build(cfg, seed=3), build(cfg, seed=3)
    for (n, a), (_, b) in zip(full.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    experts = full.model.layers[0].mlp.deepspeed_moe.experts.deepspeed_experts
    assert not torch.equal(experts[0].w1.weight, experts[1].w1.weight)  # experts differ from one another
    shard = Qwen3MoeForCausalLM(cfg, MoEArgs(ep_size=2))
    shard.init_weights(3, ep_rank=1)
    local = shard.model.layers[0].mlp.deepspeed_moe.experts.deepspeed_experts
    assert len(local) == 2
    assert torch.equal(local[0].w1.weight, experts[2].w1.weight)  # ep rank 1 holds global experts 2 and 3
    assert torch.equal(local[1].w2.weight, experts[3].w2.weight)
    assert torch.equal(shard.lm_head.weight, full.lm_head.weight)


@pytest.mark.parametrize("kw", [dict(), dict(decoder_sparse_step=2), dict(mlp_only_layers=[0]),
                                dict(tie_word_embeddings=True)])
def test_parameter_count(kw):
    cfg = tiny(**kw)
    model = build(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    moe_layers = [i for i, layer in enumerate(model.model.layers) if layer.is_moe]
    assert moe_layers == cfg.moe_layers()
    inactive = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert cfg.num_parameters() - cfg.num_parameters(active=True) == len(moe_layers) * inactive


def test_config_errors():
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict({"hidden_sizes": 3})
    with pytest.raises(ValueError, match="multiple of"):
        tiny(num_key_value_heads=3)
    with pytest.raises(ValueError, match="no MoE layer"):
        tiny(mlp_only_layers=[0, 1])
    with pytest.raises(ValueError, match="moe_impl"):
        tiny(moe_impl="tutel")
    with pytest.raises(ValueError, match="does not divide"):
        Qwen3MoeForCausalLM(tiny(), MoEArgs(ep_size=3))


def test_moe_impl_choice_and_norm_topk_prob():
    import deepspeed.moe.layer
    assert moe_class("deepspeed") == (deepspeed.moe.layer.MoE, "deepspeed")
    cls, name = moe_class("turbomoe")
    assert name == "turbomoe" and issubclass(cls, deepspeed.moe.layer.MoE)
    with pytest.raises(ValueError, match="moe_impl"):
        moe_class("auto")
    # turbomoe's layer takes norm_topk_prob; stock's always renormalises for k >= 2 and never for
    # k = 1, so a model on it must say the same.
    for k in (1, 2):
        for norm in (True, False):
            model = Qwen3MoeForCausalLM(tiny(num_experts_per_tok=k, norm_topk_prob=norm))
            assert all(m.deepspeed_moe.norm_topk_prob == norm for m in model.modules() if isinstance(m, cls))
    with pytest.raises(ValueError, match="norm_topk_prob"):
        Qwen3MoeForCausalLM(tiny(moe_impl="deepspeed", norm_topk_prob=False))
    with pytest.raises(ValueError, match="norm_topk_prob"):
        Qwen3MoeForCausalLM(tiny(moe_impl="deepspeed", num_experts_per_tok=1, norm_topk_prob=True))
    Qwen3MoeForCausalLM(tiny(moe_impl="deepspeed", num_experts_per_tok=1, norm_topk_prob=False))


def test_moe_recompute_same_loss_and_gradients():
    """MoEArgs.recompute (the recipe's moe.recompute): the turbomoe layers remake rows and activations
    in backward; the model's loss and every gradient are the same bits. Stock's layer has no switch."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(tiny(), MoEArgs(recompute=recompute))
        assert all(m.deepspeed_moe.recompute == recompute for m in model.modules() if hasattr(m, "deepspeed_moe"))
        out = model(ids, labels_BT=ids)
        (out.loss + out.aux_loss).backward()
        grads.append([out.loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="moe.recompute"):
        Qwen3MoeForCausalLM(tiny(moe_impl="deepspeed"), MoEArgs(recompute=True))


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_turbomoe_and_deepspeed_layers_agree(capacity):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    outs = []
    for impl in ("turbomoe", "deepspeed"):
        model = build(tiny(moe_impl=impl), capacity_factor=capacity)
        out = model(ids, ids)
        out.loss.backward()
        outs.append((out, model.model.layers[1].self_attn.q_proj.weight.grad))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.aux_loss, b.aux_loss)
    assert torch.equal(a.expert_counts, b.expert_counts)
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)


QWEN3_MOE_NAMES_2_LAYERS = (
    ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    + [f"model.layers.{i}.{n}" for i in range(2) for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight")]
    + [f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]  # mlp_only layer
    + ["model.layers.1.mlp.gate.weight"]
    + [f"model.layers.1.mlp.experts.{j}.{p}.weight" for j in range(4) for p in ("gate_proj", "up_proj", "down_proj")])


def test_hf_names_round_trip():
    model = build(tiny(decoder_sparse_step=2))
    sd = model.state_dict()
    hf = to_hf_state_dict(sd)
    assert sorted(hf) == sorted(QWEN3_MOE_NAMES_2_LAYERS)
    assert hf["model.layers.1.mlp.experts.3.up_proj.weight"] is \
        sd["model.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.w3.weight"]
    assert from_hf_state_dict(hf).keys() == sd.keys()
    assert all(from_hf_name(to_hf_name(n)) == n for n in sd)
    # Shapes are Hugging Face's: experts [moe_intermediate, hidden], router [E, hidden].
    assert hf["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (16, 32)
    assert hf["model.layers.1.mlp.gate.weight"].shape == (4, 32)
    Qwen3MoeForCausalLM(tiny(decoder_sparse_step=2)).load_state_dict(from_hf_state_dict(hf))


def test_bf16_forward():
    """bf16 weights and activations against the same model in fp32: logits within bf16 rounding
    (before: only dtype and finiteness were checked)."""
    model = build(tiny())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    want = model(ids, ids)
    out = model.to(torch.bfloat16)(ids, ids)
    assert out.logits.dtype == torch.bfloat16
    err = (out.logits.float() - want.logits).norm() / want.logits.norm()
    assert err < 2e-2, err.item()
    assert out.loss.item() == pytest.approx(want.loss.item(), rel=1e-2)
    assert F.cross_entropy(out.logits.float().flatten(0, 1), ids.flatten()).item() == pytest.approx(out.loss.item())

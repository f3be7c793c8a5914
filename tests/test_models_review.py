"""Review of the Qwen3-MoE-layout model: the MoE settings (MoEArgs) refused with the field named, and
logits, loss and every gradient against transformers' Qwen3MoeForCausalLM in float64 for the configs
test_models' parity test leaves out (odd sizes, k = 1 and 3, attention biases, dense layers between MoE
ones, tied embeddings, every position up to max_position_embeddings, one token)."""
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed")
from test_models import hf_twin, tiny  # noqa: E402
from turbomoe.models import MoEArgs, Qwen3MoeForCausalLM  # noqa: E402


@pytest.mark.parametrize("args, field", [
    (MoEArgs(ep_size=0), "ep_size"),  # was ZeroDivisionError
    (MoEArgs(ep_size=-1), "ep_size"),  # was built; its forward failed on a negative shape inside the layer
    (MoEArgs(ep_size=2.0), "ep_size"),  # was TypeError: 'float' object cannot be interpreted as an integer
    (MoEArgs(ep_size=True), "ep_size"),
    (MoEArgs(capacity_factor=0.0), "capacity_factor"),  # these two ran, every expert capped at min_capacity
    (MoEArgs(capacity_factor=-1.0), "capacity_factor"),
    (MoEArgs(capacity_factor=1.0, eval_capacity_factor=float("inf")), "eval_capacity_factor"),
])
def test_bad_moe_args_name_the_field(args, field):
    with pytest.raises(ValueError, match=rf"moe\.{field} must be a positive"):
        Qwen3MoeForCausalLM(tiny(), args)
    # from_pretrained checks them before it places this rank or reads a file (ep_size 0 asked for a
    # process group before)
    with pytest.raises(ValueError, match=rf"moe\.{field} must be a positive"):
        Qwen3MoeForCausalLM.from_pretrained("/nonexistent", moe_args=args)


def as_hf(cfg, tensors):
    """transformers' model holding `tensors` (our parameter names -> tensor: weights or gradients) in its
    layout (fused experts in transformers 5), through test_models.hf_twin."""
    proxy = types.SimpleNamespace(named_parameters=lambda: tensors.items(), parameters=lambda: iter(tensors.values()))
    hf = hf_twin(proxy, cfg)
    hf.set_experts_implementation("eager")  # the grouped_mm default takes no float64
    return hf


@pytest.mark.parametrize("kw, B, T", [
    (dict(vocab_size=37, hidden_size=24, intermediate_size=20, moe_intermediate_size=10, num_hidden_layers=3,
          num_attention_heads=3, num_key_value_heads=1, head_dim=6, num_experts=5, num_experts_per_tok=3,
          norm_topk_prob=False, attention_bias=True, mlp_only_layers=[1], rope_theta=500.0), 2, 7),
    (dict(tie_word_embeddings=True, decoder_sparse_step=2, num_hidden_layers=4, num_experts_per_tok=1,
          norm_topk_prob=False, num_key_value_heads=4, max_position_embeddings=16), 2, 16),  # every position
    (dict(), 2, 1),  # one token: attention is v alone, q and k get no gradient
])
def test_matches_transformers_in_float64(kw, B, T):
    cfg = tiny(**kw)
    g = torch.Generator().manual_seed(len(kw) + T)
    model = Qwen3MoeForCausalLM(cfg).double()
    with torch.no_grad():  # weights far from their small initialisation: the router's choices matter
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied lm_head.weight too
    hf = as_hf(cfg, params)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    out = model(ids, ids)
    ref = hf(input_ids=ids)
    ref_loss = F.cross_entropy(ref.logits.float().flatten(0, 1), ids.flatten())  # in fp32, as transformers' own
    # Not float64's rounding: both run RMSNorm and the loss in fp32, and ours the rotary and the router GEMM too.
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-6, atol=0)
    out.loss.backward()
    ref_loss.backward()
    ours = dict(as_hf(cfg, {n: p.grad for n, p in params.items()}).named_parameters())
    for name, p in hf.named_parameters():
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-5, atol=1e-6 * scale + 1e-12,
                                   msg=lambda m: f"{name}: {m}")

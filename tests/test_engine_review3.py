"""turbomoe.inference, third review: SparseMoE refuses, as it is made, weights of mixed dtypes or devices
(an fp32 router beside bf16 experts failed at the first call inside F.linear; a shared expert of another
dtype turned the whole expert stack into its dtype), and Engine.generate says what a generator must be."""
import pytest
import torch

from turbomoe.inference import SparseMoE


def weights(E=4, M=16, F_=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    return r(E, M), r(E, M, 2 * F_), r(E, F_, M), r(M, 2 * F_), r(F_, M)


def test_sparse_moe_weights_share_one_dtype_and_device():
    router, w1, w2, sw1, sw2 = weights()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    for bad, name in ((dict(router_EM=router.float()), "router"), (dict(w2_EFM=w2.float()), "w2"),
                      (dict(shared_w1_MN=sw1.float(), shared_w2_FM=sw2.float()), "shared_w1"),
                      (dict(shared_w1_MN=sw1, shared_w2_FM=sw2.half()), "shared_w2"),
                      (dict(router_EM=router.to("meta")), "router")):
        args = {**dict(router_EM=router, w1_EMN=w1, w2_EFM=w2, k=2), **bad}
        with pytest.raises(ValueError, match=f"{name} is torch.* on .*, w1 torch.bfloat16 on cpu"):
            SparseMoE(**args)(x)
    with pytest.raises(ValueError, match="w1 must be floating point, got torch.int64"):
        SparseMoE(router.long(), w1.long(), w2.long(), 2)
    # one dtype: the block runs in it, shared expert included
    out = SparseMoE(router, w1, w2, 2, shared_w1_MN=sw1, shared_w2_FM=sw2)(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape


def test_generate_generator_must_be_a_generator(tmp_path):
    """A seed passed as generator (generator=0) when sampling is a ValueError naming the argument, not an
    AttributeError from inside the checks; nothing is allocated (greedy decoding ignores the generator)."""
    pytest.importorskip("transformers")
    from test_engine import hf_model
    from turbomoe.inference import load
    _, path = hf_model(tmp_path, 7, num_hidden_layers=1, mlp_only_layers=[])
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=1, max_seq_len=8)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="generator must be a torch.Generator, got int"):
        engine.generate(ids, 2, do_sample=True, generator=0)
    assert engine.cache is None
    assert engine.generate(ids, 2, do_sample=True, generator=torch.Generator().manual_seed(0)).shape == (1, 5)


def test_engine_refuses_mixed_parameters_before_taking_any_layer(tmp_path):
    """A model whose later MoE layer's router is fp32 beside bf16 experts: Engine refuses it as it starts,
    the model still whole (SparseMoE's own check fired only at that layer, after the earlier layers had
    handed their experts over)."""
    pytest.importorskip("transformers")
    from test_engine import hf_model
    from turbomoe.inference import Engine
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 7, num_hidden_layers=2, mlp_only_layers=[])
    model = Qwen3MoeForCausalLM.from_pretrained(path).to(torch.bfloat16)
    gate = next(m for n, m in model.named_modules() if n.startswith("model.layers.1.") and n.endswith("gate.wg"))
    gate.float()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"share one dtype and device \(model.layers.1.\S+ is torch.float32"):
        Engine(model, max_batch=1, max_seq_len=8)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)

"""turbomoe.models.compile: the dense blocks and the MoE blocks compile without graph breaks, once
for all layers, and the compiled model's loss and gradients equal the eager model's. On the CPU through aot_eager
(dynamo's capture and AOTAutograd's joint graph, without generating code); the GPU test runs
inductor's kernels against eager in bf16."""
import copy

import pytest
import torch

pytest.importorskip("deepspeed")
from torch._dynamo.utils import counters  # noqa: E402

from conftest import needs_cuda  # noqa: E402
from turbomoe.models import ModelConfig, MoEArgs, Qwen3MoeForCausalLM  # noqa: E402
from turbomoe.models.compile import compile_dense_blocks, compile_moe_blocks, dense_blocks, moe_blocks  # noqa: E402


def tiny(layers=3, **kw):
    # Layer 1 dense (mlp_only_layers): the dense SwiGLU is compiled too.
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=layers, mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    base.update(kw)
    return ModelConfig.from_dict(base)


def pair(cfg, **compile_kwargs):
    eager = Qwen3MoeForCausalLM(cfg, MoEArgs())
    eager.init_weights(7)
    compiled = Qwen3MoeForCausalLM(cfg, MoEArgs())
    compiled.load_state_dict(eager.state_dict())
    return eager, compile_dense_blocks(compiled, **compile_kwargs)


def loss_and_grads(model, ids):
    out = model(ids, ids)
    (out.loss + 0.01 * out.aux_loss).backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_equal_in_float64(eager, compiled, cfg, seq):
    """Loss and every gradient of the two models equal in float64, and no graph break."""
    eager.double(), compiled.double()
    ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seq))
    ref_loss, ref_grads = loss_and_grads(eager, ids)
    loss, grads = loss_and_grads(compiled, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("seq", [1, 13])
def test_compiled_dense_blocks_match_eager_without_graph_breaks(seq):
    torch._dynamo.reset()
    counters.clear()
    cfg = tiny(layers=4)
    eager, compiled = pair(cfg, backend="aot_eager", fullgraph=True)
    assert_equal_in_float64(eager, compiled, cfg, seq)
    # One graph per block kind (the attention half, the dense MLP, the final norm), whatever the
    # depth, and one more for the first layer's attention half (no residual to add before its
    # norm): four layers add no recompiles.
    kinds = {(type(m).__name__, method) for m, method in dense_blocks(compiled)}
    assert len(kinds) == 3
    assert counters["stats"]["unique_graphs"] <= len(kinds) + 1, dict(counters["stats"])
    assert set(compiled.state_dict()) == set(eager.state_dict())  # names unchanged: checkpoints load either way


def test_deepcopy_of_a_compiled_model_runs_its_own_layers():
    """A deepcopy of a model whose dense blocks are compiled (an EMA or reference copy, a graphed twin)
    computes with its own parameters: before, each copied layer's compiled attention half stayed bound to
    the original layer, so the copy used the original's attention weights and its own got no gradient."""
    torch._dynamo.reset()
    cfg = tiny(layers=2)
    eager, compiled = pair(cfg, backend="aot_eager", fullgraph=True)
    copied = copy.deepcopy(compiled)
    with torch.no_grad():
        for model in (eager, copied):
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    assert_equal_in_float64(eager, copied, cfg, 9)
    assert all(p.grad is None for p in compiled.parameters())


@pytest.mark.parametrize("seq", [1, 13])
def test_compiled_moe_blocks_match_eager_without_graph_breaks(seq):
    """The recipe's train.compile_moe: the MoE blocks (turbomoe's DeepSpeed layer, dropless, ep_size
    1) each in one graph through turbomoe's custom ops, beside the compiled dense blocks."""
    torch._dynamo.reset()
    counters.clear()
    cfg = tiny(layers=4)
    eager, compiled = pair(cfg, backend="aot_eager", fullgraph=True)
    compile_moe_blocks(compiled, backend="aot_eager")
    assert_equal_in_float64(eager, compiled, cfg, seq)
    assert len(list(moe_blocks(compiled))) == 3  # layer 1 is dense
    kinds = {(type(m).__name__, method) for m, method in dense_blocks(compiled)}
    assert counters["stats"]["unique_graphs"] <= len(kinds) + 2, dict(counters["stats"])  # + the first layer's, + one MoE graph


@pytest.mark.gpu
@needs_cuda
def test_inductor_dense_blocks_match_eager_bf16():
    cfg = tiny(layers=3, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    eager, compiled = pair(cfg)
    eager.cuda().bfloat16(), compiled.cuda().bfloat16()
    ids = torch.randint(0, cfg.vocab_size, (4, 64), device="cuda")
    ref_loss, ref_grads = loss_and_grads(eager, ids)
    loss, grads = loss_and_grads(compiled, ids)
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=2e-2)
    for name, g in grads.items():
        torch.testing.assert_close(g.float(), ref_grads[name].float(), rtol=5e-2, atol=5e-3, msg=name)

"""torch.compile(fullgraph=True) through MoELayer and the DeepSpeed drop-in on the reference backend
(float64, CPU): one graph, no break, forward and backward equal to eager. The reference's
assign_slots and scatter_tokens (data-dependent shapes) and the reference grouped GEMM (a loop over
counts read on the host) run as turbomoe custom ops while compiling. The Triton kernels:
tests/test_compile_moe_triton.py."""
import pytest
import torch

from compile_cases import assert_compiles_like_eager, assert_exports_dynamic, ds_layer, moe_layer

D = torch.float64
REFERENCE_OPS = ("assign_slots", "scatter_tokens", "grouped_mm")  # the ones that would break the graph


@pytest.mark.parametrize("capacity_factor, S", [(None, 13), (1.25, 13), (0.5, 3), (1.0, 0)])
def test_moe_layer_compiles_without_graph_breaks(capacity_factor, S):  # S < E = 5 at 3; no tokens at 0
    torch.manual_seed(S)
    layer = moe_layer("reference", capacity_factor, D, bias=True, shared_ffn_hidden_size=4, z_loss_coef=0.1)
    x = torch.randn(S, 12, dtype=D)
    compiled = assert_compiles_like_eager(layer, x, rtol=1e-12, atol=1e-12, custom_ops=REFERENCE_OPS)
    torch.testing.assert_close(compiled.expert_load, layer.expert_load)


@pytest.mark.parametrize("capacity_factor, kw", [(None, dict(shared_ffn_hidden_size=4, bias=True)),
                                                 (1.25, dict(drop_policy="rts")), (1.0, dict(activation="gelu"))])
def test_moe_layer_exports_with_dynamic_shapes(capacity_factor, kw):
    torch.manual_seed(4)
    assert_exports_dynamic(moe_layer("reference", capacity_factor, D, **kw))


def test_moe_layer_one_hot_expert_gelu_probs_policy():
    torch.manual_seed(1)
    layer = moe_layer("reference", 1.0, D, activation="gelu", drop_policy="probs")  # the hot expert drops
    with torch.no_grad():  # every token picks expert 3 first
        layer.router.weight.zero_()
        layer.router.weight[3] = 1.0
    x = torch.rand(9, 12, dtype=D) + 0.5
    assert_compiles_like_eager(layer, x, rtol=1e-12, atol=1e-12, custom_ops=REFERENCE_OPS)


@pytest.mark.parametrize("k, drop_tokens, expert", [(1, False, "mlp"), (2, False, "swiglu"), (3, False, "swiglu"),
                                                    (2, True, "mlp")])
def test_deepspeed_drop_in_compiles_without_graph_breaks(k, drop_tokens, expert):
    """k = 1 capacity (stock's default, with RTS): test_random_token_selection_in_training_compiles."""
    pytest.importorskip("deepspeed")
    torch.manual_seed(k)
    layer = ds_layer(k, drop_tokens, D, expert)
    x = torch.randn(2, 7, 12, dtype=D)
    ops = REFERENCE_OPS if not drop_tokens else REFERENCE_OPS[:2]  # capacity: batched GEMMs
    compiled = assert_compiles_like_eager(layer, x, rtol=1e-12, atol=1e-12, custom_ops=ops)
    # dropless on one rank takes the grouped (rows) path, the capacity path the batched experts
    assert compiled.deepspeed_moe.exp_counts.sum() == 14 * k


def test_reference_custom_ops_opcheck():
    """Schema, fake implementation and registered autograd of the custom ops the reference backend
    runs while compiling (the kernel backends' are in test_custom_ops_triton.py / _compile_moe_triton.py)."""
    from turbomoe import custom_ops, ops
    from turbomoe.autograd.grouped_gemm import row_offsets
    S, E, k, M, N = 11, 5, 2, 6, 7
    g = ops.topk_gating(torch.randn(S, E, dtype=D), k)
    for capacity in (None, 2):
        torch.library.opcheck(custom_ops._assign_slots, (g.expert_ids, g.scores, E, capacity, "position", 0,
                                                         "reference"))
        s = ops.assign_slots(g.expert_ids, g.scores, E, capacity)
        x = torch.randn(S, M, dtype=D, requires_grad=True)
        torch.library.opcheck(custom_ops._scatter_tokens, (x, s.slots, s.num_rows, s.kept_counts, capacity,
                                                           "reference"))
    counts = torch.tensor([4, 0, 9, 1, 8], dtype=torch.int32)  # an empty group; rows 22 = sum(counts)
    x = torch.randn(22, M, dtype=D, requires_grad=True)
    w = torch.randn(E, M, N, dtype=D, requires_grad=True)
    for offs in (None, row_offsets(counts)):
        torch.library.opcheck(custom_ops._grouped_mm, (x, w, counts, offs, "reference"))
    torch.library.opcheck(custom_ops._grouped_mm, (x.detach(), w, counts, None, "reference"))  # dw only


def test_moe_layer_new_batch_sizes_compile_once_more(capacity_factor=1.25):
    """A second token count recompiles once with S symbolic (C and the buffer rows from S's shape,
    not from a tensor value); a third reuses that graph."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(2)
    layer = moe_layer("reference", capacity_factor, D)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for S in (13, 17, 29):
        x = torch.randn(S, 12, dtype=D)
        torch.testing.assert_close(compiled(x)[0], layer(x)[0], rtol=1e-12, atol=1e-12)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters["stats"])


def test_moe_layer_with_a_capacity_compiles_dynamic():
    """torch.compile(dynamic=True) traces the layer's capacity_factor as a symbol, which the capacity's
    finiteness check (math.isfinite) refused: the layer with a capacity did not compile with
    fullgraph=True (found by tests/test_fixes_review.py's reviewer). One graph for every token count."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(2)
    layer = moe_layer("reference", 1.25, D)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for S in (7, 13, 29):
        x = torch.randn(S, 12, dtype=D)
        torch.testing.assert_close(compiled(x)[0], layer(x)[0], rtol=1e-12, atol=1e-12)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])


def test_random_token_selection_in_training_compiles():
    """RTS draws a fresh seed each training step from torch's CPU generator; compiled, the draw is a
    tensor mixed into the seed inside the assign_slots op (no host int), and drops the same routes."""
    torch.manual_seed(4)
    layer = moe_layer("reference", 0.5, D, drop_policy="rts").train()
    x = torch.randn(13, 12, dtype=D)
    compiled = assert_compiles_like_eager(layer, x, rtol=1e-12, atol=1e-12, custom_ops=REFERENCE_OPS)
    torch.testing.assert_close(compiled.expert_load, layer.expert_load)
    pytest.importorskip("deepspeed")  # stock's default top-1: drop_tokens with use_rts
    assert_compiles_like_eager(ds_layer(1, True, D, use_rts=True).train(), x, rtol=1e-12, atol=1e-12,
                               custom_ops=REFERENCE_OPS[:2])


def test_seed_draw_is_mixed_into_the_seed_and_checked():
    from turbomoe import ops
    g = ops.topk_gating(torch.randn(13, 5, dtype=D), 2)
    draw = torch.tensor([123456789], dtype=torch.int64)
    mixed = ops.assign_slots(g.expert_ids, g.scores, 5, capacity=2, drop_policy="rts", seed=7, seed_draw=draw)
    plain = ops.assign_slots(g.expert_ids, g.scores, 5, capacity=2, drop_policy="rts", seed=7 ^ 123456789)
    assert torch.equal(mixed.slots, plain.slots)
    for bad in (7, torch.tensor([1, 2]), torch.tensor([1.0]), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(TypeError, match="seed_draw"):
            ops.assign_slots(g.expert_ids, g.scores, 5, capacity=2, drop_policy="rts", seed_draw=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_moe_layer_compiles_on_the_gpu_kernels(capacity_factor):
    """The default GPU backends (cuda gating, CUTLASS / torch._grouped_mm GEMMs) as custom ops, under
    inductor (the default torch.compile backend): one graph, and bf16 results equal to eager's."""
    from torch._dynamo.utils import counters
    from turbomoe.nn import MoELayer
    torch.manual_seed(0)
    layer = MoELayer(256, 512, 8, 2, capacity_factor=capacity_factor, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 300, 256, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    results = []
    for model in (layer, compiled):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out, aux = model(xi)
        (out.float().square().mean() + aux).backward()
        results.append([out, aux, xi.grad] + [p.grad for p in layer.parameters()])
    assert not counters["graph_break"], dict(counters["graph_break"])
    for got, ref in zip(results[1], results[0]):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)

"""turbomoe's Megatron-core integration on the CPU: the router math against megatron-core's own
functions and TopKRouter.routing, the layer against stock's MoELayer (its allgather dispatcher and
SequentialMLP experts, fed by turbomoe's router: stock's router moves its weight to CUDA), the
distributed-checkpoint layout against SequentialMLP's, and the spec helpers. The GPU tests (stock
router, GPT models, checkpoints on disk, expert parallelism, host syncs) are in test_megatron_gpu.py."""
import functools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from megatron_common import copy_stock_moe_to_turbomoe, experts_as_stock, model_parallel, moe_config  # noqa: E402
from turbomoe.integrations import megatron as tm  # noqa: E402
from turbomoe.integrations.megatron_router import (Routing, TurboTopKRouter, dense_routing, drop_slots,  # noqa: E402
                                                   routing_capacity, topk_routing)


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    with model_parallel("gloo"):
        yield


def _logits(T, E, hot=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, dtype=torch.float64, generator=g)
    if hot is not None:
        logits[:, hot] += 8.0  # one expert every token wants
    return logits.requires_grad_()


ROUTING_CASES = [  # T, E, k, score function, pre-softmax, scaling factor, hot expert, expert bias
    (37, 8, 2, "softmax", False, None, None, False),
    (37, 8, 1, "softmax", True, None, None, False),
    (5, 16, 4, "softmax", False, 2.5, None, False),  # T < E
    (29, 6, 3, "softmax", True, None, 2, False),  # one hot expert
    (1, 4, 2, "sigmoid", False, None, None, False),
    (33, 12, 1, "sigmoid", False, 1.5, None, True),
    (31, 7, 5, "sigmoid", False, None, 3, False),
    (31, 7, 5, "sigmoid", False, None, 3, True),  # the bias steers the choice, not the prob
]


@pytest.mark.parametrize("T,E,k,score,pre,scale,hot,with_bias", ROUTING_CASES)
def test_topk_routing_matches_megatron(T, E, k, score, pre, scale, hot, with_bias):
    bias = torch.randn(E, dtype=torch.float64) * 0.1 if with_bias else None
    logits = _logits(T, E, hot)
    ref_probs, ref_map = moe_utils.topk_routing_with_score_function(
        logits, k, use_pre_softmax=pre, scaling_factor=scale, score_function=score, expert_bias=bias)
    logits2 = logits.detach().clone().requires_grad_()
    g, probs_TK = topk_routing(logits2, k, score, pre, scale, bias)
    slots = drop_slots(g.expert_ids, probs_TK, E, None, "probs")
    probs, rmap = dense_routing(Routing(g.expert_ids, probs_TK, slots), E)
    assert torch.equal(rmap, ref_map)
    # Megatron's softmax runs in fp32 even on fp64 logits.
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)
    w = torch.randn(T, E, dtype=torch.float64)
    (ref_probs * w).sum().backward()
    (probs * w).sum().backward()
    torch.testing.assert_close(logits2.grad, logits.grad, rtol=1e-5, atol=1e-6)


def _stable_capacity_mask(routing_map, C):
    """Megatron's position policy as meant: each expert keeps its first C tokens in token order."""
    rank = torch.cumsum(routing_map.long(), 0) - 1
    return routing_map & (rank < C)


@pytest.mark.parametrize("T,E,k,cf,hot", [(40, 8, 2, 1.0, None), (23, 4, 3, 0.5, 1), (9, 16, 2, 1.25, None),
                                          (64, 8, 1, 0.25, 0)])
def test_capacity_drops_match_megatron(T, E, k, cf, hot):
    logits = _logits(T, E, hot).detach()
    g, probs_TK = topk_routing(logits, k, "softmax", k == 1)
    probs, rmap = moe_utils.topk_routing_with_score_function(logits, k, use_pre_softmax=k == 1)
    C = routing_capacity(T, E, k, cf)
    assert C == moe_utils.get_capacity(T * k, E, cf) or (C is None and moe_utils.get_capacity(T * k, E, cf) >= T)
    # probs: the C highest probs of each expert (no ties in random fp64 data), as Megatron's topk.
    ref_probs, ref_map = moe_utils.apply_router_token_dropping(probs, rmap, k, cf, drop_policy="probs")
    slots = drop_slots(g.expert_ids, probs_TK, E, C, "probs")
    p, m = dense_routing(Routing(g.expert_ids, probs_TK, slots), E)
    assert torch.equal(m, ref_map)
    torch.testing.assert_close(p, ref_probs, rtol=1e-6, atol=1e-7)
    # position: the first C tokens of each expert. (Megatron's CPU topk does not pick the earliest of
    # equal values, so the reference is the rule itself here; the GPU test compares with stock.)
    slots = drop_slots(g.expert_ids, probs_TK, E, C, "position")
    _, m = dense_routing(Routing(g.expert_ids, probs_TK, slots), E)
    assert torch.equal(m, _stable_capacity_mask(rmap, C if C is not None else T))
    # rts: min(count, C) routes kept per expert, a different subset for another seed where one drops.
    kept = [drop_slots(g.expert_ids, probs_TK, E, C, "rts", seed=s) for s in (0, 1, 2)]
    routed = rmap.sum(0).to(torch.int32)
    for s in kept:
        assert torch.equal(s.kept_counts, routed.clamp(max=C if C is not None else T))
    if C is not None and int(routed.max()) > C:
        assert not all(torch.equal(kept[0].slots >= 0, s.slots >= 0) for s in kept[1:])


ROUTER_CASES = [  # k, score function, load balancing type, aux coefficient, z coefficient, per-token loss
    (1, "softmax", "aux_loss", 0.01, 1e-3, False),  # turbomoe's fused aux loss
    (3, "softmax", "aux_loss", 0.01, None, False),  # fused
    (2, "softmax", "aux_loss", 0.01, 1e-3, False),  # Megatron's aux scores (k = 2)
    (2, "sigmoid", "aux_loss", 0.02, None, False),
    (2, "softmax", "seq_aux_loss", 0.01, 1e-3, False),
    (3, "softmax", ["aux_loss", "seq_aux_loss"], [0.01, 0.03], 1e-3, True),
    (2, "softmax", "none", 0.0, 1e-2, True),
]


@pytest.mark.parametrize("k,score,lb,aux,z,per_token", ROUTER_CASES)
def test_router_losses_match_stock_routing(k, score, lb, aux, z, per_token):
    """TurboTopKRouter.forward against stock TopKRouter.routing on the same fp64 logits: probs,
    routing map, gradients (with the aux losses and z-loss through MoEAuxLossAutoScaler) and the
    logged losses."""
    s, b, H, E = 11, 3, 16, 8
    moe_utils.clear_aux_losses_tracker()  # the tracker is global: what an earlier test in this process logged
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    cfg = moe_config(hidden_size=H, num_moe_experts=E, moe_router_topk=k, moe_router_score_function=score,
                     moe_router_pre_softmax=(k == 1), moe_router_load_balancing_type=lb, moe_aux_loss_coeff=aux,
                     moe_z_loss_coeff=z, calculate_per_token_loss=per_token, params_dtype=torch.float64,
                     moe_router_dtype="fp64")
    stock, turbo = TopKRouter(config=cfg, pg_collection=moe_utils.get_default_pg_collection()), TurboTopKRouter(cfg)
    with torch.no_grad():
        turbo.weight.copy_(stock.weight)
    x = torch.randn(s, b, H, dtype=torch.float64)
    w = torch.randn(s * b, E, dtype=torch.float64)
    results = []
    for router, layer in ((stock, 1), (turbo, 2)):
        router.train()
        router.set_layer_number(layer)
        xi = x.clone().requires_grad_()
        if router is stock:  # stock's own non-TE logits (its gating() would move the weight to CUDA)
            probs, rmap = router.routing(torch.matmul(xi, router.weight.t()))
        else:
            probs, rmap = router(xi)
        (probs * w).sum().backward()
        results.append((probs.detach(), rmap, xi.grad, router.weight.grad))
    (p1, m1, gx1, gw1), (p2, m2, gx2, gw2) = results
    assert torch.equal(m1, m2)
    torch.testing.assert_close(p2, p1, rtol=1e-6, atol=1e-7)
    # fp32 rounding: stock's softmax runs in fp32 on fp64 logits
    torch.testing.assert_close(gx2, gx1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw2, gw1, rtol=1e-5, atol=1e-6)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    assert tracker, "no loss was logged"
    for name, entry in tracker.items():
        torch.testing.assert_close(entry["values"][1], entry["values"][0], rtol=1e-6, atol=1e-9, msg=name)
    moe_utils.clear_aux_losses_tracker()
    tracker.clear()


LAYER_CASES = [  # k, capacity factor, drop policy, shared expert size, tokens (s, b)
    (2, None, "probs", None, (9, 4)),
    (1, None, "probs", 16, (9, 4)),
    (3, 1.0, "probs", None, (9, 4)),
    (2, 0.5, "position", None, (9, 4)),
    (2, 0.75, "rts", None, (9, 4)),
    (2, None, "probs", None, (1, 2)),  # fewer tokens than experts
    (3, 0.5, "position", None, (1, 3)),
]


PROBS_PATHS = {  # name: (config overrides, probs_before_fc2, probs in turbomoe's SwiGLU kernel, in the gather)
    "probs-in-swiglu-kernel": (dict(), False, True, False),
    "probs-before-fc2": (dict(), True, False, False),  # Megatron's own rounding, in the experts
    "gelu-probs-in-gather": (dict(gated_linear_unit=False, activation_func=F.gelu), False, False, True),
}


@pytest.mark.parametrize("path", list(PROBS_PATHS))
@pytest.mark.parametrize("k,cf,policy,shared,tokens", LAYER_CASES)
def test_layer_matches_stock_moe_layer(k, cf, policy, shared, tokens, path):
    """TurboMoELayer (turbomoe's dispatcher and grouped-GEMM experts) against stock's MoELayer with its
    allgather dispatcher and SequentialMLP, both routed by turbomoe's router (so on the CPU), fp64;
    the probs scaling SwiGLU experts' activation in turbomoe's kernel (default), with Megatron's own
    rounding (probs_before_fc2), or weighing GELU experts' rows in the gather."""
    E = 6
    overrides, before_fc2, in_kernel, in_gather = PROBS_PATHS[path]
    cfg = moe_config(num_moe_experts=E, moe_router_topk=k, moe_router_pre_softmax=(k == 1),
                     moe_expert_capacity_factor=cf, moe_token_drop_policy="probs" if policy == "rts" else policy,
                     moe_shared_expert_intermediate_size=shared, params_dtype=torch.float64, moe_router_dtype="fp64",
                     **overrides)
    stock_spec = get_moe_module_spec(use_te=False, num_experts=E)
    stock_spec.submodules.router = functools.partial(TurboTopKRouter, drop_policy=policy)
    torch.manual_seed(0)
    stock = build_module(stock_spec, config=cfg)
    turbo = build_module(tm.get_turbomoe_moe_spec(cfg, drop_policy=policy, probs_before_fc2=before_fc2), config=cfg)
    assert turbo.experts.probs_in_kernel == in_kernel and turbo.token_dispatcher.probs_in_combine == in_gather
    copy_stock_moe_to_turbomoe(stock, turbo)
    if shared:
        turbo.shared_experts.load_state_dict(stock.shared_experts.state_dict())
    x = torch.randn(*tokens, cfg.hidden_size, dtype=torch.float64)
    w = torch.randn_like(x)
    outs = []
    for layer in (stock, turbo):
        xi = x.clone().requires_grad_()
        torch.manual_seed(1)  # rts: both routers draw the same selection from torch's generator
        out, bias = layer(xi)
        assert bias is None and out.shape == x.shape
        (out * w).sum().backward()
        outs.append((out.detach(), xi.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(turbo.router.weight.grad, stock.router.weight.grad, rtol=1e-10, atol=1e-12)
    for name, g in experts_as_stock(turbo, grads=True).items():
        torch.testing.assert_close(g, stock.get_parameter(name).grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("cf", [None, 1.0])
def test_layer_with_no_tokens(cf):
    """An empty batch: empty output and input gradient, zero expert gradients, no loss (stock's aux
    loss divides by the token count)."""
    cfg = moe_config(moe_expert_capacity_factor=cf)
    layer = build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg)
    x = torch.randn(0, 2, cfg.hidden_size, requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape
    assert torch.count_nonzero(layer.experts.weight1.grad) == 0 and torch.count_nonzero(layer.router.weight.grad) == 0


def _sharded_tensors(module):
    sd = module.sharded_state_dict(prefix="mlp.")
    apply_factories(sd)
    return [t for t in nested_values(sd) if isinstance(t, ShardedTensor)]


def _global(tensors, key):
    """Assemble the global tensor of key from its shards."""
    shards = [t for t in tensors if t.key == key]
    out = torch.full(shards[0].global_shape, float("nan"), dtype=shards[0].data.dtype)
    for t in shards:
        view = out
        for dim, (off, size) in enumerate(zip(t.global_offset, (1,) * t.prepend_axis_num + tuple(t.local_shape))):
            view = view.narrow(dim, off, size)
        view.copy_(t.data.reshape(view.shape))
    return out


def test_sharded_state_dict_is_stock_layout():
    """The distributed-checkpoint keys, global shapes and assembled tensors of turbomoe's experts are
    those of stock's SequentialMLP (GroupedMLP's layout), so checkpoints load either way."""
    cfg = moe_config(num_moe_experts=4, hidden_size=16, moe_ffn_hidden_size=8)
    torch.manual_seed(0)
    stock = build_module(get_moe_module_spec(use_te=False, num_experts=4), config=cfg)
    turbo = build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg)
    copy_stock_moe_to_turbomoe(stock, turbo)
    st, tt = _sharded_tensors(stock), _sharded_tensors(turbo)
    keys = sorted({t.key for t in st})
    assert keys == sorted({t.key for t in tt})
    for key in keys:
        a, b = _global(st, key), _global(tt, key)
        assert not torch.isnan(a).any() and not torch.isnan(b).any(), key
        assert torch.equal(a, b), key


def test_block_spec_swaps_only_moe_layers():
    cfg = moe_config(num_layers=3, moe_layer_freq=[1, 0, 1])
    block = tm.get_turbomoe_gpt_decoder_block_spec(cfg, use_transformer_engine=False, drop_policy="rts")
    mlps = [layer.submodules.mlp for layer in block.layer_specs]
    assert [getattr(m, "module", None) is tm.TurboMoELayer for m in mlps] == [True, False, True]
    assert mlps[0].submodules.router.keywords["drop_policy"] == "rts"
    assert mlps[0].submodules.experts.module is tm.TurboGroupedMLP
    with pytest.raises(ValueError, match="no MoE layer"):
        tm.use_turbomoe(get_gpt_layer_local_spec())


@pytest.mark.parametrize("field,value", [("moe_router_group_topk", 2), ("moe_router_fusion", True),
                                         ("moe_pad_expert_input_to_capacity", True),
                                         ("moe_router_load_balancing_type", "sinkhorn"),
                                         ("expert_tensor_parallel_size", 2),
                                         ("moe_token_dispatcher_type", "flex"), ("add_bias_linear", True),
                                         ("moe_router_topk", 9)])
def test_unsupported_config_names_the_field(field, value):
    cfg = moe_config(moe_expert_capacity_factor=1.0)
    setattr(cfg, field, value)  # after construction: the config's own checks would stop some first
    with pytest.raises(ValueError, match=field):
        tm.check_config(cfg)


def test_bad_arguments_raise():
    cfg = moe_config()
    with pytest.raises(ValueError, match="drop_policy"):
        tm.get_turbomoe_moe_spec(cfg, drop_policy="first")
    with pytest.raises(TypeError, match="probs_before_fc2 must be a bool"):
        tm.get_turbomoe_moe_spec(cfg, probs_before_fc2="no")
    router = TurboTopKRouter(cfg)
    with pytest.raises(NotImplementedError, match="padding_mask"):
        router(torch.randn(4, 2, cfg.hidden_size), torch.zeros(4, 2, dtype=torch.bool))
    stock_router_spec = tm.get_turbomoe_moe_spec(cfg)
    stock_router_spec.submodules.router = TopKRouter
    with pytest.raises(TypeError, match="TurboTopKRouter"):
        build_module(stock_router_spec, config=cfg)


def test_moe_layer_is_megatron_moe_layer():
    assert issubclass(tm.TurboMoELayer, MoELayer) and issubclass(TurboTopKRouter, TopKRouter)
    assert isinstance(tm.get_turbomoe_moe_spec().submodules, MoESubmodules)


def test_rts_replays_under_recompute():
    """rts in training draws its selection from torch's CPU generator, which Megatron's recompute
    restores: the same generator state drops the same routes; the next step draws anew."""
    cfg = moe_config(hidden_size=16, num_moe_experts=4, moe_router_topk=2, moe_expert_capacity_factor=0.5,
                     params_dtype=torch.float64, moe_router_dtype="fp64")
    router = TurboTopKRouter(cfg, drop_policy="rts")
    router.train()
    router.set_layer_number(1)
    x = torch.randn(13, 3, 16, dtype=torch.float64)
    state = torch.get_rng_state()
    with torch.no_grad():
        first = router.route(x.view(-1, 16)).slots.slots
        torch.set_rng_state(state)  # what the recompute of this layer does
        again = router.route(x.view(-1, 16)).slots.slots
        later = [router.route(x.view(-1, 16)).slots.slots for _ in range(3)]
    assert bool((first < 0).any())  # routes were dropped, so the selection matters
    assert torch.equal(first, again)
    assert not all(torch.equal(first >= 0, s >= 0) for s in later)


def test_gradient_accumulation_fusion_into_main_grad():
    """config.gradient_accumulation_fusion with Megatron DDP's attributes on the expert weights (its
    fp32 main_grad, the grad_added_to_main_grad flag): two micro-batches' expert weight gradients are
    added to the pre-filled main_grad inside the weight-gradient GEMM, equal to the unfused layer's
    summed gradients, and the flag tells DDP's hook to skip the placeholder. Without DDP's attributes
    the flag changes nothing."""
    cfg, fused_cfg = moe_config(), moe_config(gradient_accumulation_fusion=True)
    torch.manual_seed(0)
    plain = build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg)
    fused = build_module(tm.get_turbomoe_moe_spec(fused_cfg), config=fused_cfg)
    bare = build_module(tm.get_turbomoe_moe_spec(fused_cfg), config=fused_cfg)  # no main_grad
    fused.load_state_dict(plain.state_dict())
    bare.load_state_dict(plain.state_dict())
    start = {}
    for name in ("weight1", "weight2"):
        p = getattr(fused.experts, name)
        p.main_grad = torch.randn(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
        start[name] = p.main_grad.clone()
    with torch.no_grad():  # no gradient: nothing is marked
        fused(torch.randn(4, 2, cfg.hidden_size))
    assert not fused.experts.weight1.grad_added_to_main_grad
    for _ in range(2):
        x = torch.randn(10, 2, cfg.hidden_size)
        for layer in (plain, fused, bare):
            out, _ = layer(x)
            out.sum().backward()
    for name in ("weight1", "weight2"):
        p, want = getattr(fused.experts, name), getattr(plain.experts, name).grad
        assert p.grad_added_to_main_grad and p.main_grad.dtype == torch.float32
        torch.testing.assert_close(p.main_grad, start[name] + want, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(getattr(bare.experts, name).grad, want, rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(fused.router.weight.grad, plain.router.weight.grad, rtol=1e-6, atol=1e-7)

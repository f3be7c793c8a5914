"""Code paths of the ops, autograd functions, kernels and the expert-stack / Megatron integration that no
CPU test executed (coverage review of ops.py, custom_ops.py, autograd/, kernels/, expert_stack.py,
megatron_experts.py, megatron_router.py), each checked against a float64 reference or stock Megatron.

Runs under TRITON_INTERPRET=1 on the CPU (the Triton launchers: kernels.router's partial sums and its
split at M = 0, kernels.rows.push_rows' early exit), natively on a GPU. The torch.compile-only lines
those files hold (is_compiling branches, custom_ops' wrappers) run in tests/test_compile*.py: coverage.py
does not see code that dynamo traces, so they are not repeated here.
"""
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import HAS_CUDA, rel_err

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA and not INTERPRET:
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU (as CI runs this file)",
                allow_module_level=True)

from turbomoe import reference as ref  # noqa: E402  (after the TRITON_INTERPRET check)
from turbomoe.autograd.bias_act import bias_act, bias_act_reference  # noqa: E402
from turbomoe.integrations import expert_stack as es  # noqa: E402
from turbomoe.kernels import router as kernel_router  # noqa: E402
from turbomoe.kernels import rows as kernel_rows  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ autograd/bias_act.py:59 (G = 0)

@pytest.mark.parametrize("act", ["none", "gelu_tanh", "gelu"])
def test_bias_act_with_no_groups_is_zero_both_ways(act):
    """b [0, N] (no expert on this rank): every row is past the groups, so out = 0 and no gradient
    reaches y, as bias_act_reference (the spec) says; b's gradient is [0, N]."""
    g = gen(1)
    R, N = 11, 7
    y = torch.randn(R, N, dtype=F64, generator=g)
    b = torch.randn(0, N, dtype=F64)
    groups = torch.randint(0, 5, (R, ), generator=g)
    w = torch.randn(R, N, dtype=F64, generator=g)
    results = []
    for fn in (bias_act, bias_act_reference):
        yy, bb = y.clone().requires_grad_(), b.clone().requires_grad_()
        out = fn(yy, bb, groups, act=act)
        (out * w).sum().backward()
        results.append((out.detach(), yy.grad, bb.grad))
    (out, gy, gb), (out_r, gy_r, gb_r) = results
    assert torch.equal(out_r, torch.zeros(R, N, dtype=F64))
    assert torch.equal(out, out_r) and torch.equal(gy, gy_r) and gb.shape == gb_r.shape == (0, N)


# ------------------------------------------------------------------ expert_stack.py

def _packed_experts(rows, K, E, seed, dtype=F64):
    """E modules each holding one parameter per entry of rows ([rows_i, K]), packed in one buffer."""
    g = gen(seed)
    experts = nn.ModuleList()
    for _ in range(E):
        m = nn.Module()
        for i, r in enumerate(rows):
            m.register_parameter(f"p{i}", nn.Parameter(torch.randn(r, K, dtype=dtype, generator=g)))
        experts.append(m)
    es.pack_expert_params(experts)
    return experts, [list(m.parameters()) for m in experts]


def test_stack_of_unequal_blocks_splits_the_gradient_per_tensor():
    """Blocks of tensors of unequal rows ([3, K] and [5, K] per expert; expert_stack.py:50): the stack
    aliases the packed parameters (no copy) and its backward hands each tensor its rows of the
    gradient, as torch.cat / torch.stack's would."""
    E, K = 3, 4
    experts, blocks = _packed_experts((3, 5), K, E, seed=2)
    stacked = es.stack_expert_tensors(blocks)
    assert stacked.shape == (E, 8, K) and stacked.data_ptr() == blocks[0][0].data_ptr()  # the alias
    want = torch.stack([torch.cat(b) for b in blocks]).detach()
    assert torch.equal(stacked, want)
    ws = [torch.randn(E, 8, K, dtype=F64, generator=gen(3 + i)) for i in range(2)]
    (stacked * ws[0]).sum().backward()
    for e, (a, b) in enumerate(blocks):
        assert torch.equal(a.grad, ws[0][e, :3]) and torch.equal(b.grad, ws[0][e, 3:])
    # a second backward: the .grad (views of the first gradient) take the stack's gradient in place
    (es.stack_expert_tensors(blocks) * ws[1]).sum().backward()
    for e, (a, b) in enumerate(blocks):
        assert torch.equal(a.grad, ws[0][e, :3] + ws[1][e, :3]) and torch.equal(b.grad, ws[0][e, 3:] + ws[1][e, 3:])


def test_stack_with_a_frozen_tensor_accumulates_the_others():
    """An expert tensor that takes no gradient (requires_grad False: no AccumulateGrad; expert_stack.py:75)
    while the others' .grad accumulate over two backwards: no in-place add over the stack (the frozen
    tensor's slot of .grad is not there), the gradient split per tensor; the sums are autograd's and the
    frozen tensor gets none."""
    E, K = 4, 5
    experts, blocks = _packed_experts((2, 2), K, E, seed=4)
    frozen = blocks[2][1]
    frozen.requires_grad_(False)
    ws = [torch.randn(E, 4, K, dtype=F64, generator=gen(5 + i)) for i in range(2)]
    for w in ws:
        stacked = es.stack_expert_tensors(blocks)
        assert stacked.data_ptr() == blocks[0][0].data_ptr()
        (stacked * w).sum().backward()
    total = ws[0] + ws[1]
    assert frozen.grad is None
    for e, (a, b) in enumerate(blocks):
        assert torch.equal(a.grad, total[e, :2])
        if b is not frozen:
            assert torch.equal(b.grad, total[e, 2:])


def test_alias_stride_cache_is_bounded_and_stays_right():
    """After 256 layouts the cache of alias strides is emptied (expert_stack.py:157): it stays bounded,
    and stacks made after it still alias and hold the parameters' values."""
    es._ALIAS_STRIDES.clear()
    kept = []
    for K in range(1, 260):
        experts, blocks = _packed_experts((1, ), K, 2, seed=K, dtype=torch.float32)
        kept.append(experts)  # live, so no later buffer reuses the addresses
        stacked = es.stack_expert_tensors(blocks)
        assert len(es._ALIAS_STRIDES) <= 256
        assert stacked.data_ptr() == blocks[0][0].data_ptr()
        assert torch.equal(stacked.detach(), torch.stack([b[0] for b in blocks]))
    assert len(es._ALIAS_STRIDES) == 259 - 256  # emptied once, at the 257th layout
    es._ALIAS_STRIDES.clear()


def test_pack_leaves_experts_of_mixed_dtypes_alone():
    """Parameters of two dtypes (expert_stack.py:237): not packed (one flat buffer has one dtype), names,
    values and storages unchanged; the stack over them is then a copy with the right values. No
    parameters at all: nothing to do."""
    experts = nn.ModuleList([nn.Linear(3, 4, bias=False), nn.Linear(3, 4, bias=False).double()])
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in experts.named_parameters()}
    es.pack_expert_params(experts)
    for n, p in experts.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n
    es.pack_expert_params(nn.ModuleList([nn.ReLU(), nn.ReLU()]))  # no parameters: returns
    same = nn.ModuleList([nn.Linear(3, 4, bias=False) for _ in range(2)])
    es.pack_expert_params(same)
    blocks = [[m.weight] for m in same]
    stacked = es.stack_expert_tensors(blocks)
    assert stacked.data_ptr() == same[0].weight.data_ptr()  # one dtype: packed and aliased


def test_join_weight_grads_is_a_no_op_after_a_cpu_backward():
    """EqualGroups' weight gradient into a buffer on the CPU runs inline (nothing on a side stream):
    join_weight_grads (expert_stack.py:269-271) then has nothing to wait for, and the buffer holds the
    float64 reference gradient sum_c dy^T x per expert."""
    E, C, K, N = 3, 5, 4, 6
    experts, blocks = _packed_experts((N, ), K, E, seed=9)
    params = [b[0] for b in blocks]
    flat = torch.zeros(sum(p.numel() for p in params), dtype=F64)
    views = {p: flat[i * N * K:(i + 1) * N * K] for i, p in enumerate(params)}
    x = torch.randn(E, C, K, dtype=F64, generator=gen(10))
    dy = torch.randn(E, C, N, dtype=F64, generator=gen(11))
    with es.weight_grad_buffers(views, add=False):
        y = es.EqualGroups().matmul(x, es.stack_expert_tensors(blocks), blocks)
        (y * dy).sum().backward()
    es.join_weight_grads()
    assert not es._PENDING
    torch.testing.assert_close(y.detach(), torch.einsum("eck,enk->ecn", x, torch.stack(params).detach()))
    torch.testing.assert_close(flat.view(E, N, K), torch.einsum("ecn,eck->enk", dy, x))
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("drop_tokens", [False, True])
def test_compiled_drop_in_accumulates_gradients_with_fused_accumulation(drop_tokens):
    """The DeepSpeed drop-in with fused_grad_accumulation under torch.compile (aot_eager, no graph break):
    the stack is a copy there and GradsInPlace.of declines (expert_stack.py:111, traced by dynamo, so
    invisible to coverage), the gradients go through autograd; over two micro-batches the parameters'
    .grad equal the eager unfused layer's sums (fp64)."""
    pytest.importorskip("deepspeed")
    import copy

    from torch._dynamo.utils import counters

    from turbomoe.integrations.deepspeed import MoE, SwiGLUExpert
    torch.manual_seed(40)
    plain = MoE(12, SwiGLUExpert(12, 7), num_experts=5, k=2, drop_tokens=drop_tokens, min_capacity=0,
                capacity_factor=1.0, fused_grad_accumulation=False).double()
    fused = MoE(12, SwiGLUExpert(12, 7), num_experts=5, k=2, drop_tokens=drop_tokens, min_capacity=0,
                capacity_factor=1.0, fused_grad_accumulation=True).double()
    fused.load_state_dict(plain.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(copy.deepcopy(fused), backend="aot_eager", fullgraph=True)
    for i in range(2):
        x = torch.randn(11, 12, dtype=F64, generator=gen(41 + i))
        for layer in (plain, compiled):
            torch.manual_seed(5)
            out, l_aux, _ = layer(x)
            (out.square().sum() + l_aux).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    for (name, p), q in zip(compiled._orig_mod.named_parameters(), plain.parameters()):
        assert p.grad is not None and rel_err(p.grad, q.grad) < 1e-12, name


# ------------------------------------------------------------------ kernels (Triton launchers)

@pytest.mark.parametrize("T, E, M", [(7, 5, 300), (19, 37, 129), (1, 3, 17)])
def test_router_logit_parts_sum_to_the_logits(T, E, M):
    """kernels.router.router_logit_parts (router.py:43-84; on a GPU the inference router from
    ROUTER_PARTS_MIN_TOKENS tokens): fp32 partial sums of x @ w^T over 128-column slices of M, each
    slice's sum that slice's product (fp16: exact products, fp32 sums). bf16 is left to the GPU: the
    interpreter's bf16 tl.dot is wrong (kernels/router.py's _dot notes it), and this kernel dots bf16
    tiles directly."""
    g = gen(T * 100 + E)
    x = torch.randn(T, M, generator=g).half().to(DEV)
    w = torch.randn(E, M, generator=g).half().to(DEV)
    parts = kernel_router.router_logit_parts(x, w)
    S = -(-M // kernel_router.PARTS_BLOCK_K)
    assert parts.shape == (S, T, E) and parts.dtype == torch.float32
    for s in range(S):
        cols = slice(s * kernel_router.PARTS_BLOCK_K, (s + 1) * kernel_router.PARTS_BLOCK_K)
        want = x[:, cols].double() @ w[:, cols].double().t()
        assert rel_err(parts[s], want) < 1e-6, s
    assert rel_err(parts.sum(0), x.double() @ w.double().t()) < 1e-6


def test_router_logit_parts_and_split_logits_with_no_columns():
    """M = 0: the partial sums are one slice of zeros (router.py:78-79) and split_logits' output zeros
    (router.py:293), as reference.split_logits; no tokens or experts: empty."""
    x, w = torch.randn(4, 0).half().to(DEV), torch.randn(3, 0).half().to(DEV)
    assert torch.equal(kernel_router.router_logit_parts(x, w), torch.zeros(1, 4, 3, device=DEV))
    assert kernel_router.router_logit_parts(x[:0], w).shape == (1, 0, 3)
    for w_dtype in (torch.bfloat16, torch.float32):
        xb, wb = torch.randn(5, 0, dtype=torch.bfloat16, device=DEV), torch.randn(3, 0, device=DEV).to(w_dtype)
        got = kernel_router.split_logits(xb, wb)
        assert torch.equal(got, ref.split_logits(xb, wb)) and torch.equal(got, torch.zeros(5, 3, device=DEV))


@pytest.mark.parametrize("S, R", [(6, 9), (0, 0)])
def test_push_rows_with_no_columns_zeroes_the_score_gradient(S, R):
    """push_rows with a score gradient to write and no columns (or no tokens and no rows;
    rows.py:205-207): nothing to push, dscores zeroed, as reference.zero_width_dscores gives without
    renormalize (gather's backward takes that branch itself before the launcher)."""
    k = 2
    src = torch.randn(S, 0, device=DEV)
    slots = torch.randperm(max(R, S * k), generator=gen(12))[:S * k].view(S, k).to(torch.int32).to(DEV)
    slots[slots >= R] = -1
    scores = torch.rand(S, k, generator=gen(13)).to(DEV)
    out = torch.empty(R, 0, device=DEV)
    dscores = torch.full((S, k), float("nan"), device=DEV)
    kernel_rows.push_rows(src, slots, out, None, None, scores_SK=scores, y_RM=torch.empty(R, 0, device=DEV),
                          dscores_SK=dscores)
    assert torch.equal(dscores, ref.zero_width_dscores(scores, slots, R, False, torch.float32))


# ------------------------------------------------------------------ Megatron experts and router

@pytest.fixture(scope="module")
def megatron_state():
    pytest.importorskip("megatron.core")
    from megatron_common import model_parallel
    with model_parallel("gloo"):
        yield


def _tokens(shape, hidden, seed):
    g = gen(seed)
    x = torch.randn(*shape, hidden, dtype=F64, generator=g)
    return x, torch.randn(x.shape, dtype=F64, generator=g)


GLU_CASES = {  # megatron_experts.py:155-159: a GLU that is not turbomoe's plain SwiGLU kernel
    "gelu GLU": dict(activation_func=F.gelu),
    "silu GLU, clamp, no fusion": dict(activation_func_clamp_value=0.4),
    "silu GLU, linear offset": dict(glu_linear_offset=0.7),
    "gelu GLU, clamp and offset": dict(activation_func=F.gelu, activation_func_clamp_value=0.5,
                                       glu_linear_offset=-0.3),
}


@pytest.mark.parametrize("case", list(GLU_CASES))
def test_megatron_glu_variants_match_stock(megatron_state, case):
    """Gated experts whose activation is not silu(gate) * up (another activation, a clamp without the
    fused kernel, a linear offset): turbomoe's experts run Megatron's own glu (chunk, clamp, act(gate) *
    (up + offset)), the probs after it; output and every gradient equal stock's MoELayer's (fp64)."""
    from megatron_review_script import build_pair, check_step, config
    cfg = config(**GLU_CASES[case])
    stock, turbo = build_pair(cfg)
    assert not turbo.experts.plain_swiglu
    check_step(stock, turbo, *_tokens((5, 3), cfg.hidden_size, seed=len(case)), case)


def test_megatron_glu_with_moe_act_recompute_matches_stock(megatron_state):
    """A gelu GLU under moe_act recompute (the activation, megatron_experts.py:155-159, freed after fc2 and
    rerun in backward): output and every gradient equal stock's layer without recompute (stock takes
    moe_act only with its grouped GEMM, which needs the grouped_gemm package)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_common import copy_stock_moe_to_turbomoe
    from megatron_review_script import build_pair, check_step, config, stock_on_cpu
    from turbomoe.integrations import megatron as tm
    stock, _ = build_pair(config(activation_func=F.gelu))
    cfg = config(activation_func=F.gelu, moe_grouped_gemm=True, recompute_granularity="selective",
                 recompute_modules=["moe_act"])
    with stock_on_cpu():
        turbo = build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg)
    copy_stock_moe_to_turbomoe(stock, turbo)
    turbo.set_layer_number(1)
    assert turbo.experts.activation_recompute and not turbo.experts.plain_swiglu
    check_step(stock, turbo, *_tokens((7, 2), cfg.hidden_size, seed=17), "gelu GLU, moe_act recompute")


def test_megatron_experts_load_a_state_dict_with_extra_states(megatron_state):
    """Stock's SequentialMLP-compatible state dicts carry _extra_state entries (Transformer Engine's):
    GroupedMLP's load hook drops them from the unexpected keys (megatron_experts.py:168), so a strict
    load takes the weights; any other unexpected key still fails."""
    from megatron_review_script import build_pair, config
    cfg = config()
    _, turbo = build_pair(cfg)
    _, other = build_pair(config())
    with torch.no_grad():
        for p in other.experts.parameters():
            p.mul_(-2.0)
    sd = dict(other.experts.state_dict())
    sd["linear_fc1._extra_state"] = None
    sd["linear_fc2._extra_state"] = None
    result = turbo.experts.load_state_dict(sd, strict=True)
    assert result.unexpected_keys == [] and result.missing_keys == []
    for (n, p), q in zip(turbo.experts.named_parameters(), other.experts.parameters()):
        assert torch.equal(p, q), n
    sd["linear_fc1.not_a_weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="not_a_weight"):
        turbo.experts.load_state_dict(sd, strict=True)


def test_megatron_force_load_balancing_matches_stock(megatron_state):
    """moe_router_force_load_balancing (megatron_router.py:146): the logits replaced by Megatron's random
    ones (RandomSTE: drawn in the expert-parallel RNG tracker's fork, here the CPU generator, seeded
    alike for both), the gradient passed straight through; the same routes, output, gradients and
    losses as stock's layer."""
    import contextlib

    from megatron.core.transformer.moe import moe_utils
    from megatron_review_script import build_pair, check_step, config, step

    class Tracker:
        def fork(self, name=None):
            return contextlib.nullcontext()
    cfg = config(moe_router_force_load_balancing=True, num_moe_experts=7, moe_router_topk=3)
    stock, turbo = build_pair(cfg)
    with mock.patch.object(moe_utils, "get_cuda_rng_tracker", lambda *a, **k: Tracker()):
        check_step(stock, turbo, *_tokens((6, 3), cfg.hidden_size, seed=21), "forced balancing")
        # the random logits, not the router's: the output does not follow a change of the router weight
        out1 = step(turbo, *_tokens((6, 3), cfg.hidden_size, seed=21))[0]
        with torch.no_grad():
            turbo.router.weight.mul_(3.0)
        out2 = step(turbo, *_tokens((6, 3), cfg.hidden_size, seed=21))[0]
    assert torch.equal(out1, out2)


@pytest.mark.parametrize("router_dtype", ["fp64", "fp32"])
def test_megatron_router_bias_is_added_to_the_logits(megatron_state, router_dtype):
    """A router bias (megatron_router.py:136; stock's TopKRouter has one with add_bias_linear, which
    turbomoe's config check refuses, so only one set on the module reaches it): logits = x w^T + b in
    the router dtype, as stock's router_gating_linear; the bias gets the logits' column sums."""
    from megatron_review_script import build_pair, config
    cfg = config(moe_router_dtype=router_dtype)
    _, turbo = build_pair(cfg)
    router = turbo.router
    E, H = router.weight.shape
    router.bias = nn.Parameter(torch.randn(E, dtype=F64, generator=gen(30)))
    x = torch.randn(4, 3, H, dtype=F64, generator=gen(31))
    g = torch.randn(4, 3, E, dtype=F64, generator=gen(32))
    logits = router.gating(x)
    dtype = F64 if router_dtype == "fp64" else torch.float32
    assert logits.dtype == dtype and logits.shape == (4, 3, E)
    want = (x.reshape(-1, H) @ router.weight.t() + router.bias).view(4, 3, E)
    assert rel_err(logits, want) < (1e-12 if dtype == F64 else 1e-6)
    (logits.double() * g).sum().backward()
    torch.testing.assert_close(router.bias.grad, g.sum((0, 1)))

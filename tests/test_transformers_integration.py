"""turbomoe in transformers' experts registry: the "turbomoe" experts of Qwen3-MoE, Mixtral and GPT-OSS
(transposed weights, biases, its own gate) against transformers' "eager" loop, forward and backward
(input, routing weights, expert weights and biases), in float64 on fresh random data, over odd sizes and edge cases (no tokens, one hot expert, fewer tokens than
experts, empty experts); and a whole model switched with set_experts_implementation."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
import turbomoe.integrations.transformers as tt  # noqa: E402


def qwen3_experts(H=20, F=12, E=7):
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=3)
    return transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg), cfg


def mixtral_experts(H=18, F=26, E=5):
    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=2)
    return transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg), cfg


def gpt_oss_experts(H=22, F=14, E=6):
    """Transposed weights ([E, H, 2F]), biases, and its own gate (interleaved, clamped)."""
    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=2)
    return transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg), cfg


def routes(S, E, k, g, hot=None):
    """Distinct random experts per token (or expert `hot` first for every token) and positive weights."""
    ids = torch.zeros(0, k, dtype=torch.long)
    if S:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(S)])
    if hot is not None and S:
        ids[:, 0] = hot
        ids[:, 1:] = (hot + 1 + torch.stack([torch.randperm(E - 1, generator=g)[:k - 1] for _ in range(S)])) % E
    return ids, torch.rand(S, k, generator=g, dtype=torch.float64) + 0.1


def fp32_case(family, S, seed=5):
    """A family's experts with random fp32 weights, S tokens and their routes: (experts, x, ids, w)."""
    g = torch.Generator().manual_seed(seed)
    experts, cfg = family()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(S, cfg.hidden_size, generator=g)
    ids, w = routes(S, experts.num_experts, cfg.num_experts_per_tok, g)
    return experts, x, ids, w.float()


def run(experts, impl, x, ids, w):
    experts.config._experts_implementation = impl
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    for p in experts.parameters():
        p.grad = None
    out = experts(x, ids, w)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(out)
    if out.requires_grad:  # eager's output for no tokens is a constant (zeros)
        (out * grad_out).sum().backward()
    zero_if_none = lambda t, like: torch.zeros_like(like) if t is None else t.clone()  # noqa: E731
    return (out, zero_if_none(x.grad, x), zero_if_none(w.grad, w),
            [zero_if_none(p.grad, p) for p in experts.parameters()])


@pytest.mark.parametrize("family", [qwen3_experts, mixtral_experts, gpt_oss_experts])
@pytest.mark.parametrize("S, hot", [(37, None), (0, None), (2, None), (29, 2)])
def test_experts_against_eager(family, S, hot):
    tt.register()
    g = torch.Generator().manual_seed(S * 31 + (hot or 0))
    experts, cfg = family()
    experts = experts.double()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    E, k = experts.num_experts, cfg.num_experts_per_tok
    x = torch.randn(S, cfg.hidden_size, generator=g, dtype=torch.float64)
    ids, w = routes(S, E, k, g, hot)
    if S == 2:
        assert len(ids.unique()) < E  # fewer tokens than experts: some experts are empty
    expected = run(experts, "eager", x, ids, w)
    got = run(experts, "turbomoe", x, ids, w)
    for a, b in zip(got[:3], expected[:3]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for a, b in zip(got[3], expected[3]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def tiny_qwen3_model():
    cfg = transformers.Qwen3MoeConfig(vocab_size=53, hidden_size=20, intermediate_size=28, moe_intermediate_size=10,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=10,
                                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)
    return transformers.Qwen3MoeForCausalLM(cfg)


def test_register_is_idempotent_and_switches_a_model():
    assert tt.register() == tt.register() == "turbomoe"
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS["turbomoe"] is tt.turbomoe_experts_forward
    torch.manual_seed(0)
    model = tiny_qwen3_model().double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    ids = torch.randint(0, 53, (2, 9))

    def loss_and_grads(impl):
        model.set_experts_implementation(impl)
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = loss_and_grads("eager")
    loss, grads = loss_and_grads("turbomoe")
    assert model.config._experts_implementation == "turbomoe"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def check_gradient_checkpointing(dtype, tol):
    """A whole Mixtral model (router jitter noise in training: random, replayed by the recomputation) with
    transformers' gradient checkpointing, both of torch's checkpoint kinds: the loss and every gradient
    those of eager experts without checkpointing, and the same bits as turbomoe's without it."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=53, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=5,
                                     num_experts_per_tok=2, router_jitter_noise=0.1)
    model = transformers.MixtralForCausalLM(cfg).to(dtype).train()
    ids = torch.randint(0, 53, (2, 9))

    def loss_and_grads(impl, reentrant=None):
        model.set_experts_implementation(impl)
        if reentrant is None:
            model.gradient_checkpointing_disable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.zero_grad()
        torch.manual_seed(3)  # the same jitter
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    want = loss_and_grads("eager")
    plain = loss_and_grads("turbomoe")
    for got in plain, loss_and_grads("turbomoe", True), loss_and_grads("turbomoe", False):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        for a, b in zip(got, plain):
            assert torch.equal(a, b)


def test_gradient_checkpointing():
    tt.register()
    check_gradient_checkpointing(torch.float64, 1e-10)


def test_exported_with_a_dynamic_sequence_length():
    """torch.export of a whole Qwen3-MoE model on turbomoe's experts, the sequence length dynamic: the
    program equals the model at another length (transformers' own eager experts do not export so: their
    per-expert loop guards on data-dependent sizes, transformers 5.x)."""
    tt.register()
    torch.manual_seed(0)
    model = tiny_qwen3_model().eval()
    model.set_experts_implementation("turbomoe")

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, use_cache=False).logits

    program = torch.export.export(Logits(), (torch.randint(0, 53, (2, 9)), ),
                                  dynamic_shapes={"ids": {1: torch.export.Dim("T", min=2, max=512)}}).module()
    ids = torch.randint(0, 53, (2, 17))
    torch.testing.assert_close(program(ids), Logits()(ids), rtol=0, atol=0)


def test_expert_parallel_experts_are_refused():
    tt.register()
    experts, cfg = qwen3_experts()
    experts.config._experts_implementation = "turbomoe"
    experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        experts(torch.randn(3, cfg.hidden_size), torch.zeros(3, 3, dtype=torch.long), torch.ones(3, 3))


def test_more_experts_a_token_than_the_slots_hold_is_refused():
    """k > ops.MAX_K (Qwen3-Next's default k is 10): an error naming the limit, not the slot tables'."""
    tt.register()
    cfg = transformers.Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=12, num_experts_per_tok=10)
    experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
    experts.config._experts_implementation = "turbomoe"
    ids = torch.stack([torch.randperm(12)[:10] for _ in range(3)])
    with pytest.raises(NotImplementedError, match="routes 10 experts a token; .* takes at most 8"):
        experts(torch.randn(3, 8), ids, torch.rand(3, 10))


@pytest.mark.parametrize("family", [qwen3_experts, gpt_oss_experts])
def test_compiled_experts_against_eager(family):
    """torch.compile through the experts, forward and backward: nn.Linear-layout weights reach the grouped
    GEMM as transposed views, and the weight gradient's fake (compile-time) layout must be the one the
    kernel returns (it was contiguous, and inductor's stride check failed). Compile caches off: a cached
    graph would not trace the fake again."""
    torch._dynamo.reset()
    tt.register()
    experts, x, ids, w = fp32_case(family, 11)
    expected = run(experts, "eager", x, ids, w)
    forward = experts.forward
    experts.forward = torch.compile(forward)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
                enable_autograd_cache=False):
            got = run(experts, "turbomoe", x, ids, w)
    finally:
        experts.forward = forward
        torch._dynamo.reset()
    for a, b in zip(got[:3], expected[:3]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(got[3], expected[3]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", [qwen3_experts, mixtral_experts, gpt_oss_experts])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_experts_against_eager(family, dtype):
    """On the GPU's kernels (Qwen3-MoE's and Mixtral's routing weights inside the SwiGLU kernel,
    GPT-OSS's own gate with the weights in the gather) against transformers' eager loop in fp64."""
    tt.register()
    g = torch.Generator().manual_seed(11)
    experts, cfg = family()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    x = torch.randn(61, cfg.hidden_size, generator=g, dtype=torch.float64)
    ids, w = routes(61, experts.num_experts, cfg.num_experts_per_tok, g)
    expected = run(experts.double(), "eager", x, ids, w)
    got = run(experts.to("cuda", dtype), "turbomoe", x.to("cuda", dtype), ids.cuda(), w.to("cuda", dtype))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip([*got[:3], *got[3]], [*expected[:3], *expected[3]]):
        err = ((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err < tol, err

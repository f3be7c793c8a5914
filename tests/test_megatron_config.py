"""Megatron-core settings turbomoe's layer must refuse rather than run differently from stock (CPU):
moe_apply_probs_on_input above top-1, partial CUDA graphs of the MoE layer, expert-parallel
communication overlap, Transformer Engine's activation ops other than SwiGLU."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from megatron_common import copy_stock_moe_to_turbomoe, experts_as_stock, model_parallel, moe_config  # noqa: E402
from turbomoe.integrations import megatron as tm  # noqa: E402
from turbomoe.integrations.megatron_router import TurboTopKRouter  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    with model_parallel("gloo"):
        yield


def test_apply_probs_on_input_needs_top1():
    """Megatron's experts (SequentialMLP, GroupedMLP, TEGroupedMLP) assert moe_router_topk == 1 with
    moe_apply_probs_on_input (scaling the input of a nonlinear expert by each route's prob is not the
    weighted sum of k outputs); turbomoe's layer ran it at any k."""
    cfg = moe_config(moe_router_topk=2, moe_apply_probs_on_input=True)
    with pytest.raises(ValueError, match="moe_apply_probs_on_input"):
        tm.check_config(cfg)
    with pytest.raises(ValueError, match="moe_apply_probs_on_input"):
        build_module(tm.get_turbomoe_moe_spec(), config=cfg)


def test_apply_probs_on_input_top1_matches_stock():
    """At top-1 (what stock allows) the layer equals stock's MoELayer (SequentialMLP), fp64."""
    E = 6
    cfg = moe_config(num_moe_experts=E, moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True,
                     params_dtype=torch.float64, moe_router_dtype="fp64")
    stock_spec = get_moe_module_spec(use_te=False, num_experts=E)
    stock_spec.submodules.router = TurboTopKRouter  # stock's own router needs CUDA
    stock, turbo = build_module(stock_spec, config=cfg), build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg)
    copy_stock_moe_to_turbomoe(stock, turbo)
    x = torch.randn(7, 3, cfg.hidden_size, dtype=torch.float64)
    w = torch.randn_like(x)
    outs = []
    for layer in (stock, turbo):
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        (out * w).sum().backward()
        outs.append((out.detach(), xi.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-10, atol=1e-12)
    for name, g in experts_as_stock(turbo, grads=True).items():
        torch.testing.assert_close(g, stock.get_parameter(name).grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("impl,scope", [("transformer_engine", ["moe_router"]),
                                        ("transformer_engine", ["attn", "moe_router", "moe_preprocess"]),
                                        ("local", ["moe_preprocess"])])
def test_partial_moe_cuda_graph_is_refused(impl, scope):
    """Partial CUDA graphs capture MoELayer.route (and preprocess) alone: stock's route stops the
    capture there (its decorator), turbomoe's overriding route did not, so the whole layer ran inside
    the router's graph (and the local graphs read the stock dispatcher's cudagraph_attrs); the check
    refuses those scopes, not the others."""
    cfg = moe_config(cuda_graph_impl=impl, cuda_graph_scope=scope)
    with pytest.raises(ValueError, match="cuda_graph_scope"):
        tm.check_config(cfg)
    tm.check_config(moe_config(cuda_graph_impl=impl, cuda_graph_scope=["attn"]))
    tm.check_config(moe_config(cuda_graph_scope=["moe_router"]))  # no CUDA graphs: the scope is unused


def test_expert_parallel_comm_overlap_is_refused():
    """Megatron's fine-grained schedule (overlap_moe_expert_parallel_comm) detaches the layer's probs
    between its nodes as tensors; turbomoe's are tables, which failed there with an AttributeError."""
    cfg = moe_config()
    cfg.overlap_moe_expert_parallel_comm = True  # its own checks need expert parallelism and bf16
    with pytest.raises(ValueError, match="overlap_moe_expert_parallel_comm"):
        tm.check_config(cfg)


@pytest.mark.parametrize("overrides", [dict(activation_func=F.gelu),
                                       dict(gated_linear_unit=False, activation_func=F.gelu),
                                       dict(gated_linear_unit=False), dict(activation_func_clamp_value=7.0),
                                       dict(activation_func_fp8_input_store=True)],
                         ids=["geglu", "gelu", "silu", "clamped-swiglu", "fp8-input-store"])
def test_te_activation_func_needs_plain_swiglu(overrides):
    """use_te_activation_func makes stock's experts run Transformer Engine's activation ops: tanh GELU (turbomoe's
    experts: config.activation_func, erf GELU), ReLU for a non-gated silu, SwiGLU without clamp or exact input.
    turbomoe's layer ran them all with config.activation_func; now refused unless the plain SwiGLU."""
    with pytest.raises(ValueError, match="use_te_activation_func"):
        tm.check_config(moe_config(use_te_activation_func=True, **overrides))
    tm.check_config(moe_config(use_te_activation_func=True))

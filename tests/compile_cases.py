"""Shared by tests/test_compile_moe.py (reference backend) and tests/test_compile_moe_triton.py
(Triton kernels under TRITON_INTERPRET=1): torch.compile(fullgraph=True) of MoELayer and of the
DeepSpeed drop-in, one graph and no graph break, compiled forward and backward equal to eager.

aot_eager runs dynamo's capture and AOTAutograd's joint graph (where the custom ops' fake
implementations and registered autograd are used) without generating code, so the CPU can run it."""
import copy

import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters


def moe_layer(backend, capacity_factor, dtype, **kw):
    from turbomoe.nn import MoELayer
    gmm = None if backend == "reference" else backend
    return MoELayer(12, 6, 5, 2, capacity_factor=capacity_factor, backend=backend, gmm_backend=gmm, dtype=dtype,
                    **kw)


def ds_layer(k, drop_tokens, dtype, expert="swiglu", use_rts=False):
    from torch import nn
    from turbomoe.integrations.deepspeed import MoE, SwiGLUExpert
    module = (SwiGLUExpert(12, 6) if expert == "swiglu"
              else nn.Sequential(nn.Linear(12, 6), nn.GELU(), nn.Linear(6, 12)))
    return MoE(12, module, num_experts=5, k=k, drop_tokens=drop_tokens, use_rts=use_rts, min_capacity=0,
               capacity_factor=1.0).to(dtype)


def run(model, x):
    """loss, its input and parameter gradients, and the model's other outputs (detached)."""
    torch.manual_seed(0)  # the same draws (sampled second expert, RTS seeds) in both runs
    x = x.detach().requires_grad_()
    out = model(x)
    loss = out[0].square().sum() + sum(o.float().sum() for o in out[1:] if o.is_floating_point())
    loss.backward()
    extras = [o.detach() for o in out[1:]]
    grads = {n: p.grad for n, p in getattr(model, "_orig_mod", model).named_parameters()}
    return out[0].detach(), extras, x.grad, grads


def turbomoe_ops_in(gm: torch.fx.GraphModule) -> set:
    """Names of the turbomoe custom ops dynamo's graph calls."""
    return {n.target.name().split("::")[1].split(".")[0] for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "turbomoe"}


def assert_compiles_like_eager(model, x, rtol, atol, custom_ops=()):
    """model compiled with fullgraph=True traces in one graph, no break, calling (at least) the
    turbomoe custom ops named, and its outputs and gradients equal eager's (model's own copy, same
    parameters)."""
    torch._dynamo.reset()
    counters.clear()
    seen = set()

    def backend(gm, example_inputs):
        seen.update(turbomoe_ops_in(gm))
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)
    ref = run(model, x)
    got = run(compiled, x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert set(custom_ops) <= seen, seen
    torch.testing.assert_close(got[0], ref[0], rtol=rtol, atol=atol)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    torch.testing.assert_close(got[2], ref[2], rtol=rtol, atol=atol)
    for name, g in ref[3].items():
        assert (g is None) == (got[3][name] is None), name
        if g is not None:
            torch.testing.assert_close(got[3][name], g, rtol=rtol, atol=atol, msg=name)
    return compiled


def assert_exports_dynamic(layer, device="cpu"):
    """torch.export.export of the layer in eval with the batch and sequence dims dynamic (traced at 3 x 7):
    the exported program equals eager at other shapes, fewer tokens than experts and one token included.
    Its checks of int arguments took the symbolic sizes for a wrong type (2026-12-07)."""
    layer = layer.eval()
    dtype = next(layer.parameters()).dtype
    dims = {0: torch.export.Dim("B", max=64), 1: torch.export.Dim("T", max=4096)}
    program = torch.export.export(layer, (torch.randn(3, 7, 12, device=device, dtype=dtype), ),
                                  dynamic_shapes={"x": dims}).module()
    for shape in ((3, 7), (2, 13), (1, 2), (5, 1)):
        x = torch.randn(*shape, 12, device=device, dtype=dtype)
        for got, want in zip(program(x), layer(x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)

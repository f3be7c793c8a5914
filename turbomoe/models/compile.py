"""torch.compile of the model's blocks in place: the dense blocks (each layer's attention half:
the layer before's MLP output added to the residual stream, input norm, q/k/v projections, per-head
q/k RMSNorm, rotary, scaled_dot_product_attention, o_proj, the residual add and the norm after it;
the dense SwiGLU MLPs; the final norm, with the last MLP output's add) and, as an option,
the MoE blocks (turbomoe's DeepSpeed layer at ep_size 1, one graph each through turbomoe's custom
ops: notes/compile.md), whose eager step is mostly host time at small shapes.

Compiled in place (nn.Module.compile, or a layer's attention_half method replaced by its compiled
self), so parameter names, state dicts and DeepSpeed's hooks stay as they are. Measured on an H100
at small-1gpu's shapes (notes/recipe_profile.md): inductor fuses the attention input path (norms,
rotary, casts) to 0.37x of eager and RMSNorm to 0.70x, ahead of liger-kernel's ops (0.59x, 0.77x),
so compile is the choice; compiling the attention half whole also fuses the residual adds into the
norms after them (forward) and the residual's gradient into the norms' (backward).
"""
import types

import torch

from .qwen3_moe import Qwen3MoeForCausalLM


def dense_blocks(model: Qwen3MoeForCausalLM):
    """What compile_dense_blocks compiles, in model order: (module, method name)."""
    for layer in model.model.layers:
        yield layer, "attention_half"
        if not layer.is_moe:
            yield layer.mlp, "forward"
    yield model.model.norm, "forward"


def compile_dense_blocks(model: Qwen3MoeForCausalLM, **compile_kwargs) -> Qwen3MoeForCausalLM:
    """Compile every dense block of model in place (torch.compile's keyword arguments, e.g.
    backend="aot_eager", pass through); returns model. All layers share one graph per block kind:
    dynamo caches by code object and treats the modules' parameters as graph inputs (it inlines
    nn.Modules), so depth adds no recompiles."""
    for module, method in dense_blocks(model):
        if method == "forward":
            module.compile(**compile_kwargs)
        else:  # an instance attribute over the class's method: only this model is compiled. The compiled
            # function bound as a method, not the compiled bound method: a deepcopy of the model then
            # binds its own layer (the compiled bound method kept calling the original's).
            setattr(module, method, types.MethodType(torch.compile(getattr(type(module), method), **compile_kwargs),
                                                     module))
    return model


def moe_blocks(model: Qwen3MoeForCausalLM):
    """The MoE blocks, in model order."""
    for layer in model.model.layers:
        if layer.is_moe:
            yield layer.mlp


def compile_moe_blocks(model: Qwen3MoeForCausalLM, **compile_kwargs) -> Qwen3MoeForCausalLM:
    """Compile every MoE block of model in place, fullgraph unless told otherwise (a graph break
    is an error, not a silent fallback to eager); returns model."""
    for module in moe_blocks(model):
        module.compile(**{"fullgraph": True, **compile_kwargs})
    return model

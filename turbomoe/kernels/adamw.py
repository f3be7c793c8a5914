"""One pass of AdamW over a flat fp32 master buffer that also writes its 16-bit copy and clears the
gradient: what a bf16 step with fp32 master weights needs, in one read of p, g, m, v per element.

torch's fused AdamW reads p, g, m, v and writes p, m, v (and g, unscaled, when given a grad_scale);
the bf16 copy of the weights and the zeroing of the fp32 gradients then take two more passes (a
read of p, writes of the copy and of g). Here those writes ride in the same pass: 34 bytes an
element instead of 42 (small-1gpu: 0.36B parameters a step).

The update is torch's AdamW (decoupled weight decay, torch.optim.AdamW's formula and order):
    g = g / grad_scale;  p -= lr * wd * p
    m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
in fp32 (fp64 for fp64 buffers; the bias corrections in fp64, as torch's), with t the step count
read from the device, so that a skipped step (found_inf) needs no host sync. Not torch's bits: its
kernel also forms the products with the hyperparameters in fp64.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_WARPS = 8


@triton.jit
def _bias_corrections(step, c1, c2):
    """1 - beta1^t and 1 - beta2^t in fp64 for the integer step count t (as torch forms them, in
    double), by squaring: no pow or exp2 (the GPU runs fp32 exp2 and log2 as approximate
    instructions, and fp64 ones need libdevice, which the interpreter lacks). c = 1 - beta."""
    k = step.to(tl.int64)
    zero = tl.zeros_like(step).to(tl.float64)
    b1, b2 = 1.0 - (zero + c1), 1.0 - (zero + c2)
    p1, p2 = zero + 1.0, zero + 1.0
    for _ in tl.static_range(40):  # t < 2^40
        odd = (k % 2) == 1
        p1 = tl.where(odd, p1 * b1, p1)
        p2 = tl.where(odd, p2 * b2, p2)
        b1, b2, k = b1 * b1, b2 * b2, k // 2
    return 1.0 - p1, 1.0 - p2


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, lp_ptr, step_ptr, scale_ptr, inf_ptr, n, lr, c1, c2, eps, wd,
                  HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, HAS_LP: tl.constexpr, ZERO_GRAD: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    # every load issued before any store and no branch: a skipped step masks the stores instead
    update = ok
    if HAS_INF:  # (a bound, not ok & flag: the interpreter cannot AND a vector with a loaded scalar)
        update = offs < tl.where(tl.load(inf_ptr) == 0, n, 0)
    g_in = tl.load(g_ptr + offs, mask=ok, other=0.0, eviction_policy="evict_first")
    p = tl.load(p_ptr + offs, mask=ok, other=0.0, eviction_policy="evict_first")
    m = tl.load(m_ptr + offs, mask=ok, other=0.0, eviction_policy="evict_first")
    v = tl.load(v_ptr + offs, mask=ok, other=0.0, eviction_policy="evict_first")
    g = g_in
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(g.dtype)
    bias1, bias2 = _bias_corrections(tl.load(step_ptr), c1, c2)
    step_size = (lr / bias1).to(g.dtype)
    bias2_sqrt = tl.sqrt(bias2).to(g.dtype)
    p = p - lr * wd * p
    m = (1.0 - c1) * m + c1 * g
    v = (1.0 - c2) * v + c2 * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    if ZERO_GRAD:
        # zeros computed from the loaded gradient, not a constant tile: the compiler may give a constant
        # another thread layout than the load's (to suit the 16-bit store), and a thread then cleared
        # elements before the thread loading them had read them (seen on an H100: a few elements a
        # step updated as if their gradient were 0). From the loaded values, the store waits for them.
        tl.store(g_ptr + offs, tl.where(g_in == 0.0, g_in, 0.0), mask=ok)
    tl.store(p_ptr + offs, p, mask=update)
    tl.store(m_ptr + offs, m, mask=update)
    tl.store(v_ptr + offs, v, mask=update)
    if HAS_LP:
        tl.store(lp_ptr + offs, p.to(lp_ptr.dtype.element_ty), mask=update)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None,
               param_lp: Optional[torch.Tensor] = None, zero_grad: bool = False) -> None:
    """AdamW on contiguous fp32 or fp64 buffers of one numel, in place (see the module doc). step: a
    one-element float tensor on the device holding this step's count (already advanced); grad_scale:
    divides the gradient (clipping's coefficient); found_inf: one element, nonzero skips the update
    (param, moments and param_lp unchanged; the gradient is still cleared with zero_grad); param_lp:
    the fp16 or bf16 copy of param, written from the updated value; zero_grad: clear grad."""
    n = param.numel()
    tensors = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param_lp is not None:
        tensors["param_lp"] = param_lp
    for name, t in {"param": param, **tensors}.items():
        if t.numel() != n or t.device != param.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous with param's numel {n} on {param.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    # the math is fp32 or fp64 (16-bit masters failed to compile, integer ones ran), and the copy a cast
    # to param_lp's dtype (an int8 one got integers)
    if param.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"param must be float32 or float64, got {param.dtype}")
    if param_lp is not None and param_lp.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"param_lp must be float16 or bfloat16, got {param_lp.dtype}")
    for name, t in tensors.items():
        if name != "param_lp" and t.dtype != param.dtype:
            raise TypeError(f"{name} must share param's dtype {param.dtype}, got {t.dtype}")
    for name, t in (("step", step), ("grad_scale", grad_scale), ("found_inf", found_inf)):
        if t is not None and (t.numel() != 1 or t.device != param.device):
            raise ValueError(f"{name} must be one element on {param.device}, got {tuple(t.shape)} on {t.device}")
    if n == 0:
        return
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, param_lp if param_lp is not None else param, step,
        grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step,
        # 1 - beta formed here in double: the kernel's scalars are fp32, and 1 - fp32(0.999) is 1.3e-5 off
        n, float(lr), 1.0 - float(beta1), 1.0 - float(beta2), float(eps), float(weight_decay),
        HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None, HAS_LP=param_lp is not None,
        ZERO_GRAD=zero_grad, BLOCK=_BLOCK, num_warps=_WARPS)

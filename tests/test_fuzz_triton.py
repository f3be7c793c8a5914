"""Differential fuzz of the Triton backend against the reference (the spec, turbomoe/reference.py),
forward and backward, on edge inputs the other tests do not reach: exact ties (all equal, integer
grids, subnormal steps, saturated sigmoids), selection biases that tie at +-inf, non-contiguous
inputs (transposed, strided), fp16 / bf16 / fp64, E not a power of two, k from 1 to min(E, 8),
capacity 0, 1, above S and at the int32 bound, NaN / +-Inf scores on dropped routes, NaN kept
scores under renormalisation, huge and tiny magnitudes, and the grouped GEMM and SwiGLU kernels at
their edges (K = 0, N = 0, NaN rows past the counts; fp64, |values| ~ 1e30).

Every case is fixed (seeded); integer tables compare exactly, floats with NaN and +-Inf in the same
places and the finite rest within a norm-wise relative tolerance (fp32 1e-5). Runs natively on a
GPU; on the CPU under TRITON_INTERPRET=1 (set here where no GPU is, before turbomoe's kernels are
defined). Under the interpreter bf16 values stay normal: its bf16 -> fp32 cast drops subnormals,
and its fp32 -> bf16 cast truncates (a bf16 ulp, inside the bf16 tolerance).
"""
import os

import torch

if not torch.cuda.is_available():  # the interpreter is read when kernels are defined: before turbomoe
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from turbomoe import ops  # noqa: E402
from turbomoe import reference as ref  # noqa: E402
from turbomoe.autograd.grouped_gemm import grouped_mm  # noqa: E402
from turbomoe.autograd.swiglu import SwiGLU, swiglu_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The row kernels' backends; the CUDA one where the GPU machine built it (its gather shares the rules).
ROW_BACKENDS = ["triton"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
NAN, INF = float("nan"), float("inf")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
LOW = (torch.float16, torch.bfloat16)


def assert_same(name, got, want, tol, floor=1e-30):
    """NaN and +-Inf in the same places, the finite rest within tol (norm-wise relative; absolute
    below a norm of floor: 1 for score gradients, where a renormalised lone route's is 0 exactly in
    the kernels and ~1e-16 in the reference's autograd)."""
    assert got is not None and want is not None, name
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (name, got.shape, want.shape)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{name}: NaN at {int(got.isnan().sum())} places, want {int(nan.sum())}"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), f"{name}: Inf differs"
    fin = want.isfinite()
    diff, scale = (got[fin] - want[fin]).norm().item(), want[fin].norm().item()
    assert diff <= tol * max(scale, floor), f"{name}: relative error {diff / max(scale, floor):.3g} > {tol}"


def layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """A fresh leaf copy of t with the same values: contiguous, transposed storage, or rows strided."""
    t = t.detach().to(DEV)
    if how == "T":
        return t.t().contiguous().t()
    if how == "strided":
        wide = torch.zeros(t.shape[0], 2 * t.shape[1] + 1, dtype=t.dtype, device=DEV)
        wide[:, 1::2] = t
        return wide[:, 1::2]
    return t.clone()


# ------------------------------------------------------------------------------------------ gating

def logits_case(name: str, S: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """[S, E] fp32 logits of one edge kind; exact ties stay exact ties in every compute dtype."""
    if name == "all_equal":
        return torch.full((S, E), 7.0)
    if name == "int_ties":  # few distinct values: many equal probabilities per row
        return torch.randint(-2, 3, (S, E), generator=gen).float()
    if name == "subnormal_steps":  # softmax rounds them all to 1 / E: ties to the lower id
        return torch.randint(-3, 4, (S, E), generator=gen).float() * 1e-40
    if name == "sat_sigmoid":  # sigmoid rounds to 1.0 or 1 - 2^-24 in fp32: ties among the saturated
        return 16.0 + torch.randint(0, 8, (S, E), generator=gen).float()
    if name == "one_hot":  # one expert takes every token, the others tie at ~0
        return torch.zeros(S, E).index_fill_(1, torch.tensor([E - 1]), 50.0)
    if name == "big":  # rounded to integers at scale 30: large gaps, some ties
        return torch.round(torch.randn(S, E, generator=gen) * 30)
    if name == "nonfinite_rows":  # rows route nowhere: NaN, +Inf, all -Inf, a finite row between
        t = torch.randn(S, E, generator=gen)
        t[0, 0], t[1, E - 1], t[3, :] = NAN, INF, -INF
        return t
    raise ValueError(name)


GATING_CASES = [("all_equal", 5, 6), ("int_ties", 9, 7), ("subnormal_steps", 4, 5), ("sat_sigmoid", 6, 12),
                ("one_hot", 7, 3), ("big", 3, 11), ("nonfinite_rows", 6, 9)]
DTYPE_LAYOUTS = [(torch.float32, "T"), (torch.float16, "strided"), (torch.bfloat16, "contiguous"),
                 (torch.float64, "T")]


def check_gating(logits, k, score_func, renormalize, bias=None, seed=0):
    """topk_gating on triton and on the reference (the same dtype and values, so exact ties are the
    same ties): ids and counts exactly, scores, aux, z and the logits' gradient within the tolerance."""
    dtype = logits.dtype
    gen = torch.Generator().manual_seed(seed)
    S = logits.shape[0]
    g_scores = torch.randn(S, k, generator=gen, dtype=torch.float64)
    g_aux, g_z = torch.randn(2, generator=gen, dtype=torch.float64)
    out = {}
    for backend in ("triton", "reference"):
        la = logits.detach().clone().requires_grad_() if backend == "reference" else logits.requires_grad_()
        g = ops.topk_gating(la, k, score_func, renormalize, bias, backend=backend)
        torch.autograd.backward([g.scores, g.aux_loss, g.z_loss],
                                [g_scores.to(g.scores), g_aux.to(g.aux_loss), g_z.to(g.z_loss)])
        out[backend] = (g, la.grad)
    (got, grad), (want, want_grad) = out["triton"], out["reference"]
    assert torch.equal(got.expert_ids.cpu(), want.expert_ids.cpu()), (got.expert_ids, want.expert_ids)
    assert torch.equal(got.counts.cpu(), want.counts.cpu())
    tol = 1e-5 if dtype != torch.float64 else 1e-12  # fp32 math for 16-bit logits
    for name, a, b in (("scores", got.scores, want.scores), ("aux", got.aux_loss, want.aux_loss),
                       ("z", got.z_loss, want.z_loss)):
        assert_same(name, a, b, tol)
    assert grad.dtype == dtype
    assert_same("grad logits", grad, want_grad, max(tol, TOL[dtype]))


@pytest.mark.parametrize("dtype,how", DTYPE_LAYOUTS)
@pytest.mark.parametrize("name,S,E", GATING_CASES)
def test_gating_edge_logits(name, S, E, dtype, how):
    """Exact ties go to the lower expert id on both backends for every k (the kernel's top-k masks
    chosen experts, the reference sorts stably), scores, losses and gradients equal, whatever the
    logits' layout and dtype."""
    if dtype == torch.bfloat16 and name == "subnormal_steps":
        pytest.skip("the interpreter's bf16 cast drops subnormals (a GPU keeps them)")
    gen = torch.Generator().manual_seed(S * 100 + E)
    logits = layout(logits_case(name, S, E, gen).to(dtype), how)
    for k in sorted({1, min(E, 8)}):
        for score_func, renorm in (("softmax", False), ("sigmoid", True), ("softmax", True)):
            check_gating(layout(logits, how), k, score_func, renorm, seed=k)


@pytest.mark.parametrize("bias", [[INF, 0.0, INF, 0.0, INF], [-INF, -INF, 0.0, -INF, 0.5], [0.25] * 5,
                                  [NAN, INF, -INF, NAN, 0.0]])
def test_gating_bias_ties(bias):
    """Selection values tied at +-inf or by an equal bias (and NaN, ranked -inf, tied with -inf):
    the lower expert id first for every k up to E, the scores the probabilities (the bias steers
    only the choice), gradients equal; an fp16 bias with fp32 logits."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(-1, 2, (6, 5), generator=gen).float().to(DEV)
    bias_E = torch.tensor(bias, device=DEV)
    for k in range(1, 6):
        check_gating(logits.clone(), k, "softmax", k % 2 == 0, bias_E, seed=k)
        check_gating(logits.clone(), k, "sigmoid", k % 2 == 1, bias_E.half(), seed=k)


# ----------------------------------------------------------------------------------- assign_slots

def id_table(kind: str, S: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "distinct":
        rows = [torch.randperm(E, generator=gen)[:k] for _ in range(S)]
        return torch.stack(rows) if S else torch.zeros(0, k, dtype=torch.int64)
    if kind == "hot":  # choice j of every token goes to expert j: expert 0 takes every first choice
        return torch.zeros(S, k, dtype=torch.int64) + torch.arange(k)
    if kind == "out_of_range":  # -2, -1, E, E + 1 route nowhere; int64 ids at 2^31 and 2^32 + 1 too
        t = torch.randint(-2, E + 2, (S, k), generator=gen)
        if S:
            t[0, 0], t[-1, -1] = 2**31, 2**32 + 1
        return t
    raise ValueError(kind)


def score_table(kind: str, S: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # a coarse grid: the probs policy keeps the earlier of equal scores
        return torch.randint(0, 3, (S, k), generator=gen).float() / 2
    t = torch.rand(S, k, generator=gen)
    if S * k:  # NaN ranks -inf, -0.0 equals +0.0; subnormal and huge magnitudes keep their order
        special = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 1e-40, -1e-40, 3e38])
        at = torch.randint(0, S * k, (max(1, S * k // 3), ), generator=gen)
        t.view(-1)[at] = special[torch.randint(0, len(special), (len(at), ), generator=gen)]
    return t


SLOT_SHAPES = [(0, 3, 2), (1, 1, 1), (3, 7, 7), (5, 12, 8), (17, 6, 3), (64, 3, 2)]


@pytest.mark.parametrize("S,E,k", SLOT_SHAPES)
def test_assign_slots_edges(S, E, k):
    """Every policy and capacity (0, 1, tight, above S * k, the largest int32 layout E * C allows),
    ids out of range (int64 at 2^31 and above), ties and NaN / +-Inf / -0.0 / subnormal / huge
    probs scores in fp32, fp16 and fp64, transposed tables, negative and 64-bit seeds: the same
    slots and kept counts exactly."""
    gen = torch.Generator().manual_seed(S * 31 + E * 7 + k)
    capacities = [None, 0, 1, max(1, S * k // E), S * k + 3, (2**31 - 1) // E]
    for i, (ids_kind, sc_kind) in enumerate([(a, b) for a in ("distinct", "hot", "out_of_range")
                                             for b in ("ties", "special")]):
        ids64 = id_table(ids_kind, S, E, k, gen)
        scores = score_table(sc_kind, S, k, gen)
        for j, C in enumerate(capacities):
            for policy in (("position", ) if C is None else ("position", "rts", "probs")):
                sc_dtype = (torch.float32, torch.float16, torch.float64)[(i + j) % 3]
                ids = ids64 if ids_kind == "out_of_range" or (i + j) % 2 else ids64.int()
                how = "T" if (i + j) % 2 else "contiguous"
                seed = (0, -5, 2**64 - 1, 2**40 + 3)[(i + j) % 4]
                got = ops.assign_slots(layout(ids, how), layout(scores.to(sc_dtype), how), E, C, policy, seed,
                                       backend="triton")
                want = ops.assign_slots(ids, scores.to(sc_dtype), E, C, policy, seed, backend="reference")
                case = (ids_kind, sc_kind, C, policy, sc_dtype)
                assert torch.equal(got.slots.cpu(), want.slots) and got.slots.dtype == torch.int32, case
                assert torch.equal(got.kept_counts.cpu(), want.kept_counts), case
                assert (got.num_rows, got.capacity) == (want.num_rows, want.capacity), case


# --------------------------------------------------------------------------- scatter, gather, rows

def run_rows(backend, x, y, scores, table, num_rows, renorm, g_buf, g_out, slots=None, g_w=None):
    """scatter, gather (and row_scores with a Slots) forward and backward -> outputs and gradients."""
    x, y, scores = (t.detach().clone().requires_grad_() for t in (x, y, scores))
    buf = ops.scatter_tokens(x, table, num_rows, backend=backend)
    buf.backward(g_buf)
    out = ops.gather_tokens(y, table, scores, renormalize=renorm, backend=backend)
    out.backward(g_out)
    res = {"buf": buf, "grad x": x.grad, "out": out, "grad y": y.grad, "grad scores": scores.grad}
    if slots is not None:
        s = scores.detach().clone().requires_grad_()
        w = ops.row_scores(slots, s, backend=backend)
        w.backward(g_w)
        res.update({"row scores": w, "grad row scores": s.grad})
    return res


def on_cpu(table):
    """A Slots or a bare table, on the CPU (the reference's inputs)."""
    if isinstance(table, ref.Slots):
        return table._replace(slots=table.slots.cpu(), kept_counts=table.kept_counts.cpu())
    return table.cpu()


def compare_rows(x, y, scores, slots, table, num_rows, renorm, dtype, gen):
    """Triton on the inputs as given (any layout), the reference on contiguous fp32 copies of 16-bit
    ones (its scatter backward accumulates in the tokens' dtype, the kernels in fp32 as documented),
    rounded back to the dtype."""
    S, M = x.shape
    g_buf = torch.randn(max(num_rows, 0), M, generator=gen).to(dtype)
    g_out = torch.randn(S, M, generator=gen)
    if g_out.numel():  # NaN / Inf in the gradient of tokens with dropped routes
        g_out.view(-1)[torch.randint(0, g_out.numel(), (3, ), generator=gen)] = torch.tensor([NAN, INF, -INF])
    g_out = g_out.to(dtype)
    g_w = torch.randn(num_rows, generator=gen).to(scores.dtype)
    up = (lambda t: t.float()) if dtype in LOW else (lambda t: t)
    got = run_rows("triton", x, y, scores, table, num_rows, renorm, g_buf.to(DEV), g_out.to(DEV),
                   slots, g_w.to(DEV))
    want = run_rows("reference", up(x.cpu().contiguous()), up(y.cpu().contiguous()), scores.cpu().contiguous(),
                    on_cpu(table), num_rows, renorm, up(g_buf), up(g_out), None if slots is None else on_cpu(slots),
                    g_w)
    for name in got:
        w = want[name]
        w = w.to(scores.dtype) if "scores" in name else w.to(dtype) if w.is_floating_point() else w
        assert_same(name, got[name], w, TOL[dtype] if "scores" not in name else max(TOL[dtype], 1e-5),
                    1.0 if name == "grad scores" else 1e-30)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("S,E,k,M,C", [(0, 4, 2, 3, 2), (1, 1, 1, 1, None), (7, 3, 2, 5, 0), (9, 5, 3, 17, 1),
                                       (12, 7, 4, 8, 100), (33, 2, 2, 3, None)])
def test_rows_edges(S, E, k, M, C, dtype):
    """scatter, gather (plain and renormalised) and row_scores from a Slots and from bare int32 /
    int64 tables with entries out of range, on transposed and strided tokens, buffers and scores,
    NaN / Inf tokens, |x| ~ 1e30 (6e4 in fp16): equal to the reference, forward and backward."""
    gen = torch.Generator().manual_seed(S * 13 + E + k + M)
    logits = torch.randn(S, E, generator=gen)
    logits[: S // 2, 0] += 30  # one expert over any capacity
    g = ref.topk_gating(logits, k)
    slots = ref.assign_slots(g.expert_ids, g.scores, E, C, "probs")
    big = 6e4 if dtype == torch.float16 else 1e30 if dtype != torch.bfloat16 else 1e20
    x = torch.randn(S, M, generator=gen) * torch.tensor([1.0, big])[torch.arange(S) % 2, None]
    if S > 2:
        x[2, 0] = NAN
    y = torch.randn(slots.num_rows, M, generator=gen)
    for i, (table_kind, how, renorm) in enumerate([("slots", "T", False), ("int32", "strided", True),
                                                   ("int64", "contiguous", False), ("slots", "strided", True)]):
        table, nr = slots, None
        if table_kind != "slots":
            table = slots.slots.to(torch.int64 if table_kind == "int64" else torch.int32).clone()
            if (table < 0).any():  # a dropped route named by a row far out of range instead of -1
                far = 2**32 + 3 if table_kind == "int64" else slots.num_rows + 5
                table[tuple((table < 0).nonzero()[0])] = far
            table, nr = table.to(DEV), slots.num_rows
        else:
            table = slots._replace(slots=slots.slots.to(DEV), kept_counts=slots.kept_counts.to(DEV))
        compare_rows(layout(x.to(dtype), how), layout(y.to(dtype), how), layout(g.scores, how),
                     table if table_kind == "slots" else None, table, slots.num_rows if nr is None else nr,
                     renorm, dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("row_backend", ROW_BACKENDS)
def test_gather_ignores_scores_of_dropped_routes(renorm, dtype, row_backend):
    """A route that routes nowhere (dropped: -1, an entry past the buffer, or the probs policy's NaN
    scores, dropped first) adds nothing to gather's output and gets no score gradient, whatever its
    score and the output gradient hold: the reference's torch.where. The Triton gather multiplied
    the zero of the unread row by the score (0 x NaN and 0 x Inf = NaN: whole output rows NaN), and
    its backward took <grad_out, 0> for the dropped score (NaN where grad_out held NaN or Inf)."""
    E, M = 3, 6
    ids = torch.tensor([[0, 1], [1, 0], [2, 1], [0, 2], [0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(21)
    for table_kind in ("probs", "bare"):
        scores = torch.tensor([[0.5, NAN], [0.25, INF], [-INF, 0.75], [NAN, NAN], [0.4, 0.1], [NAN, 0.3], [0.2, 0.6]])
        if table_kind == "probs":  # capacity 1: NaN and -inf dropped first; each expert keeps a finite score
            scores[1, 1] = -INF
            slots = ops.assign_slots(ids, scores, E, 1, "probs", backend="reference")
            table, num_rows = slots.slots, slots.num_rows
        else:  # a bare table: the non-finite scores sit on -1 and out-of-range entries
            table = torch.tensor([[0, -1], [1, 99], [-1, 2], [-1, -1], [3, 4], [-7, 5], [6, 7]], dtype=torch.int32)
            num_rows = 8
        dropped = ~((table >= 0) & (table < num_rows))
        assert bool((scores.isnan() | scores.isinf())[~dropped].sum() == 0)  # only dropped routes are non-finite
        y = torch.randn(num_rows, M, generator=gen).to(dtype)
        g_out = torch.randn(len(ids), M, generator=gen)
        g_out[1, 2], g_out[3, 0], g_out[5, 4] = NAN, INF, -INF
        g_out = g_out.to(dtype)
        res = {}
        for backend in (row_backend, "reference"):
            # copy=True: on the CPU .to() is y itself, and both backends' gradients would add into one .grad
            ya = y.to(DEV, copy=True).requires_grad_()
            sa = scores.to(DEV, copy=True).requires_grad_()
            out = ops.gather_tokens(ya, table.to(DEV), sa, renormalize=renorm, backend=backend)
            out.backward(g_out.to(DEV))
            res[backend] = (out, ya.grad, sa.grad)
        (out, gy, gs), (want_out, want_gy, want_gs) = res[row_backend], res["reference"]
        assert torch.isfinite(out).all(), table_kind  # every kept score is finite
        assert (gs.cpu()[dropped] == 0).all(), table_kind
        for name, a, b in (("out", out, want_out), ("grad y", gy, want_gy), ("grad scores", gs, want_gs)):
            if name == "grad scores":
                assert_same(f"{table_kind} {name}", a, b, max(TOL[dtype], 1e-5), floor=1.0)
            else:
                assert_same(f"{table_kind} {name}", a, b, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("row_backend", ROW_BACKENDS)
def test_gather_renormalize_non_finite_kept_scores(dtype, row_backend):
    """Renormalised weights p / max(sum p, eps) (reference.renormalize_kept's clamp_min): a NaN in a
    token's kept scores makes the sum NaN, which clamp_min keeps, so every weight and gradient of
    that token is NaN; an Inf sum gives Inf / Inf = NaN for the Inf score and 0 for the others; a
    -Inf sum clamps to eps. The Triton kernel took a NaN sum for one below eps (finite weights
    p / eps, score gradients ~1.7e7 where the reference's are NaN)."""
    scores = torch.tensor([[NAN, 0.5, 0.25], [INF, 0.5, 0.1], [-INF, 0.5, 0.2], [0.3, 0.2, 0.5], [1e-9, 2e-9, 0.0],
                           [NAN, 0.3, 0.4]], dtype=dtype)
    slots = torch.tensor([[0, 1, 2], [3, 4, -1], [5, 6, 7], [8, -1, 9], [10, 11, 12], [-1, 13, 14]],
                         dtype=torch.int32)  # the last token's NaN is dropped: finite
    gen = torch.Generator().manual_seed(22)
    y = torch.randn(15, 4, generator=gen, dtype=dtype)
    g_out = torch.randn(6, 4, generator=gen, dtype=dtype)
    res = {}
    for backend in (row_backend, "reference"):
        ya, sa = y.to(DEV, copy=True).requires_grad_(), scores.to(DEV, copy=True).requires_grad_()
        out = ops.gather_tokens(ya, slots.to(DEV), sa, renormalize=True, backend=backend)
        out.backward(g_out.to(DEV))
        res[backend] = (out, ya.grad, sa.grad)
    (out, gy, gs), (want_out, want_gy, want_gs) = res[row_backend], res["reference"]
    assert want_gs[0].isnan().all() and want_gy[:3].isnan().all()  # the spec's NaN token
    assert torch.isfinite(want_gs[5]).all() and torch.isfinite(want_out[5]).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for name, a, b in (("out", out, want_out), ("grad y", gy, want_gy), ("grad scores", gs, want_gs)):
        assert_same(name, a, b, tol, floor=1.0 if name == "grad scores" else 1e-30)


# ------------------------------------------------------------------------------ grouped GEMM, SwiGLU

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("R,K,N,counts", [(6, 0, 4, [2, 4]), (6, 4, 0, [3, 3]), (20, 6, 5, [0, 7, 1, 0, 9]),
                                          (9, 17, 18, [3, 9]), (1, 1, 1, [1]), (33, 16, 16, [33])])
def test_grouped_mm_edges(R, K, N, counts, dtype):
    """K = 0 and N = 0, empty groups, one group holding every row, counts summing past R (the last
    group truncated at R), NaN in x and dy past the counts (never read), a transposed x and a
    strided w: the Triton grouped GEMM equals the reference's loop on the counted rows, both ways."""
    gen = torch.Generator().manual_seed(R * 7 + K + N)
    c = torch.tensor(counts, dtype=torch.int32)
    used = min(R, int(c.sum()))
    x = torch.randn(R, K, generator=gen)
    dy = torch.randn(R, N, generator=gen)
    x[used:], dy[used:] = NAN, NAN
    w = torch.randn(len(counts), K, N, generator=gen)
    res = {}
    for backend in ("triton", "reference"):
        cast = (lambda t: t.to(dtype)) if backend == "triton" else (lambda t: t.to(dtype).float())
        xa = layout(cast(x), "T").requires_grad_()
        wa = torch.cat([cast(w), torch.zeros(len(counts), K, 3, dtype=cast(w).dtype)], 2)[..., :N].to(DEV)
        wa = wa.detach().requires_grad_()
        y = grouped_mm(xa, wa, c.to(DEV), backend=backend)
        (y[:used] * cast(dy).to(DEV)[:used]).sum().backward()
        res[backend] = (y[:used], xa.grad[:used], wa.grad)
    for name, a, b in zip(("y", "grad x", "grad w"), res["triton"], res["reference"]):
        assert_same(name, a, b.to(dtype), TOL[dtype])


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("R,F", [(3, 7), (2, 1030)])
def test_swiglu_fp64_and_huge(R, F, scaled):
    """The SwiGLU kernels (the autograd Function the layer runs on a GPU) against swiglu_reference:
    fp64 in fp64 (the reference's "fp64 for fp64, as the kernel does"; the kernels computed fp32:
    1e-8 off), and fp32 at |values| ~ 1e30 with gate = -1e30, where silu is -0: the gradient of up
    is da * silu = 0 (the kernel formed (da * gate) * sig, which overflows: Inf x 0 = NaN)."""
    gen = torch.Generator().manual_seed(R * 31 + F)
    for dtype in (torch.float64, torch.float32):
        h = torch.randn(R, 2 * F, generator=gen, dtype=torch.float64) * 3
        da = torch.randn(R, F, generator=gen, dtype=torch.float64)
        if dtype == torch.float32:  # huge gates and gradients, both signs, and infinities in up
            h[:, :F:3], da[:, ::3] = -1e30, 1e30
            h[:, 1:F:3], da[:, 1::3] = 1e30, -1e30
            h[0, F + 1] = INF
        s = torch.rand(R, generator=gen, dtype=torch.float64) - 0.25
        res = {}
        for backend in ("kernel", "reference"):
            ha = h.to(DEV, dtype, copy=True).requires_grad_()  # a leaf of its own per backend
            sa = s.to(DEV, dtype, copy=True).requires_grad_() if scaled else None
            a = SwiGLU.apply(ha, sa) if backend == "kernel" else swiglu_reference(ha, sa)
            a.backward(da.to(DEV, dtype))
            res[backend] = (a, ha.grad) + ((sa.grad, ) if scaled else ())
        for name, a, b in zip(("a", "grad h", "grad scale"), res["kernel"], res["reference"]):
            assert_same(f"{dtype} {name}", a, b, TOL[dtype])

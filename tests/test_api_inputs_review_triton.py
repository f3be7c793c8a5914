"""Review of the public functions' handling of bad or unusual input (2026-12-06): wrong dtypes, numpy
and float ints, odd layouts (transposed, expanded, overlapping), zero-size dims, non-finite values,
non-bool flags, and the inference and export entry points. The tests under "Faults" failed before their
fixes (a negative expert count written out of bounds, export(force="no") replacing OUT, unchecked flags
and dtypes, errors naming no argument); the others record what was checked and held.

Runs the Triton kernels in-process (natively on a GPU; on the CPU under TRITON_INTERPRET=1, set here
where no GPU is, before turbomoe's kernels are defined). The grouped GEMM's negative-counts case runs
in a subprocess: under the interpreter it wrote outside its output and corrupted the heap."""
import os
import subprocess
import sys
import textwrap

import torch

if not torch.cuda.is_available():  # the interpreter is read when kernels are defined: before turbomoe
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from turbomoe import ops  # noqa: E402
from turbomoe import reference as ref  # noqa: E402
from turbomoe.inference import SparseMoE  # noqa: E402
from turbomoe.nn import GroupedExperts, MoELayer, TopKRouter  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------
# What held: argument kinds and dtypes refused with errors naming the argument (beyond test_errors.py)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_numpy_and_float_ints_are_refused_naming_the_argument(backend):
    logits = torch.randn(6, 4, generator=_gen(0)).to(DEV)
    ids = torch.randint(0, 4, (6, 2), generator=_gen(1), dtype=torch.int32).to(DEV)
    scores = torch.rand(6, 2, generator=_gen(2)).to(DEV)
    for k in (np.int64(2), 2.0, torch.tensor(2)):
        with pytest.raises(ValueError, match="k must be"):
            ops.topk_gating(logits, k, backend=backend)
    with pytest.raises(TypeError, match="num_experts"):
        ops.assign_slots(ids, scores, np.int64(4), backend=backend)
    with pytest.raises(TypeError, match="capacity"):
        ops.assign_slots(ids, scores, 4, capacity=np.int32(2), backend=backend)
    with pytest.raises(TypeError, match="seed"):
        ops.assign_slots(ids, scores, 4, 2, "rts", seed=np.int64(3), backend=backend)
    with pytest.raises(TypeError, match="num_rows"):
        ops.scatter_tokens(torch.randn(6, 3, device=DEV), ids, np.int64(8), backend=backend)
    with pytest.raises(TypeError, match="capacity_factor"):
        ops.capacity(16, 4, 1, np.float32(1.0))
    with pytest.raises(TypeError, match="num_tokens"):
        ops.capacity(np.int64(16), 4, 1, 1.0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_complex_and_bool_tensors_are_refused(backend):
    logits = torch.randn(6, 4, generator=_gen(0)).to(DEV)
    for bad in (logits.to(torch.complex64), logits > 0):
        with pytest.raises(TypeError, match="logits must be a float"):
            ops.topk_gating(bad, 2, backend=backend)
    with pytest.raises(TypeError, match="selection_bias must be a float"):
        ops.topk_gating(logits, 2, selection_bias_E=torch.zeros(4, dtype=torch.int32, device=DEV), backend=backend)
    with pytest.raises(ValueError, match="selection_bias must be 1-D"):
        ops.topk_gating(logits, 2, selection_bias_E=torch.zeros(1, 4, device=DEV), backend=backend)
    slots = torch.tensor([[0], [1]], dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="x must be a float"):
        ops.scatter_tokens(torch.ones(2, 3, dtype=torch.complex64, device=DEV), slots, 2, backend=backend)
    with pytest.raises(TypeError, match="scores must be a float"):
        ops.gather_tokens(torch.ones(2, 3, device=DEV), slots, torch.ones(2, 1, dtype=torch.bool, device=DEV),
                          backend=backend)
    with pytest.raises(TypeError, match="expert_ids must be an int32 or int64"):
        ops.assign_slots(slots.to(torch.uint8), torch.rand(2, 1, device=DEV), 2, backend=backend)
    with pytest.raises(TypeError, match="row_scores needs the Slots"):
        ops.row_scores(slots, torch.rand(2, 1, device=DEV))


def test_layer_and_inference_arguments_refused_naming_the_argument():
    base = dict(hidden_size=8, ffn_hidden_size=12, num_experts=4, k=2)
    for kw, error, match in ((dict(num_experts=np.int64(4)), TypeError, "num_experts"),
                             (dict(k=np.int64(2)), ValueError, "k must be"),
                             (dict(capacity_factor=np.float32(1.0)), TypeError, "capacity_factor"),
                             (dict(router_dtype="float32"), TypeError, "router_dtype"),
                             (dict(fused_grad_accumulation="yes"), TypeError, "fused_grad_accumulation")):
        with pytest.raises(error, match=match):
            MoELayer(**{**base, **kw})
    layer = MoELayer(**base)
    for x, error, match in ((torch.ones(5, 8, dtype=torch.int64), TypeError, "floating-point"),
                            (torch.ones(5, 8, dtype=torch.complex64), TypeError, "floating-point"),
                            (torch.ones(5, 8, dtype=torch.float64), TypeError, "parameters are torch.float32"),
                            (torch.tensor(1.0), ValueError, r"x must be \[\.\.\., 8\]")):
        with pytest.raises(error, match=match):
            layer(x)
    experts = GroupedExperts(4, 8, 12)
    x = torch.randn(5, 8, generator=_gen(0))
    for counts in (torch.tensor([2, 1, 1, 1]), torch.tensor([2., 1, 1, 1]), torch.tensor([2, 1, 1], dtype=torch.int32)):
        with pytest.raises(TypeError, match="counts must be an int32 tensor of shape"):
            experts(x, counts)
    router, w1, w2 = torch.randn(4, 8), torch.randn(4, 8, 12), torch.randn(4, 6, 8)
    with pytest.raises(ValueError, match="k must be an int in"):
        SparseMoE(router, w1, w2, np.int64(2))
    moe = SparseMoE(router, w1, w2, 2)
    with pytest.raises(ValueError, match="x is on meta"):
        moe(torch.randn(3, 8, device="meta"))
    with pytest.raises(ValueError, match="x is torch.int64"):
        moe(torch.ones(3, 8, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------------
# What held: the Triton kernels equal the reference on odd layouts, dtypes and zero-size inputs
# ---------------------------------------------------------------------------------------------------

def _layouts(S, M, dtype, seed):
    g = _gen(seed)
    return {"transposed": torch.randn(M, S, generator=g).to(dtype).t(),
            "expanded": torch.randn(1, M, generator=g).to(dtype).expand(S, M),
            "overlapping": torch.randn(S + M, generator=g).to(dtype).as_strided((S, M), (1, 1))}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_triton_equals_reference_on_odd_layouts(dtype):
    S, E, k, M = 7, 5, 2, 6
    for name, logits in _layouts(S, E, dtype, 0).items():
        logits = logits.to(DEV)
        got, want = ops.topk_gating(logits, k, backend="triton"), ref.topk_gating(logits.cpu(), k)
        assert torch.equal(got.expert_ids.cpu(), want.expert_ids), name
        assert torch.equal(got.counts.cpu(), want.counts), name
        torch.testing.assert_close(got.scores.cpu(), want.scores, rtol=1e-5, atol=1e-6)
    g = ref.topk_gating(torch.randn(S, E, generator=_gen(1)), k)
    ids_t = g.expert_ids.t().contiguous().t().to(DEV)  # transposed int32 ids
    for cap in (None, 1, 2):
        for policy in ("position", "rts", "probs"):
            got = ops.assign_slots(ids_t, g.scores.to(DEV), E, cap, policy, backend="triton")
            want = ref.assign_slots(g.expert_ids, g.scores, E, cap, policy)
            assert torch.equal(got.slots.cpu(), want.slots) and torch.equal(got.kept_counts.cpu(), want.kept_counts)
    s = ref.assign_slots(g.expert_ids, g.scores, E, capacity=2)
    s_dev = ref.Slots(s.slots.to(DEV), s.kept_counts.to(DEV), s.num_rows, s.capacity)
    for name, x in _layouts(S, M, dtype, 2).items():
        got = ops.scatter_tokens(x.to(DEV), s_dev, backend="triton")
        assert torch.equal(got.cpu(), ref.scatter_tokens(x, s.slots, s.num_rows)), name
    for name, y in _layouts(s.num_rows, M, dtype, 3).items():
        for scores in (g.scores.to(torch.float16), g.scores.double()):
            for renorm in (False, True):
                got = ops.gather_tokens(y.to(DEV), s_dev.slots, scores.to(DEV), renorm, backend="triton")
                want = ref.gather_tokens(y.double(), s.slots, scores.double(), renorm)
                torch.testing.assert_close(got.cpu().double(), want, rtol=2e-3, atol=2e-3)


def test_layer_on_expanded_input_and_under_no_grad_inference_mode():
    """An expanded (stride-0) x gives the contiguous copy's output and gradient; no_grad and
    inference_mode give the same output; a later training forward still works (expert_load)."""
    for backend in ("reference", "triton"):
        torch.manual_seed(0)
        layer = MoELayer(8, 12, 4, 2, capacity_factor=1.0, z_loss_coef=0.1, backend=backend,
                         gmm_backend=backend, device=DEV)
        row = torch.randn(1, 8, generator=_gen(1)).to(DEV)
        xa, xb = row.clone().requires_grad_(), row.clone().requires_grad_()
        out_a, aux_a = layer(xa.expand(6, 8))
        (out_a.square().sum() + aux_a).backward()
        out_b, aux_b = layer(xb.expand(6, 8).contiguous())
        (out_b.square().sum() + aux_b).backward()
        torch.testing.assert_close(out_a, out_b)
        torch.testing.assert_close(xa.grad, xb.grad)
        x = torch.randn(30, generator=_gen(2)).as_strided((6, 8), (3, 1)).to(DEV)
        want, _ = layer(x.contiguous())
        with torch.no_grad():
            got_ng, _ = layer(x)
        with torch.inference_mode():
            got_im, _ = layer(x)
        torch.testing.assert_close(got_ng, want)
        torch.testing.assert_close(got_im, want)
        again, _ = layer(x)
        torch.testing.assert_close(again, want)
        assert not layer.expert_load.is_inference()


def test_sparse_moe_dense_and_reference_modes_agree_on_non_finite_tokens():
    """A NaN / Inf token routes nowhere in both CPU modes (zero output), or takes the shared expert's
    NaN; the other tokens are unharmed."""
    g = _gen(0)
    router, w1, w2 = _sparse_weights()
    sw1, sw2 = torch.randn(8, 12, generator=g) * 0.3, torch.randn(6, 8, generator=g) * 0.3
    x = torch.randn(5, 8, generator=g)
    x[1, 2], x[3, 0] = float("nan"), float("inf")
    for shared in ({}, dict(shared_w1_MN=sw1, shared_w2_FM=sw2)):
        a = SparseMoE(router, w1, w2, 2, mode="reference", **shared)(x)
        b = SparseMoE(router, w1, w2, 2, mode="dense", dense_max=100, **shared)(x)
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-5, atol=1e-5)
        assert torch.isfinite(a[[0, 2, 4]]).all()
        if not shared:
            assert (a[[1, 3]] == 0).all()


# ---------------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------------

def test_sample_second_expert_checks_first_counts():
    logits = torch.randn(6, 4, generator=_gen(0))
    first = ops.topk_gating(logits[:, :1].contiguous(), 1)  # a top-1 gating of other logits: counts [1]
    with pytest.raises(ValueError, match="first"):
        out = ops.sample_second_expert(logits, first, torch.rand(6, 4, generator=_gen(1)))
        assert int(out.counts.sum()) == out.expert_ids.numel()  # the wrong result, if it returns


def test_sample_second_expert_first_must_be_a_gating_output():
    logits = torch.randn(6, 4, generator=_gen(0))
    with pytest.raises(TypeError, match="first"):
        ops.sample_second_expert(logits, tuple(ops.topk_gating(logits, 1)))


def test_capacity_fp32_flag_must_be_a_bool():
    assert ops.capacity(100, 8, 1, 1.2) == 15 and ops.capacity(100, 8, 1, 1.2, fp32=True) == 16
    with pytest.raises(TypeError, match="fp32"):
        ops.capacity(100, 8, 1, 1.2, fp32="no")


@pytest.mark.parametrize("args,name", [((16, 4, 1, 10**400), "capacity_factor"), ((10**400, 4, 1, 1.0), "num_tokens")])
def test_capacity_huge_int_arguments_name_the_argument(args, name):
    with pytest.raises((ValueError, TypeError), match=name):
        ops.capacity(*args)


def test_capacity_fp32_stays_within_the_int32_bound():
    try:
        C = ops.capacity(2**31 - 1, 1, 1, 1.0, fp32=True)
    except ValueError:
        return  # refused: fine
    assert C <= 2**31 - 1


def test_gather_tokens_device_error_names_y():
    slots = torch.tensor([[0], [1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="'y'"):
        ops.gather_tokens(torch.randn(2, 3, device="meta"), slots, torch.rand(2, 1, device="meta"))


def test_buffer_counts_needs_the_slots():
    s = ops.assign_slots(torch.zeros(3, 1, dtype=torch.int32), torch.rand(3, 1), 2, capacity=2)
    with pytest.raises(TypeError, match="Slots"):
        ops.buffer_counts(s.slots)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
@pytest.mark.parametrize("make", [lambda dt: MoELayer(8, 12, 4, 2, dtype=dt), lambda dt: TopKRouter(8, 4, 2, dtype=dt),
                                  lambda dt: GroupedExperts(4, 8, 12, dtype=dt)], ids=["MoELayer", "TopKRouter",
                                                                                      "GroupedExperts"])
def test_modules_refuse_a_non_float_dtype(make, dtype):
    with pytest.raises((TypeError, ValueError), match="dtype"):
        make(dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_router_forward_names_x_for_a_non_float_input(dtype):
    router = TopKRouter(8, 4, 2)
    with pytest.raises(TypeError, match=r"\bx\b"):
        router(torch.ones(5, 8, dtype=dtype))


def test_grouped_experts_refuse_negative_counts_reference():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 12, gmm_backend="reference")
    with pytest.raises(ValueError, match="counts"):
        experts(torch.randn(5, 8, generator=_gen(1)), torch.tensor([-1, 4, 1, 1], dtype=torch.int32))


def test_grouped_experts_refuse_negative_counts_triton():
    script = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from turbomoe.nn import GroupedExperts
        torch.manual_seed(0)
        experts = GroupedExperts(4, 8, 12, gmm_backend="triton")
        try:
            experts(torch.randn(5, 8), torch.tensor([-1, 4, 1, 1], dtype=torch.int32))
        except ValueError as e:
            print("REFUSED", e)
        else:
            print("RAN")
    """)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the interpreter on CPU tensors, also on a GPU machine
    try:  # about 2 s; a corrupted heap may also hang the process (seen once: cut at the timeout)
        run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=45)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung (corrupted heap)")
    assert run.returncode == 0 and "REFUSED" in run.stdout, (run.returncode, run.stdout, run.stderr[-500:])


def _sparse_weights():
    g = _gen(0)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, 12, generator=g) * 0.3, torch.randn(4, 6, 8, generator=g) * 0.3


@pytest.mark.parametrize("k,kw", [
    pytest.param(1, dict(prescale="no"), id="prescale"),
    pytest.param(2, dict(renormalize="yes"), id="renormalize"),
])
def test_sparse_moe_bool_flags_checked_when_made(k, kw):
    router, w1, w2 = _sparse_weights()
    name = next(iter(kw))
    try:
        moe = SparseMoE(router, w1, w2, k, **kw)
    except TypeError as e:
        assert name in str(e)
        return
    x = torch.randn(5, 8, generator=_gen(1))
    if name == "prescale":  # show what runs instead
        off = SparseMoE(router, w1, w2, 1, prescale=False)(x)
        assert torch.allclose(moe(x), off), "prescale='no' ran as prescale=True"
    pytest.fail(f"SparseMoE accepted {kw}")


def test_sparse_moe_w1_rank_error_names_w1():
    router, w1, w2 = _sparse_weights()
    with pytest.raises(ValueError, match="w1"):
        SparseMoE(router, w1[0], w2, 2)


def _tiny_model(vocab_size=50):
    from turbomoe.models import ModelConfig, Qwen3MoeForCausalLM
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2,
                      num_experts_per_tok=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return cfg, Qwen3MoeForCausalLM(cfg).eval()


def test_engine_keep_model_must_be_a_bool():
    from turbomoe.inference import Engine
    _, model = _tiny_model()
    try:
        Engine(model, max_batch=1, max_seq_len=8, keep_model="no")
    except (TypeError, ValueError) as e:
        assert "keep_model" in str(e)
        return
    assert type(model.model.layers[0].mlp).__name__ == "ExpertsMoved", "keep_model='no' kept the model's experts"


def _fake_run(root):
    """A complete one-rank checkpoint of a tiny model, as recipes/checkpointing.py lays it out."""
    from tiny_qwen3 import fake_run
    _, model = _tiny_model()
    run = os.path.join(root, "run")
    fake_run(run, model, step=1, data={"source": "megatron"})
    with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
        f.write("global_step1")
    return run


def test_export_force_must_be_a_bool(tmp_path):
    from turbomoe.export import export
    run = _fake_run(str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):  # the check this guards: no force, nothing replaced
        export(run, str(out), progress=False)
    try:
        export(run, str(out), force="no", progress=False)
    except (TypeError, ValueError, FileExistsError):
        pass
    assert (out / "keep.txt").exists(), f"force='no' replaced OUT: it now holds {sorted(os.listdir(out))}"


def test_generate_cli_seed_out_of_range_is_a_usage_error(tmp_path, capsys):
    pytest.importorskip("transformers")
    from turbomoe.data import ByteTokenizer
    from turbomoe.generate import main
    _, model = _tiny_model(vocab_size=257)
    path = str(tmp_path / "m")
    model.save_pretrained(path, tokenizer=ByteTokenizer())
    with pytest.raises(SystemExit) as e:
        main([path, "--prompt", "ab", "--max-new-tokens", "1", "--device", "cpu", "--seed", str(2**64)])
    assert e.value.code == 2 and "--seed" in capsys.readouterr().err



def test_more_experts_than_triton_serves(monkeypatch):
    """Triton's assign_slots holds 16 routes x E (a power of two) in one tile, at most 2**20 elements:
    above 65,536 experts it failed inside Triton. Chosen automatically, such an op now runs the
    reference; forced onto Triton, it is refused naming the bound."""
    from test_cuda_paths_review import _FakeCuda
    from turbomoe import csrc
    monkeypatch.delenv("TURBOMOE_BACKEND", raising=False)
    monkeypatch.setattr(csrc, "available", lambda: False)
    t = torch.zeros(2, 2).as_subclass(_FakeCuda)
    assert ops.choose_backend(t, None, ops.TRITON_MAX_EXPERTS) == "triton"
    assert ops.choose_backend(t, None, ops.TRITON_MAX_EXPERTS + 1) == "reference"
    with pytest.raises(ValueError, match="at most 65536 experts"):
        ops.assign_slots(torch.zeros(3, 1, dtype=torch.int32), torch.rand(3, 1), ops.TRITON_MAX_EXPERTS + 1,
                         backend="triton")

"""Code paths (not raises) that no CPU test executed, from a coverage.py run of the CPU suite (the
*_triton.py files under TRITON_INTERPRET=1 included), each driven through the API users call and
checked against an independent oracle: transformers, the parameter count of the built modules, a hand
computation, or the same call through a covered path that must agree.

Not a _triton file: no Triton interpreter; the reference / CPU paths only. Lines that run only on a GPU
(CUDA graphs, pinned host copies, the CUDA extension, a tune's cold-L2 timer, the Triton shuffle and
split router) are not tested here."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from tiny_qwen3 import TINY, fake_run, gen, hf_dir, tiny_model  # noqa: F401 (hf_dir: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest.one_thread


def params_of(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def same_params(a, b) -> bool:
    pa, pb = params_of(a), params_of(b)
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


# ----------------------------------------------------------------------------- turbomoe.inference


def test_sampling_arguments_as_tensors():
    """inference/sampling.py:49 (_number of a tensor that is not a 0-d real: None, so refused): a 0-d
    tensor is the number it holds (the same tokens as the float, same seed); a 1-element 1-D tensor, a
    bool tensor and a complex tensor are refused naming the argument, before the cache is made."""
    from turbomoe.inference import Engine
    engine = Engine(tiny_model(1), max_batch=2)
    ids = torch.randint(0, 64, (2, 3), generator=gen(2))
    kw = dict(do_sample=True, top_k=0)
    want = engine.generate(ids, 4, generator=gen(5), temperature=0.7, top_p=0.9, repetition_penalty=1.3, **kw)
    got = engine.generate(ids, 4, generator=gen(5), temperature=torch.tensor(0.7), top_p=torch.tensor(0.9),
                          repetition_penalty=torch.tensor(1.3), **kw)
    assert torch.equal(got, want)
    fresh = Engine(tiny_model(1), max_batch=2)
    for bad, message in [(dict(temperature=torch.tensor([0.7])), "sampling needs a finite temperature > 0"),
                         (dict(top_p=torch.tensor(True)), "sampling needs 0 < top_p <= 1"),
                         (dict(min_p=torch.tensor(0.1 + 0j)), "sampling needs 0 <= min_p <= 1"),
                         (dict(repetition_penalty=torch.ones(1, 1)), "repetition_penalty must be a finite number")]:
        with pytest.raises(ValueError, match=message):
            fresh.generate(ids, 2, generator=gen(5), **{**kw, **bad})
    assert fresh.cache is None


def test_tune_timer_out_of_resources_is_a_tiling_that_does_not_run():
    """inference/tiling.py:93-94: a timer that raises Triton's OutOfResources marks that tiling as not
    running (skipped), it does not escape; with every tiling so, the rule's own tiling does not run
    either: the RuntimeError that names it, and the layer's table as it was."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from turbomoe.inference import SparseMoE
    from turbomoe.inference.tiling import tune_few_rows
    from turbomoe.kernels.few_rows_gemm import Tiles
    g = gen(3)
    moe = SparseMoE(torch.randn(4, 16, generator=g), torch.randn(4, 16, 16, generator=g),
                    torch.randn(4, 8, 16, generator=g), 2)
    timed = []

    def timer(op, tiles, fn):
        timed.append((op, tiles))
        raise OutOfResources(1 << 20, 1 << 16, "shared memory")
    with pytest.raises(RuntimeError, match="the rule's own tiling of the first GEMM does not run at T = 2"):
        tune_few_rows(moe, [2], timer=timer, candidates=lambda T, K: [Tiles(2, 32, 1, 16, 4, 2, False, True),
                                                                      Tiles(2, 64, 1, 16, 4, 3, False, False)])
    assert len(timed) == 3 and all(op == "up" for op, _ in timed)  # the rule and both candidates tried, none kept
    assert moe.few_rows_tiles == {}


def test_auto_mode_rule_off_the_reference(monkeypatch):
    """inference/moe.py:166-169 (choose_mode off the reference backend; on a CPU only under the Triton
    interpreter, so the backend choice is stubbed here): 'dense' iff T <= dense_max and T * k >= E
    (moe.py's docstring); else few_rows only for CUDA tensors, so 'grouped' for CPU ones."""
    from turbomoe import ops
    from turbomoe.inference import SparseMoE
    g = gen(4)
    E, M, F_ = 8, 16, 8
    weights = (torch.randn(E, M, generator=g), torch.randn(E, M, 2 * F_, generator=g),
               torch.randn(E, F_, M, generator=g))
    moe = SparseMoE(*weights, 2, dense_max=4)
    default = SparseMoE(*weights, 2)
    assert moe.choose_mode(torch.zeros(4, M)) == "reference"  # the CPU's choice, unstubbed
    monkeypatch.setattr(ops, "choose_backend", lambda t, backend=None, num_experts=0: "triton")
    want = {1: "grouped", 3: "grouped", 4: "dense", 5: "grouped", 64: "grouped"}
    assert {T: moe.choose_mode(torch.zeros(T, M)) for T in want} == want
    assert {default.choose_mode(torch.zeros(T, M)) for T in want} == {"grouped"}  # dense_max 0: never dense


# ----------------------------------------------------------------------------- turbomoe.models


def test_default_ep_rank_from_the_process_group(hf_dir, monkeypatch, tmp_path):
    """models/hf_checkpoint.py:625: from_pretrained with ep_size > 1 and no ep_rank, in an initialised
    process group, reads the experts of rank % ep_size (the recipe's placement): in a 1-rank gloo
    group rank 0's (global experts 0, 1); with get_rank() 3 and ep_size 2 rank 1's (global experts 2, 3,
    local 0, 1). Oracle: the whole model read from the same directory, its experts by global id; the
    non-expert weights all equal."""
    import torch.distributed as dist

    from turbomoe.models import MoEArgs, Qwen3MoeForCausalLM
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without a process group up")
    whole = params_of(Qwen3MoeForCausalLM.from_pretrained(hf_dir))
    prefix = "model.layers.0.mlp.deepspeed_moe.experts.deepspeed_experts."

    def reads_experts(model, first):
        got = params_of(model)
        experts = {k[len(prefix):] for k in got if k.startswith(prefix)}
        assert {e.split(".")[0] for e in experts} == {"0", "1"}  # 2 of 4 experts a rank
        assert all(torch.equal(got[prefix + e], whole[prefix + f"{first + int(e.split('.')[0])}." +
                                                       e.split(".", 1)[1]]) for e in experts)
        assert all(torch.equal(v, whole[k]) for k, v in got.items() if not k.startswith(prefix))

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        reads_experts(Qwen3MoeForCausalLM.from_pretrained(hf_dir, moe_args=MoEArgs(ep_size=2)), 0)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
        reads_experts(Qwen3MoeForCausalLM.from_pretrained(hf_dir, moe_args=MoEArgs(ep_size=2)), 2)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def _stem(out):
    import socket
    return f".{os.path.basename(out)}.tmp-{socket.gethostname()}-"


def _leftovers(parent, out):
    base = os.path.basename(out)
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{base}."))


def test_save_force_over_a_file_and_over_a_link(tmp_path):
    """models/hf_checkpoint.py:537 (the old output a file or a link: removed, not rmtree'd): force
    replaces a regular file at out_dir, and a symlink at out_dir by a directory, the link's target
    untouched; what is read back is the model (oracle: from_pretrained of a plain save)."""
    from turbomoe.models import Qwen3MoeForCausalLM
    model = tiny_model(4)
    plain = str(tmp_path / "plain")
    model.save_pretrained(plain)
    want = Qwen3MoeForCausalLM.from_pretrained(plain)

    out = tmp_path / "out_file"
    out.write_text("not a model")
    model.save_pretrained(str(out), force=True)
    assert out.is_dir() and not out.is_symlink()
    assert same_params(Qwen3MoeForCausalLM.from_pretrained(str(out)), want)
    assert _leftovers(str(tmp_path), str(out)) == []

    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("someone's")
    link = tmp_path / "out_link"
    link.symlink_to(target, target_is_directory=True)
    model.save_pretrained(str(link), force=True)
    assert link.is_dir() and not link.is_symlink()
    assert sorted(os.listdir(target)) == ["keep.txt"] and (target / "keep.txt").read_text() == "someone's"
    assert same_params(Qwen3MoeForCausalLM.from_pretrained(str(link)), want)
    assert _leftovers(str(tmp_path), str(link)) == []

    dangling = tmp_path / "out_dangling"
    dangling.symlink_to(tmp_path / "nowhere", target_is_directory=True)
    model.save_pretrained(str(dangling), force=True)
    assert dangling.is_dir() and not dangling.is_symlink() and not (tmp_path / "nowhere").exists()
    assert same_params(Qwen3MoeForCausalLM.from_pretrained(str(dangling)), want)
    assert _leftovers(str(tmp_path), str(dangling)) == []


def test_save_over_a_dangling_link_without_force_is_refused_before_writing(tmp_path, monkeypatch):
    """A dangling symlink at out_dir is an existing entry that force would replace (the case above):
    without force, FileExistsError 'already exists' before any tensor is written."""
    from turbomoe.models import hf_checkpoint as hf
    model = tiny_model(4)
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere", target_is_directory=True)
    written = []
    real_write = hf.write_weights
    monkeypatch.setattr(hf, "write_weights", lambda *a, **k: written.append(1) or real_write(*a, **k))
    try:
        with pytest.raises(FileExistsError, match="already exists; pass force=True"):
            model.save_pretrained(str(out))
        assert written == []
    finally:
        assert out.is_symlink() and _leftovers(str(tmp_path), str(out)) == []  # the link left, no temporary


def test_save_force_puts_the_old_output_back_when_the_new_cannot_move_in(tmp_path, monkeypatch):
    """models/hf_checkpoint.py:531: with force, the old output steps aside; if the new one then cannot
    be moved in (os.replace fails: here stubbed), the old output is put back as it was and neither the
    temporary directory nor the set-aside copy is left."""
    from turbomoe.models import Qwen3MoeForCausalLM
    old_model, new_model = tiny_model(5), tiny_model(6)
    out = str(tmp_path / "out")
    old_model.save_pretrained(out)
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(src).startswith(_stem(out)):  # the new output moving in
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left on device"):
        new_model.save_pretrained(out, force=True)
    monkeypatch.undo()
    assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
    assert _leftovers(str(tmp_path), out) == []
    assert same_params(Qwen3MoeForCausalLM.from_pretrained(out), old_model)


def test_save_leaves_a_live_writer_of_another_user_alone(tmp_path, monkeypatch):
    """models/hf_checkpoint.py:488-489: a temporary directory of an earlier write to the same output
    whose process is alive but another user's (os.kill(pid, 0): PermissionError; stubbed, the tests
    run as any user) is left as it is; a dead writer's is removed (the covered branch, for contrast)."""
    from turbomoe.models import Qwen3MoeForCausalLM
    model = tiny_model(7)
    out = str(tmp_path / "out")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive_pid = 1 if dead.pid != 1 else 2
    other = tmp_path / f"{_stem(out)}{alive_pid}"
    other.mkdir()
    (other / "shard0.part").write_bytes(b"another user's write")
    gone = tmp_path / f"{_stem(out)}{dead.pid}"
    gone.mkdir()
    (gone / "shard0.part").write_bytes(b"a killed write")
    real_kill = os.kill

    def kill(pid, sig):
        if pid == alive_pid and sig == 0:
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, sig)
    monkeypatch.setattr(os, "kill", kill)
    model.save_pretrained(out)
    monkeypatch.undo()
    assert other.is_dir() and (other / "shard0.part").read_bytes() == b"another user's write"
    assert not gone.exists()
    assert same_params(Qwen3MoeForCausalLM.from_pretrained(out), model)


def _hf_config(**over):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 2, "mlp_only_layers": [0], "norm_topk_prob": True, **over})


@pytest.mark.parametrize("over", [dict(attention_bias=True), dict(attention_bias=True, tie_word_embeddings=True)])
def test_parameter_count_with_attention_biases(over):
    """models/config.py:98: num_parameters with attention_bias counts the q/k/v/o biases; oracle: the
    parameters of the model turbomoe builds and of transformers' Qwen3MoeForCausalLM of that config
    (a dense layer and a MoE layer); active=True the same less the unused experts."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeForCausalLM as HFModel

    from turbomoe.models import ModelConfig
    cfg = ModelConfig(**{**TINY, "num_hidden_layers": 2, "mlp_only_layers": [0], **over})
    ours = tiny_model(0, num_hidden_layers=2, mlp_only_layers=[0], **over)
    hf = HFModel(_hf_config(**over))
    count = sum(p.numel() for p in ours.parameters())  # tied weights once
    assert count == sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()
    biases = sum(p.numel() for n, p in ours.named_parameters() if n.endswith(".bias"))
    assert biases == 2 * (2 * 8 + 2 * 1 * 8 + 16)  # 2 layers: q (heads x head_dim), k, v (1 kv head), o (hidden)
    unused = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert cfg.num_parameters(active=True) == count - unused


def test_flops_per_token_of_a_tied_model():
    """models/config.py:111: with tie_word_embeddings the lm_head (the embedding's tensor) is still a
    matmul: a tied model's FLOPs a token equal the untied one's (the same matmuls, one weight fewer),
    and both are 6 x (active parameters but the embedding lookup) + the attention term, by hand."""
    from turbomoe.models import ModelConfig
    untied, tied = ModelConfig(**TINY), ModelConfig(**TINY, tie_word_embeddings=True)
    assert tied.num_parameters() == untied.num_parameters() - 64 * 16
    h, d, nh, nkv, f, k, E, V = 16, 8, 2, 1, 8, 2, 4, 64
    attn = h * d * (2 * nh + 2 * nkv) + 2 * d + 2 * h
    active = attn + k * 3 * h * f + h * E + V * h + h  # one layer, the final norm, the lm_head matmul
    want = 6.0 * active + 6 * 1 * nh * d * 20
    assert tied.flops_per_token(20) == untied.flops_per_token(20) == want


def test_init_weights_zeroes_attention_biases():
    """models/qwen3_moe.py:288: init_weights starts the q/k/v/o biases at zero, as transformers'
    _init_weights does for Linear biases (oracle: a transformers model's biases after its init), and
    the rest as without biases: the logits equal those of the same weights in a model without biases."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeForCausalLM as HFModel
    hf = HFModel(_hf_config(attention_bias=True))
    assert all(not p.any() for n, p in hf.named_parameters() if n.endswith(".bias"))
    with_bias = tiny_model(9, attention_bias=True)
    biases = {n: p for n, p in with_bias.named_parameters() if n.endswith(".bias")}
    assert len(biases) == 4 and all(not p.any() for p in biases.values())
    without = tiny_model(1)
    without.load_state_dict({k: v for k, v in with_bias.state_dict().items() if not k.endswith(".bias")})
    ids = torch.randint(0, 64, (2, 7), generator=gen(9))
    with torch.no_grad():
        assert torch.equal(with_bias(ids).logits, without(ids).logits)


# ----------------------------------------------------------------------------- turbomoe.nn


def test_remake_release_keeps_a_view_of_a_larger_storage():
    """nn/recompute.py:86: Remake.release frees a tensor stored as its recipe only if it owns its whole
    storage; a view into a larger one (others' bytes go with it) is left alone: the base tensor keeps
    its values and the backward, remaking the view, gives autograd's own gradient (oracle: the same
    product without hooks). An owning tensor (the covered branch, for contrast) is freed."""
    from turbomoe.nn.recompute import Remake
    g = gen(11)
    base = torch.randn(6, 4, generator=g)
    w = torch.randn(4, 3, generator=g, requires_grad=True)
    upstream = torch.randn(4, 3, generator=g)
    want = torch.autograd.grad(base[:4] @ w, w, upstream)[0]
    kept = base.clone()
    for owning in (False, True):
        x = base[:4].clone() if owning else base[:4]
        remake = Remake()
        remake.add(x, lambda: base[:4].clone(), (base, ))
        with remake.hooks():
            y = x @ w  # saves x for w's gradient: stored as its recipe
            remake.release(x)
        assert x.untyped_storage().nbytes() == (0 if owning else base.numel() * 4)
        assert torch.equal(base, kept)
        assert torch.equal(torch.autograd.grad(y, w, upstream)[0], want)


# ----------------------------------------------------------------------------- turbomoe.export


def flat_mapping(params):
    """One flat fp32 group of every parameter and DeepSpeed's param_slice_mappings of it."""
    flat = torch.cat([p.float().reshape(-1) for p in params.values()])
    mapping, start = {}, 0
    for n, p in params.items():
        mapping[n] = types.SimpleNamespace(start=start, numel=p.numel())
        start += p.numel()
    return flat, mapping


def exported_equals(out, model) -> bool:
    """transformers reads OUT and gives the model's logits (fp32 export): the independent oracle."""
    from transformers import Qwen3MoeForCausalLM as HFModel
    hf = HFModel.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 6), generator=gen(21))
    with torch.no_grad():
        want = model(ids).logits
        got = hf(ids).logits
    return torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_export_fp32_of_a_run_without_zero_masters(tmp_path):
    """export.py:181 (no optimizer partitions: zero_states / fp32_masters None), :219 (optimizer_step
    None), :190 (a partition file that is no ZeRO 1/2 one: no masters apart from the module): export
    --dtype fp32 then writes the module's weights, which transformers reads back as the model."""
    pytest.importorskip("transformers")
    from turbomoe.export import RunCheckpoint, export
    model = tiny_model(12)
    tag = fake_run(str(tmp_path / "a"), model)
    ckpt = RunCheckpoint(tag)
    assert ckpt.fp32_masters() is None and ckpt.zero_states(("master", "exp_avg")) is None
    assert ckpt.optimizer_step() is None
    export(str(tmp_path / "a"), str(tmp_path / "out_a"), dtype="fp32", progress=False)
    assert exported_equals(str(tmp_path / "out_a"), model)

    def torch_optimizer(params):  # a plain torch optimizer's state dict: no fp32 partitions of ZeRO 1/2
        return {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
    tag = fake_run(str(tmp_path / "b"), model, partitions=torch_optimizer)
    assert RunCheckpoint(tag).fp32_masters() is None
    export(str(tmp_path / "b"), str(tmp_path / "out_b"), dtype="fp32", progress=False)
    assert exported_equals(str(tmp_path / "out_b"), model)


def test_export_over_a_dangling_link_without_force_is_refused(tmp_path):
    """export's OUT a dangling symlink: refused as existing (as save_pretrained's), the link left as it was."""
    from turbomoe.export import export
    run = str(tmp_path / "run")
    fake_run(run, tiny_model(14))
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere", target_is_directory=True)
    with pytest.raises(FileExistsError, match="already exists; pass --force"):
        export(run, str(out), dtype="fp32", progress=False)
    assert out.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("saved_step", [None, 7])
def test_zero_states_of_the_elastic_format(tmp_path, saved_step):
    """export.py:233-234 (base_optimizer_state as ZeRO's elastic list of per-group states), :223
    (base_optimizer_state_step kept apart): each parameter's Adam moments cut out of the group's flat
    ones (oracle: built as 2 x and x^2 of the weights), the masters, and the step: the one kept apart
    where saved, else the group's."""
    from turbomoe.export import RunCheckpoint
    model = tiny_model(13)

    def elastic(params):
        flat, mapping = flat_mapping(params)
        state = {"single_partition_of_fp32_groups": [flat + 0.5], "param_slice_mappings": [mapping],
                 "base_optimizer_state": [{"exp_avg": 2 * flat, "exp_avg_sq": flat ** 2, "step": torch.tensor(5.0)}]}
        if saved_step is not None:
            state["base_optimizer_state_step"] = saved_step
        return state
    ckpt = RunCheckpoint(fake_run(str(tmp_path / "run"), model, partitions=elastic))
    states = ckpt.zero_states(("master", "exp_avg", "exp_avg_sq"))
    params = params_of(model)
    assert set(states["exp_avg"]) == set(params)
    for name, p in params.items():
        assert torch.equal(states["master"][name], p + 0.5)
        assert torch.equal(states["exp_avg"][name], 2 * p)
        assert torch.equal(states["exp_avg_sq"][name], p ** 2)
    step = ckpt.optimizer_step()
    assert isinstance(step, torch.Tensor) and step.item() == (5.0 if saved_step is None else 7.0)


def test_export_of_a_megatron_data_run_reads_no_tokenizer(tmp_path):
    """export.py:287: a run on pre-tokenized (megatron) data has no tokenizer of ours to write, so its
    data.tokenizer is not read (here a path that no longer exists: for a stdlib run the same path is
    an ExportError, the covered branch); the model is exported, without tokenizer files."""
    pytest.importorskip("transformers")
    from turbomoe.export import ExportError, export
    model = tiny_model(14)
    gone = str(tmp_path / "tokenizer_gone")
    fake_run(str(tmp_path / "stdlib"), model, data={"source": "stdlib", "tokenizer": gone})
    with pytest.raises(ExportError, match="tokenizer_gone"):
        export(str(tmp_path / "stdlib"), str(tmp_path / "out_stdlib"), dtype="fp32", progress=False)
    fake_run(str(tmp_path / "meg"), model, data={"source": "megatron", "tokenizer": gone})
    out = str(tmp_path / "out")
    export(str(tmp_path / "meg"), out, dtype="fp32", progress=False)
    assert exported_equals(out, model)
    assert not [n for n in os.listdir(out) if n.startswith(("tokenizer", "vocab", "special_tokens"))]
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] is None

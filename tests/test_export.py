"""python -m turbomoe.export: a tiny-cpu recipe run on 2 CPU ranks with ep_size 2 (each rank writes half
the experts) -> export -> transformers loads it, and its loss on text the run never saw equals that of
turbomoe's model read straight from the DeepSpeed files; fp32 masters reassembled from the ZeRO
partitions; a run started from the export (model.init_from) on stock DeepSpeed MoE, exported in turn;
bad input, each a clear error with nothing written."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
from test_recipes import launch, records  # noqa: E402

from turbomoe.export import COMPLETE, ExportError, RunCheckpoint, export, load_run_model, resolve_tag  # noqa: E402
from turbomoe.models.hf_checkpoint import CheckpointReader  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Not in the run's data (the Python standard library's sources).
HELD_OUT = ("The lighthouse keeper counted the ships each evening, writing their names in a worn ledger. "
            "When the fog rolled in, she lit the lamp early and listened for horns across the water. ")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """tiny-cpu for 12 steps, checkpoints at 6 and 12 (its data, model and parallel layout as configured)."""
    log_dir = tmp_path_factory.mktemp("run")
    launch(str(log_dir), "--set", "train.steps=12", "--set", "checkpoint.every=6", "--set", "eval.every=6")
    return log_dir


def held_out_losses(run_dir, out_dir, step=None):
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    ids = torch.tensor([tok(HELD_OUT)["input_ids"]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ours = load_run_model(str(run_dir), step)
    with torch.no_grad():
        return hf(ids, labels=ids).loss.item(), ours(ids[:, :-1], ids[:, 1:]).loss.item()


def test_export_loads_in_transformers_with_the_run_loss(run, tmp_path):
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "turbomoe.export", str(run), str(out), "--dtype", "fp32"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "global_step12" in proc.stdout
    theirs, ours = held_out_losses(run, out)
    assert abs(theirs - ours) <= 1e-5 * ours
    first = load_run_model(str(run), step=6)  # an earlier tag by --step: a different, less trained model
    assert not torch.equal(first.lm_head.weight, load_run_model(str(run)).lm_head.weight)


def test_fp32_masters_from_zero_partitions_equal_the_weights(run):
    """An fp32 run's ZeRO-1 masters are its weights: reassembled from both ranks' partitions (experts by
    local id on each expert-parallel rank) they must match the model states exactly."""
    ckpt = RunCheckpoint(resolve_tag(str(run)))
    masters = ckpt.fp32_masters()
    assert masters is not None and len(masters) == len(ckpt.shapes)
    for name, t in ckpt.tensors():
        assert torch.equal(masters[name], t), name


def test_fp32_masters_of_a_bf16_run(tmp_path):
    """A bf16 run (DeepSpeed's bf16 optimizer files) keeps fp32 masters finer than its bf16 weights:
    --dtype fp32 exports them, and they round to exactly the weights the run computed with."""
    launch(str(tmp_path), "--set", "train.precision=bf16", "--set", "train.steps=3", "--set", "train.warmup_steps=1",
           "--set", "eval.every=3", "--set", "eval.batches=1", "--set", "checkpoint.every=3")
    ckpt = RunCheckpoint(resolve_tag(str(tmp_path)))
    masters = ckpt.fp32_masters()
    for name, t in ckpt.tensors():
        assert t.dtype == torch.bfloat16 and masters[name].dtype == torch.float32
        assert torch.equal(masters[name].to(torch.bfloat16), t), name
    assert any(not torch.equal(masters[name], t.float()) for name, t in ckpt.tensors())
    export(str(tmp_path), str(tmp_path / "hf"), dtype="fp32", progress=False)
    with CheckpointReader(str(tmp_path / "hf")) as reader:
        assert torch.equal(reader.get("lm_head.weight"), masters["lm_head.weight"])


def test_tag_and_checkpoint_dirs_and_bf16(run, tmp_path):
    tag = run / "checkpoints" / "global_step6"
    export(str(tag), str(tmp_path / "a"), progress=False)
    export(str(run / "checkpoints"), str(tmp_path / "b"), step=6, progress=False)
    with CheckpointReader(str(tmp_path / "a")) as a, CheckpointReader(str(tmp_path / "b")) as b:
        assert sorted(a.weight_map) == sorted(b.weight_map)
        for k in a.weight_map:
            assert a.get(k).dtype == torch.bfloat16 and torch.equal(a.get(k), b.get(k))
    model = load_run_model(str(run), step=6)
    with CheckpointReader(str(tmp_path / "a")) as a:
        assert torch.equal(a.get("lm_head.weight"), model.lm_head.weight.to(torch.bfloat16))


# ---------------------------------------------------------------- bad input


def copy_run(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_missing_expert_file_of_one_rank(run, tmp_path):
    bad = copy_run(run, tmp_path)
    (bad / "checkpoints" / "global_step12" / "layer_2_expert_5_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(ExportError, match=r"layer_2_expert_5_mp_rank_00_model_states.pt is missing: expert 5 of MoE "
                                          r"layer 2, written by expert-parallel rank 1 of 2"):
        export(str(bad), str(tmp_path / "out"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["run"]  # nothing written, no temporary directory left


def test_no_checkpoint_incomplete_tag_and_existing_output(run, tmp_path):
    with pytest.raises(ExportError, match="no checkpoint there"):
        export(str(tmp_path), str(tmp_path / "out"), progress=False)
    bad = copy_run(run, tmp_path)
    (bad / "checkpoints" / "global_step12" / COMPLETE).unlink()
    with pytest.raises(ExportError, match="global_step12: not a complete checkpoint"):
        export(str(bad), str(tmp_path / "out"), progress=False)
    # A step with no tag (never saved, or rotated away) is named so, with the complete tags there
    # (global_step12 has lost its marker: not listed).
    with pytest.raises(ExportError, match=r"global_step7: no such checkpoint; complete ones in \S+: global_step6$"):
        export(str(bad), str(tmp_path / "out"), step=7, progress=False)
    (tmp_path / "out").mkdir()
    proc = subprocess.run([sys.executable, "-m", "turbomoe.export", str(run), str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "already exists; pass --force" in proc.stderr
    assert os.listdir(tmp_path / "out") == []


def test_output_that_holds_the_run_and_a_broken_marker(run, tmp_path):
    """--force never replaces the checkpoint being read: OUT may not be the run, its tag or a directory
    above them. A marker that is not JSON, or lacks a key, is an ExportError naming the file."""
    bad = copy_run(run, tmp_path)
    tag = bad / "checkpoints" / "global_step12"
    for out in (bad, tmp_path, tag):
        with pytest.raises(ExportError, match=f"OUT {out} holds the checkpoint {tag}"):
            export(str(bad), str(out), force=True, progress=False)
    # nor another checkpoint of the run (its latest, exporting an earlier step), nor anything beside them
    for out in (bad / "checkpoints" / "global_step6", bad / "checkpoints" / "hf"):
        with pytest.raises(ExportError, match=f"OUT {out} lies in the run's checkpoint directory"):
            export(str(bad), str(out), force=True, progress=False)
    proc = subprocess.run([sys.executable, "-m", "turbomoe.export", str(bad), str(bad), "--force"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "holds the checkpoint" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["run"] and sorted(os.listdir(tag)) == sorted(os.listdir(
        run / "checkpoints" / "global_step12"))
    marker = tag / COMPLETE
    meta = json.loads(marker.read_text())
    del meta["world_size"]
    marker.write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=f"{marker}: not a complete checkpoint's marker .KeyError: 'world_size'"):
        export(str(bad), str(tmp_path / "out"), progress=False)
    marker.write_text("{")
    with pytest.raises(ExportError, match=f"{marker}: not a complete checkpoint's marker .JSONDecodeError"):
        export(str(bad), str(tmp_path / "out"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["run"]


# ---------------------------------------------------------------- the recipe starts from an export


def test_recipe_init_from_hf_dir_and_stock_deepspeed_export(run, tmp_path):
    """model.init_from: the exported run, on 2 ranks with ep_size 2 (each rank reads its experts) and stock
    DeepSpeed MoE layers: the new run's first validation (before any step, same data and seed) is the
    source run's last one; and that stock-DeepSpeed run's own checkpoint exports too."""
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from recipe_config import ConfigError, load_config
    hf_dir = tmp_path / "hf"
    export(str(run), str(hf_dir), dtype="fp32", progress=False)
    tiny = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")
    cfg = load_config(tiny, [f"model.init_from={hf_dir}"])  # tiny-cpu's model keys all agree with the export
    assert cfg.init_from == str(hf_dir) and cfg.model.num_experts == 8
    with pytest.raises(ConfigError, match=r"differ from model.init_from .*'hidden_size': \(64, 128\)"):
        load_config(tiny, [f"model.init_from={hf_dir}", "model.hidden_size=64"])
    with pytest.raises(ConfigError, match="config.json does not exist"):
        load_config(tiny, [f"model.init_from={tmp_path / 'nowhere'}"])

    log_dir = tmp_path / "finetune"
    launch(str(log_dir), "--set", f"model.init_from={hf_dir}", "--set", "model.moe_impl=deepspeed",
           "--set", "train.steps=2", "--set", "train.warmup_steps=1")
    first = [r["valid_loss"] for r in records(log_dir, "valid")][0]
    source_last = [r["valid_loss"] for r in records(run, "valid")][-1]
    assert abs(first - source_last) <= 1e-5 * source_last

    export(str(log_dir), str(tmp_path / "hf2"), dtype="fp32", progress=False)
    theirs, ours = held_out_losses(log_dir, tmp_path / "hf2")
    assert abs(theirs - ours) <= 1e-5 * ours


def test_init_from_a_model_with_its_own_tokenizer(run, tmp_path, monkeypatch):
    """A model directory whose tokenizer is not the byte one (a published model's vocabulary, here words):
    a text corpus is read in that tokenizer by default (data.tokenizer unset), the run records the
    directory, trains on those ids and exports that tokenizer beside the model; data.tokenizer=bytes
    keeps bytes; megatron data takes no tokenizer; one larger than the model's vocabulary is refused."""
    from test_data import word_tokenizer
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import pretrain
    from recipe_config import ConfigError
    hf_dir = tmp_path / "hf"
    export(str(run), str(hf_dir), dtype="fp32", progress=False)
    for name in os.listdir(hf_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            os.remove(hf_dir / name)
    words = ["def", "return", "x", "y", "if", "else", "(", ")", ":"]
    word_tokenizer(hf_dir, words)
    eos = len(words) + 1
    # a model directory of that vocabulary: its token ids and generation config (several EOS ids, sampling
    # defaults, as a published chat model's) are what export writes beside the tokenizer
    config = json.load(open(hf_dir / "config.json"))
    json.dump({**config, "eos_token_id": eos, "pad_token_id": None}, open(hf_dir / "config.json", "w"))
    generation = {"eos_token_id": [eos, 1], "temperature": 0.6, "top_p": 0.95, "do_sample": True}
    json.dump(generation, open(hf_dir / "generation_config.json", "w"))
    (tmp_path / "docs").mkdir()
    for i in range(200):
        (tmp_path / "docs" / f"{i:03d}.txt").write_text(" ".join(words[(i * j) % len(words)] for j in range(90)))
    data = ["--set", "data.source=text", "--set", f"data.paths=[{tmp_path / 'docs'}]", "--set", "data.seq_len=32",
            "--set", "data.valid_fraction=0.2"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    tiny = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")

    def prepare(*args):
        return pretrain.prepare(pretrain.parse_args(["--config", tiny, "--set", f"log.dir={tmp_path / 'p'}",
                                                     "--set", f"model.init_from={hf_dir}", *data, *args]))
    cfg, _, samples = prepare()
    assert cfg.data.tokenizer == str(hf_dir)
    tokens = samples.stream.read(0, len(samples.stream)).tolist()
    assert tokens[:4] == [0, 0, 0, 0] and tokens.count(eos) == 200 and max(tokens) == eos  # doc 0: "def" x 90
    cfg, _, samples = prepare("--set", "data.tokenizer=bytes")
    assert cfg.data.tokenizer == "bytes" and samples.stream.read(0, 3).tolist() == list(b"def")
    with pytest.raises(ConfigError, match="megatron data is already tokenized"):
        prepare("--set", "data.source=megatron", "--set", "data.paths=[x]", "--set", f"data.tokenizer={hf_dir}")
    big = word_tokenizer(tmp_path / "big", [f"w{i}" for i in range(400)])
    with pytest.raises(ConfigError, match=r"has 402 tokens, more than model.vocab_size 320"):
        prepare("--set", f"data.tokenizer={big}")
    with pytest.raises(ConfigError, match="data.tokenizer: .*no Hugging Face tokenizer files"):
        prepare("--set", f"data.tokenizer={tmp_path / 'docs'}")

    log_dir = tmp_path / "words"
    launch(str(log_dir), "--set", f"model.init_from={hf_dir}", *data, "--set", "train.steps=2",
           "--set", "train.warmup_steps=1")
    assert json.load(open(log_dir / "checkpoints" / "global_step2" / COMPLETE))["config"]["data"]["tokenizer"] == \
        str(hf_dir)
    # A resume reads the corpus as the run did: another tokenizer is named.
    with pytest.raises(ConfigError, match=r"'data.tokenizer': \('" + str(hf_dir) + r"', 'bytes'\)"):
        prepare("--set", "data.tokenizer=bytes", "--set", f"log.dir={log_dir}", "--resume", str(log_dir / "checkpoints"))
    export(str(log_dir), str(tmp_path / "out"), progress=False)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert json.load(open(tmp_path / "out" / "config.json"))["eos_token_id"] == eos
    assert json.load(open(tmp_path / "out" / "generation_config.json")) == generation
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out")).encode("def x") == [0, 2]
    # The directory's tokenizer replaced by another of the same size (two words swapped): refused, nothing written.
    word_tokenizer(hf_dir, [words[1], words[0], *words[2:]])
    with pytest.raises(ExportError, match="tokenizer files in .* changed since the run read its corpus"):
        export(str(log_dir), str(tmp_path / "out2"), progress=False)
    assert not (tmp_path / "out2").exists()

"""data.tokenizer and generate --chat, review cases: chat templates that fail, vocabularies that skip
ids, the byte tokenizer's detection, ~ in data.tokenizer, documents of no tokens, a resume of a run from
before data.tokenizer, and the export of a run whose tokenizer directory changed."""
import json
import logging
import os
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
from test_data import word_tokenizer  # noqa: E402
from test_export import ROOT, run  # noqa: E402,F401 (run: the module's fixture, a 12-step byte run)

from turbomoe.data import ByteTokenizer, HFTokenizer, corpus_tokenizer, load_stream  # noqa: E402
from turbomoe.export import COMPLETE, ExportError, export, resolve_tag  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "recipes"))
TINY = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")


def byte_dir(path):
    os.makedirs(path)
    ByteTokenizer().save_pretrained(str(path), model_max_length=64)
    return str(path)


def edit_tokenizer_json(path, **changes):
    with open(os.path.join(path, "tokenizer.json")) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(raw, f)


@pytest.mark.parametrize("template, message", [
    ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
     "{% for m in messages %}{{ m['content'] }}{% endfor %}", "System role not supported"),
    ("{{ messages[0]['content'] }}{{ date_string.year }}", "'date_string' is undefined"),
    ({"tool_use": "{{ messages[0]['content'] }}"}, "multiple chat templates with no default"),
])
def test_generate_cli_chat_template_failures_are_usage_errors(tmp_path, capsys, template, message):
    """A template that raises (Gemma's and older Mistral's refuse a system turn), reads a variable it was
    not given, or a tokenizer with only named templates: before, a jinja2 or ValueError traceback."""
    from turbomoe.generate import main
    model = byte_dir(tmp_path / "m")
    with open(os.path.join(model, "config.json"), "w") as f:  # the chat text fails before the model loads
        json.dump({"model_type": "qwen3_moe", "max_position_embeddings": 64}, f)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    tok.chat_template = template
    tok.save_pretrained(model)
    with pytest.raises(SystemExit) as e:
        main([model, "--prompt", "hi", "--chat", "--system", "be brief", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--chat: the tokenizer's chat template failed" in err and message in err


def test_a_vocabulary_that_skips_ids(tmp_path, monkeypatch):
    """Ids past len(tokenizer): its vocab_size is the largest id + 1, so the stream holds them (uint32) and
    the model's vocab_size is checked against them. Before, vocab_size was 4, the stream uint16, and
    load_stream an OverflowError."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 70000, "[UNK]": 1, "<eos>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>").save_pretrained(
        str(tmp_path / "tok"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("a b")
    name, got = corpus_tokenizer(str(tmp_path / "tok"))
    assert got.vocab_size == 70001
    stream = load_stream("text", [str(tmp_path / "docs")], tokenizer=got)
    assert stream.tokens.dtype == np.uint32 and stream.read(0, 3).tolist() == [0, 70000, 2]
    import pretrain
    from recipe_config import ConfigError
    monkeypatch.setenv("WORLD_SIZE", "2")  # tiny-cpu's ranks
    with pytest.raises(ConfigError, match="has 70001 tokens, more than model.vocab_size 320"):
        pretrain.prepare(pretrain.parse_args(["--config", TINY, "--set", f"log.dir={tmp_path / 'p'}",
                                              "--set", "data.source=text", "--set", f"data.paths=[{tmp_path / 'docs'}]",
                                              "--set", f"data.tokenizer={name}"]))


def test_byte_tokenizer_detection(tmp_path):
    """The byte tokenizer's vocabulary with a prefix space or a lowercasing normalizer encodes text to other
    ids than its bytes: not the byte tokenizer (before, both were, and the corpus read as raw bytes). The
    byte tokenizer re-saved by transformers (a chat template added) still is."""
    prefix = byte_dir(tmp_path / "prefix")
    edit_tokenizer_json(prefix, pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                               "use_regex": False})
    lower = byte_dir(tmp_path / "lower")
    edit_tokenizer_json(lower, normalizer={"type": "Lowercase"})
    for path, text, ids in ((prefix, "ab", [32, 97, 98]), (lower, "AB", [97, 98])):
        name, got = corpus_tokenizer(path)
        assert name == path and isinstance(got, HFTokenizer) and got.encode(text).tolist() == ids, path
    resaved = byte_dir(tmp_path / "resaved")
    tok = transformers.AutoTokenizer.from_pretrained(resaved)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(resaved)
    name, got = corpus_tokenizer(resaved)
    assert name == "bytes" and isinstance(got, ByteTokenizer)


def test_data_tokenizer_expands_home(tmp_path, monkeypatch):
    """~ in data.tokenizer, as in data.paths (no shell expands it in YAML or after --set); before, it
    was taken relative to the working directory."""
    from recipe_config import load_config
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(TINY, ["data.tokenizer=~/tok"])
    assert cfg.data.tokenizer == str(tmp_path / "tok")


def test_documents_of_no_tokens_add_no_eos(tmp_path):
    """A document a tokenizer makes no tokens of (blanks, to a whitespace-split vocabulary) adds nothing,
    as an empty one: before, a lone EOS."""
    tok = HFTokenizer(word_tokenizer(tmp_path / "tok", ["a", "b"]))
    (tmp_path / "docs").mkdir()
    for name, text in (("1.txt", "a"), ("2.txt", " \n\t "), ("3.txt", "b")):
        (tmp_path / "docs" / name).write_text(text)
    stream = load_stream("text", [str(tmp_path / "docs")], tokenizer=tok)
    assert stream.read(0, len(stream)).tolist() == [0, 3, 1, 3]


def test_long_documents_do_not_warn(tmp_path):
    """A document longer than the tokenizer's model_max_length is cut into samples: not transformers'
    warning that it 'will result in indexing errors'."""
    path = word_tokenizer(tmp_path / "tok", ["a"])
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({**config, "model_max_length": 8}, f)
    warned = []
    handler = logging.Handler()
    handler.emit = warned.append
    logging.getLogger("transformers").addHandler(handler)  # which does not propagate to pytest's capture
    try:
        assert len(HFTokenizer(path).encode("a " * 100)) == 100
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [r for r in warned if "indexing errors" in r.getMessage()]


def copy_checkpoint(run_dir, to, **data):
    """The run's last checkpoint alone in `to`, its recorded data section updated (None: key removed)."""
    tag = resolve_tag(str(run_dir))
    os.makedirs(to)
    shutil.copytree(tag, os.path.join(to, os.path.basename(tag)))
    with open(os.path.join(to, "latest"), "w") as f:
        f.write(os.path.basename(tag))
    marker = os.path.join(to, os.path.basename(tag), COMPLETE)
    with open(marker) as f:
        meta = json.load(f)
    for k, v in data.items():
        if v is None:
            meta["config"]["data"].pop(k, None)
        else:
            meta["config"]["data"][k] = v
    with open(marker, "w") as f:
        json.dump(meta, f)
    return str(to)


def resume_as_the_runs_ranks(pretrain, monkeypatch):
    """prepare in this process as the run's two CPU ranks would: on a GPU machine this process's
    accelerator is CUDA, and prepare would read the run's precision auto as bf16 and refuse it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(pretrain, "uses_gpu", lambda: False)


def test_resume_of_a_run_from_before_data_tokenizer(run, tmp_path, monkeypatch):
    """A checkpoint without data.tokenizer read bytes: with data.tokenizer unset it resumes on bytes even
    where model.init_from now has a tokenizer of its own (before, refused: ('bytes', that directory)); a
    checkpoint that recorded bytes is still refused another tokenizer."""
    import pretrain
    from recipe_config import ConfigError
    resume_as_the_runs_ranks(pretrain, monkeypatch)
    hf_dir = tmp_path / "hf"
    export(str(run), str(hf_dir), dtype="fp32", progress=False)
    for name in os.listdir(hf_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            os.remove(hf_dir / name)
    word_tokenizer(hf_dir, ["def", "return"])

    def prepare(ckpt, log):
        return pretrain.prepare(pretrain.parse_args(["--config", TINY, "--set", f"model.init_from={hf_dir}",
                                                     "--set", f"log.dir={tmp_path / log}", "--resume", ckpt]))
    old = copy_checkpoint(run, tmp_path / "old", tokenizer=None)
    cfg, _, samples = prepare(old, "a")
    assert cfg.data.tokenizer == "bytes" and samples.stream.tokens.dtype == np.uint16
    with pytest.raises(ConfigError, match=r"'data.tokenizer': \('bytes', '" + str(hf_dir) + "'\\)"):
        prepare(copy_checkpoint(run, tmp_path / "new"), "b")


def test_export_of_a_run_whose_tokenizer_changed(run, tmp_path):
    """The run's tokenizer directory moved away: a clear error (how to export); it now holds a tokenizer
    larger than the model's vocabulary: not the run's, an error (before, exported beside the model)."""
    with pytest.raises(ExportError, match="no Hugging Face tokenizer files there.*put that tokenizer back there"):
        export(copy_checkpoint(run, tmp_path / "moved", tokenizer=str(tmp_path / "gone")), str(tmp_path / "o1"),
               progress=False)
    big = word_tokenizer(tmp_path / "big", [f"w{i}" for i in range(400)])
    with pytest.raises(ExportError, match="now has 402 tokens, more than the model's 320"):
        export(copy_checkpoint(run, tmp_path / "big_run", tokenizer=big), str(tmp_path / "o2"), progress=False)
    assert not os.path.exists(tmp_path / "o1") and not os.path.exists(tmp_path / "o2")


def test_resume_with_the_corpus_cache_moved_or_off(run, tmp_path, monkeypatch):
    """data.cache and data.cache_dir do not change the tokens: a run's checkpoint resumes with the cache
    off (tokens in memory) or in another directory (a new entry there), the corpus digest as recorded."""
    import pretrain
    resume_as_the_runs_ranks(pretrain, monkeypatch)
    ckpt = copy_checkpoint(run, tmp_path / "ckpt")
    for i, change in enumerate(("data.cache=false", f"data.cache_dir={tmp_path / 'elsewhere'}")):
        cfg, _, samples = pretrain.prepare(pretrain.parse_args(
            ["--config", TINY, "--set", change, "--set", f"log.dir={tmp_path / str(i)}", "--resume", ckpt]))
        assert isinstance(samples.stream.tokens, np.memmap) == (i == 1)
    assert len([f for f in os.listdir(tmp_path / "elsewhere") if f.endswith(".tokens")]) == 1

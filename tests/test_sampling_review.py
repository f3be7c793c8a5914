"""Review of the sampling change (turbomoe.inference.sampling, the CLI's decoding settings): the
directory's settings where transformers' generate finds them without a generation_config.json
(config.json), and the CLI's flags over a generation_config.json value that transformers' generate
would run under the same arguments (--greedy, or a flag replacing the bad value), with an error that
names the file where a value of it is at fault."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_engine import hf_model  # noqa: E402
from turbomoe.inference import generation_defaults, load  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest.one_thread


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A tiny Qwen3-MoE directory with a byte tokenizer (the CLI's), its engine, and its
    generation_config.json as saved."""
    from turbomoe.data import ByteTokenizer
    from turbomoe.models import Qwen3MoeForCausalLM
    tmp = tmp_path_factory.mktemp("review")
    _, path = hf_model(tmp, 6, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out = os.path.join(tmp, "bytes")
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    config_path = os.path.join(out, "generation_config.json")
    engine = load(out, device="cpu", max_seq_len=16, max_batch=1)
    return out, engine, config_path, json.load(open(config_path))


def cli(out, capsys, *extra):
    from turbomoe.generate import main
    capsys.readouterr()
    main([out, "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu", *extra])
    return capsys.readouterr()


def text(out, engine, **kw):
    """What the CLI prints for "hi" (4 new tokens) with these settings."""
    from transformers import AutoTokenizer
    ids = engine.generate(torch.tensor([[104, 105]]), 4, eos_token_id=256, pad_token_id=256, **kw)[0, 2:]
    return AutoTokenizer.from_pretrained(out).decode(ids, skip_special_tokens=True) + "\n"


def test_cli_flags_replace_a_bad_generation_config_value(byte_model, capsys):
    """generation_config.json asks to sample at temperature 0 (transformers' TemperatureLogitsWarper
    refuses it): transformers' generate still runs the directory with do_sample=False, or with a
    temperature of its own, and so must --greedy and --temperature; without a flag, the error names
    the file."""
    from transformers import AutoModelForCausalLM
    out, engine, config_path, config = byte_model
    json.dump({**config, "do_sample": True, "temperature": 0.0}, open(config_path, "w"))
    try:
        hf = AutoModelForCausalLM.from_pretrained(out)
        hf.generate(torch.tensor([[104, 105]]), max_new_tokens=2, do_sample=False, pad_token_id=256)
        hf.generate(torch.tensor([[104, 105]]), max_new_tokens=2, temperature=0.7, pad_token_id=256)
        printed = cli(out, capsys, "--greedy")
        assert printed.out == text(out, engine) and "decoding: greedy\n" in printed.err
        printed = cli(out, capsys, "--temperature", "0.7", "--seed", "2")
        assert printed.out == text(out, engine, do_sample=True, temperature=0.7, top_k=50,
                                   generator=torch.Generator().manual_seed(2))
        assert "decoding: sampling, temperature 0.7, top_k 50\n" in printed.err
        with pytest.raises(SystemExit) as e:
            cli(out, capsys)
        assert e.value.code == 2
        assert f"{config_path}: sampling needs a finite temperature > 0" in capsys.readouterr().err
    finally:
        json.dump(config, open(config_path, "w"))


def test_cli_error_names_the_file_a_bad_value_comes_from(byte_model, capsys):
    """generation_config.json decodes greedily with temperature 0 (unused, so fine); --sample then finds
    that temperature: the error must say it is the file's, not present it as a flag the user gave."""
    out, _, config_path, config = byte_model
    json.dump({**config, "do_sample": False, "temperature": 0.0}, open(config_path, "w"))
    try:
        with pytest.raises(SystemExit) as e:
            cli(out, capsys, "--sample")
        err = capsys.readouterr().err
        assert e.value.code == 2 and "sampling needs a finite temperature > 0, got 0.0" in err
        assert config_path in err, err
    finally:
        json.dump(config, open(config_path, "w"))


def test_generation_defaults_from_config_json_without_generation_config(tmp_path):
    """Without generation_config.json, transformers takes the decoding settings from config.json (where
    older checkpoints keep them): generation_defaults must too."""
    from transformers import AutoModelForCausalLM
    _, path = hf_model(tmp_path, 1)
    os.remove(os.path.join(path, "generation_config.json"))
    config_json = os.path.join(path, "config.json")
    set_there = dict(do_sample=True, temperature=0.5, top_k=7, repetition_penalty=1.3)
    json.dump({**json.load(open(config_json)), **set_there}, open(config_json, "w"))
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert {k: getattr(hf.generation_config, k) for k in set_there} == set_there  # what generate runs with
    assert generation_defaults(path) == dict(set_there, top_p=1.0, min_p=0.0, min_new_tokens=0, num_return_sequences=1)

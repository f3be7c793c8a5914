"""A new user's walk through the README's "Export and inference" section on the CPU (Engine.generate's
sampling arguments, turbomoe.inference.generation_defaults, python -m turbomoe.generate's decoding
flags and its warning about generation_config.json settings it does not implement): the faults it
found, each a test that fails while the fault is there.

- generation_defaults of a directory that does not exist (a typo, or a Hub name such as
  "Qwen/Qwen3-30B-A3B") returns transformers' defaults (greedy) without a word, where transformers'
  GenerationConfig.from_pretrained raises: a Qwen3 chat model then decodes greedily, the case the
  function exists to prevent.
- Engine.generate(..., generator=<not a torch.Generator>) when greedy dies with an AttributeError
  ('int' object has no attribute 'device') instead of ignoring the generator or naming the argument
  (before edb5ad7 greedy ignored it).
- The "not implemented ... ignored (transformers' generate would apply them)" report names
  sampling-only settings (typical_p, epsilon_cutoff, ...) where decoding is greedy, where transformers'
  generate builds no warper for them: generation_defaults warns, and the CLI prints it under --greedy.
- generation_config.json's stop_strings (transformers' generate stops at them) is not named in that
  report: the CLI runs past them without a word.
"""
import json
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from test_engine import hf_model  # noqa: E402
from turbomoe.inference import generation_defaults, load  # noqa: E402


def byte_model(tmp_path, generation: dict) -> str:
    """A tiny random Qwen3-MoE saved by transformers, re-saved with turbomoe's byte tokenizer (as
    test_engine.py::test_generate_cli), its generation_config.json replaced by `generation`."""
    from turbomoe.data import ByteTokenizer
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 5, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out = os.path.join(tmp_path, "bytes")
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 256, "pad_token_id": 256, **generation}, f)
    return out


def test_generation_defaults_of_a_missing_directory_is_an_error(tmp_path):
    """A directory that is not there is an error (transformers' GenerationConfig.from_pretrained raises
    OSError), not transformers' defaults: greedy decoding for a mistyped Qwen3 chat model's path."""
    for missing in (str(tmp_path / "Qwen3-30B-A3B-typo"), "Qwen/Qwen3-30B-A3B"):
        with pytest.raises((FileNotFoundError, NotADirectoryError, ValueError, OSError)):
            got = generation_defaults(missing)
            print(f"generation_defaults({missing!r}) returned {got}")


def test_greedy_generate_with_a_bad_generator_names_it(tmp_path):
    """A generator that is no torch.Generator, on a greedy call: ignored (greedy draws nothing, as
    test_engine_review3.py's docstring says) or a ValueError/TypeError naming it, as the sampling call
    gives; not an AttributeError from inside. A regression of edb5ad7: _checked_generate now reads
    generator.device before the do_sample-gated isinstance check."""
    _, path = hf_model(tmp_path, 2)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=1, max_seq_len=16)
    ids = torch.tensor([[1, 2, 3]])
    try:
        out = engine.generate(ids, 2, generator=5)
    except (ValueError, TypeError) as e:
        assert "generator" in str(e), e
    else:
        assert torch.equal(out, engine.generate(ids, 2))


def test_generation_defaults_greedy_file_does_not_report_sampling_only_settings(tmp_path):
    """A greedy generation_config.json that also sets typical_p / epsilon_cutoff: transformers' generate
    builds their warpers only when sampling, so it does not apply them; the warning says it would."""
    from transformers import GenerationConfig
    d = str(tmp_path)
    settings = {"do_sample": False, "typical_p": 0.2, "epsilon_cutoff": 0.1}
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(settings, f)
    # transformers: no sampling, so no TypicalLogitsWarper / EpsilonLogitsWarper (_get_logits_processor
    # adds them under `if generation_config.do_sample`)
    assert GenerationConfig.from_pretrained(d).do_sample is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generation_defaults(d)
    wrong = [str(w.message) for w in caught if "typical_p" in str(w.message) or "epsilon_cutoff" in str(w.message)]
    assert not wrong, wrong


def test_cli_greedy_does_not_report_sampling_only_settings_as_applied(tmp_path, capsys):
    """--greedy over a sampling generation_config.json with typical_p: transformers'
    generate(do_sample=False) would not apply typical_p either, yet stderr says it would."""
    from turbomoe.generate import main
    out = byte_model(tmp_path, {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "typical_p": 0.5})
    capsys.readouterr()
    main([out, "--prompt", "hi", "--max-new-tokens", "3", "--device", "cpu", "--greedy"])
    err = capsys.readouterr().err
    assert "decoding: greedy\n" in err
    assert "typical_p" not in err, err


def test_stop_strings_named_as_not_implemented(tmp_path, capsys):
    """generation_config.json's stop_strings: transformers' generate stops at them (it asks for the
    tokenizer to do so); the engine does not, so the warning of settings not implemented (and the
    CLI's stderr) should name them."""
    d = str(tmp_path / "cfg")
    os.makedirs(d)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"stop_strings": ["\n\n"], "eos_token_id": 1}, f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generation_defaults(d)
    assert any("stop_strings" in str(w.message) for w in caught), [str(w.message) for w in caught]
    from turbomoe.generate import main
    out = byte_model(tmp_path, {"stop_strings": ["e"]})
    capsys.readouterr()
    main([out, "--prompt", "hi", "--max-new-tokens", "3", "--device", "cpu"])
    assert "stop_strings" in capsys.readouterr().err

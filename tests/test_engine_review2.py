"""Engine.generate and python -m turbomoe.generate, second review: the engine stays usable whatever grad
mode or autocast its caller runs it under (greedy tokens still transformers'), and the CLI reports no
decode time where no decode step ran."""
import types

import pytest
import torch

pytest.importorskip("transformers")

from test_engine import hf_model, random_prompts  # noqa: E402
from test_engine_review import byte_model  # noqa: E402
from turbomoe.inference import load  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest.one_thread


def test_cache_made_under_inference_mode_serves_later_calls(tmp_path):
    """A cache made inside torch.inference_mode (by generate or reserve) is updated in place by the calls
    after it, outside: it must be made of normal tensors, not inference tensors (which refuse that)."""
    hf, path = hf_model(tmp_path, 21)
    ids, mask = random_prompts((6, 1, 4), torch.Generator().manual_seed(21))
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    for make in ("generate", "reserve"):
        engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=24)
        with torch.inference_mode():
            if make == "generate":
                assert torch.equal(engine.generate(ids, 7, attention_mask=mask, pad_token_id=0), want)
            else:
                engine.reserve(3, 13)
        assert torch.equal(engine.generate(ids, 7, attention_mask=mask, pad_token_id=0), want), make
        with torch.inference_mode():  # and back inside
            assert torch.equal(engine.generate(ids, 7, attention_mask=mask, pad_token_id=0), want), make


def test_generate_under_autocast_runs_in_the_engines_dtype(tmp_path):
    """A caller's autocast (bf16 matmuls) does not reach the engine, which runs in its own dtype: the
    fp32 engine's tokens, not an error about the cache's dtype."""
    hf, path = hf_model(tmp_path, 22)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=2, max_seq_len=24)
    ids, mask = random_prompts((3, 8), torch.Generator().manual_seed(22))
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = engine.generate(ids, 9, attention_mask=mask, pad_token_id=0)
    assert torch.equal(got, want), (got, want)


def test_generate_cli_reports_no_decode_time_without_a_decode_step(tmp_path, capsys, monkeypatch):
    """--max-new-tokens 1 runs no decode step: the decode time printed is 0, not the difference of two
    timings of the same one-token call (a clock faked so that each call takes longer than the one before)."""
    import turbomoe.generate as cli
    out = byte_model(tmp_path)
    ticks = iter(range(1, 1000))
    monkeypatch.setattr(cli, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) ** 2 / 1000))
    cli.main([out, "--prompt", "abc", "--max-new-tokens", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert "[1 x 1 new tokens]" in err and "decode 0.0 ms (too short to time)" in err, err
    cli.main([out, "--prompt", "abc", "--max-new-tokens", "3", "--device", "cpu"])  # the clock does move
    err = capsys.readouterr().err
    assert "[1 x 3 new tokens]" in err and "tokens/s" in err and "decode 0.0 ms" not in err, err

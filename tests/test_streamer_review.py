"""A review of Engine.generate's streamer (transformers' streamer protocol): end() comes after a bad
argument's error too, so a TextIteratorStreamer consumer in another thread stops instead of waiting
for ever; streamed through that consumer, the text is generate's."""
import os
import queue
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_engine import Recorder, hf_model, left_padded  # noqa: E402
from turbomoe.inference import load  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest.one_thread


def test_a_bad_argument_ends_the_streamer(tmp_path):
    """Each of generate's argument errors reaches the caller as before, after one end() and no put."""
    _, path = hf_model(tmp_path, 2)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)
    ids, mask = left_padded([[5, 6, 7, 8], [9, 10]], pad=0)
    for kw, message in ((dict(input_ids=ids, max_new_tokens=100), "exceeds the KV cache's max_seq_len"),
                        (dict(input_ids=[[1, 2]], max_new_tokens=4), "input_ids must be an integer tensor"),
                        (dict(input_ids=ids, max_new_tokens=4, attention_mask=mask[:, 1:]), "attention_mask must"),
                        (dict(input_ids=ids, max_new_tokens=4, pad_token_id=1000), "pad_token_id must be one id"),
                        (dict(input_ids=ids, max_new_tokens=4, do_sample=True, temperature=0), "sampling needs")):
        rec = Recorder()
        with pytest.raises(ValueError, match=message):
            engine.generate(streamer=rec, **kw)
        assert rec.ends == 1 and rec.puts == [], kw
    rec = Recorder()  # and a good call after them: the prompt, each step, one end()
    got = engine.generate(ids, 5, attention_mask=mask, streamer=rec)
    assert rec.ends == 1 and torch.equal(torch.cat([rec.puts[0]] + [t[:, None] for t in rec.puts[1:]], 1), got)


def byte_engine(tmp_path):
    from turbomoe.data import ByteTokenizer
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 5, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out = os.path.join(tmp_path, "bytes")
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    return load(out, device="cpu", max_seq_len=40, max_batch=1), transformers.AutoTokenizer.from_pretrained(out)


def streamed(engine, tok, prompt, n):
    """(the text a TextIteratorStreamer consumer read, generate's output or error) with generate in a thread,
    as a server runs it; the consumer's timeout stands for "for ever"."""
    streamer = transformers.TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True, timeout=30)
    result = {}

    def run():
        try:
            result["out"] = engine.generate(prompt, n, eos_token_id=256, pad_token_id=256, streamer=streamer)
        except Exception as e:  # noqa: BLE001 - handed to the test
            result["error"] = e
    thread = threading.Thread(target=run)
    thread.start()
    try:
        text = "".join(streamer)
    except queue.Empty:
        text = None  # the consumer was never told generation ended
    thread.join()
    return text, result


def test_text_iterator_streamer_in_a_thread(tmp_path):
    engine, tok = byte_engine(tmp_path)
    prompt = torch.tensor([tok("def f(x):")["input_ids"]])
    text, result = streamed(engine, tok, prompt, 20)
    assert text == tok.decode(result["out"][0, prompt.shape[1]:], skip_special_tokens=True)
    text, result = streamed(engine, tok, prompt, 200)  # past max_seq_len: an error, and the consumer stops
    assert isinstance(result.get("error"), ValueError) and "max_seq_len" in str(result["error"])
    assert text == "", "the consumer waited for ever: end() was not called after the argument error"


def test_an_error_of_end_does_not_hide_generates_own(tmp_path):
    """After generate's own error, an end() that raises too leaves the caller generate's error; after a
    good call, end()'s error is the caller's."""
    _, path = hf_model(tmp_path, 2)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)

    class Broken(Recorder):
        def end(self):
            super().end()
            raise RuntimeError("end failed")
    rec = Broken(fail_at=2)
    with pytest.raises(RuntimeError, match="the consumer went away"):
        engine.generate(torch.tensor([[5, 6, 7]]), 6, streamer=rec)
    assert rec.ends == 1
    with pytest.raises(RuntimeError, match="end failed"):
        engine.generate(torch.tensor([[5, 6, 7]]), 3, streamer=Broken())


def test_generate_cli_stream_hands_the_engine_a_streamer(tmp_path, capsys, monkeypatch):
    """--stream's text comes through the streamer as generate makes it: the timed call gets a
    TextStreamer, and stdout holds nothing printed after generate returned."""
    from turbomoe.data import ByteTokenizer
    from turbomoe.generate import main
    from turbomoe.inference.engine import Engine
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 5, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out = os.path.join(tmp_path, "bytes")
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    generate, calls = Engine.generate, []

    def spy(self, *args, **kw):
        result = generate(self, *args, **kw)
        calls.append((kw.get("streamer"), capsys.readouterr().out))  # what was printed by the time it returned
        return result
    monkeypatch.setattr(Engine, "generate", spy)
    capsys.readouterr()
    main([out, "--prompt", "abc", "--max-new-tokens", "6", "--device", "cpu", "--stream"])
    streamer, printed = calls[-1]
    assert isinstance(streamer, transformers.TextStreamer) and printed.endswith("\n")
    assert capsys.readouterr().out == ""  # nothing after the streamed call's end()

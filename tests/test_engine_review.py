"""Engine.generate and python -m turbomoe.generate, review cases: sampling draw for draw as transformers'
generate, the cache filled exactly at the largest bucket, and the CLI on tokenizers without a pad or EOS
token, with its timed calls free of cache remakes and synchronising the engine's GPU."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from test_engine import hf_model, left_padded, random_prompts  # noqa: E402
from turbomoe.inference import load  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest.one_thread


def byte_model(tmp_path, seed=5):
    """A random model on the byte tokenizer (257 ids, 256 its EOS), as turbomoe's save_pretrained writes it."""
    from turbomoe.data import ByteTokenizer
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, seed, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out = os.path.join(tmp_path, "bytes")
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    return out


def test_sampling_draws_as_transformers(tmp_path):
    """do_sample with temperature and top_p (edge values included) on torch's global generator: the
    tokens transformers' generate draws from the same seed (its top_k off), ragged rows, EOS per row."""
    hf, path = hf_model(tmp_path, 8)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=32)
    g = torch.Generator().manual_seed(8)
    ids, mask = random_prompts((5, 2, 9), g)
    for temperature, top_p, eos in ((1.0, 1.0, None), (0.7, 0.9, 5), (2.0, 1e-6, None), (0.4, 0.999, [7, 9])):
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p, eos_token_id=eos, pad_token_id=0)
        torch.manual_seed(1)
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, top_k=0, **kw)
        torch.manual_seed(1)
        got = engine.generate(ids, 10, attention_mask=mask, **kw)
        assert torch.equal(got, want), (temperature, top_p, got, want)


def test_cache_filled_exactly_at_the_largest_bucket(tmp_path):
    """prompt + new tokens = max_seq_len at batch max_batch (a bucket of its own) and at batch 1, eos as
    an int, a list and None, no pad id: transformers' tokens."""
    hf, path = hf_model(tmp_path, 9)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=3, max_seq_len=24, buckets=(1, ))
    g = torch.Generator().manual_seed(9)
    ids, mask = random_prompts((4, 9, 1), g)
    greedy = engine.generate(ids, 24 - 9, attention_mask=mask)
    assert greedy.shape == (3, 24) and (engine.cache_rows, engine.cache_len) == (3, 24)
    for eos in (None, int(greedy[1, 11]), [int(greedy[2, 12]), int(greedy[0, 10])]):
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False, eos_token_id=eos)
        assert torch.equal(engine.generate(ids, 15, attention_mask=mask, eos_token_id=eos), want), eos
    one = ids[1:2]
    assert torch.equal(engine.generate(one, 15), hf.generate(one, max_new_tokens=15, do_sample=False))


def test_buckets_taken_once(tmp_path):
    """A bucket given twice is one bucket (else tune measures it twice)."""
    _, path = hf_model(tmp_path, 4)
    assert load(path, device="cpu", max_batch=4, max_seq_len=16, buckets=(2, 1, 2, 1)).buckets == (1, 2, 4)


def test_reserve(tmp_path):
    """reserve(batch, tokens) makes the cache that generate of that size makes, checked as generate checks."""
    _, path = hf_model(tmp_path, 4)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=16)
    for batch, tokens, match in ((5, 4, "largest batch bucket 4"), (1, 17, "max_seq_len 16"), (0, 4, "positive int")):
        with pytest.raises(ValueError, match=match):
            engine.reserve(batch, tokens)
    assert engine.cache is None
    engine.reserve(3, 16)
    cache = engine.cache
    engine.generate(torch.tensor([[1, 2], [3, 4], [5, 6]]), 14)
    assert engine.cache is cache and (engine.cache_rows, engine.cache_len) == (4, 16)


def test_generate_cli_tokenizer_without_pad_or_eos(tmp_path, capsys):
    """A tokenizer with neither pad nor EOS token (and no EOS in generation_config.json): the CLI pads the
    prompts itself (the tokenizer refuses to), one prompt or several, and prints the engine's greedy text."""
    from transformers import AutoTokenizer

    from turbomoe.generate import main
    out = byte_model(tmp_path)
    for name, keys in (("tokenizer_config.json", ("eos_token", "pad_token")),
                       ("generation_config.json", ("eos_token_id", "pad_token_id"))):
        cfg = json.load(open(os.path.join(out, name)))
        json.dump({k: v for k, v in cfg.items() if k not in keys}, open(os.path.join(out, name), "w"))
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.pad_token_id is None and tok.eos_token_id is None
    engine = load(out, device="cpu", max_batch=2, max_seq_len=16)
    capsys.readouterr()  # what loading printed (DeepSpeed's first import)
    for prompts in (["abc"], ["abc", "d"]):
        main([out, *[a for p in prompts for a in ("--prompt", p)], "--max-new-tokens", "4", "--device", "cpu"])
        ids, mask = left_padded([list(p.encode()) for p in prompts], pad=0)
        rows = engine.generate(ids, 4, attention_mask=mask)[:, ids.shape[1]:]
        assert capsys.readouterr().out == "".join(tok.decode(r, skip_special_tokens=True) + "\n" for r in rows)


def test_generate_cli_times_no_cache_remake(tmp_path, capsys, monkeypatch):
    """A run past the warm-up's cache slots: the cache is made before the timed calls, not again inside
    the last one (on CUDA that would recapture the decode graph inside the decode time)."""
    from turbomoe.generate import main
    from turbomoe.inference import Engine
    from turbomoe.inference import engine as engine_mod
    monkeypatch.setattr(engine_mod, "CACHE_SLOTS_STEP", 16)  # the warm-up's 3 + 2 tokens: 16 slots
    out = byte_model(tmp_path)
    calls, made = [], []
    allocate, generate = Engine._allocate, Engine.generate

    def counted_allocate(self, rows, slots):
        made.append((len(calls), self.cache_len))
        allocate(self, rows, slots)
        made[-1] = made[-1] + (self.cache_len, )

    def counted_generate(self, *args, **kw):
        calls.append(args[1])
        return generate(self, *args, **kw)
    monkeypatch.setattr(Engine, "_allocate", counted_allocate)
    monkeypatch.setattr(Engine, "generate", counted_generate)
    main([out, "--prompt", "abc", "--max-new-tokens", "40", "--device", "cpu"])
    assert calls == [2, 1, 40] and "tokens/s" in capsys.readouterr().err
    remade = [(call, before, after) for call, before, after in made if after != before]
    assert remade == [(0, 0, 48)], remade  # once, before the warm-up


def test_generate_cli_synchronises_the_engines_gpu(tmp_path, capsys, monkeypatch):
    """--device cuda:1 with cuda:0 current: the timing waits for cuda:1, where the engine runs (the
    engine makes its device current only inside generate). A GPU faked: the CPU engine, said to be on cuda:1."""
    import turbomoe.inference
    from turbomoe.generate import main
    out = byte_model(tmp_path)
    cpu = load(out, device="cpu", max_batch=1, max_seq_len=16)

    class OnCuda1:
        device = torch.device("cuda", 1)

        def __getattr__(self, name):
            return getattr(cpu, name)
    synced, generator = [], torch.Generator
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch, "Generator", lambda device=None: generator())  # greedy: never drawn from
    monkeypatch.setattr(turbomoe.inference, "load", lambda *args, **kw: OnCuda1())
    main([out, "--prompt", "abc", "--max-new-tokens", "3", "--device", "cuda:1"])
    assert "prefill" in capsys.readouterr().err
    assert len(synced) == 6, synced  # before and after each of the three timed calls
    assert all(d is not None and torch.device(d) == torch.device("cuda", 1) for d in synced), synced


def test_generate_cli_prints_nothing_after_a_rows_eos(tmp_path, capsys):
    """A row that stops before the others prints what it prints alone, up to its EOS: not the pad ids
    appended after it (here the EOS itself, which the tokenizer does not take for a special token)."""
    from transformers import AutoTokenizer

    from turbomoe.generate import main
    out = byte_model(tmp_path)
    name = os.path.join(out, "tokenizer_config.json")
    cfg = json.load(open(name))
    json.dump({k: v for k, v in cfg.items() if k not in ("eos_token", "pad_token")}, open(name, "w"))
    engine = load(out, device="cpu", max_batch=2, max_seq_len=16)
    ids, mask = left_padded([list(b"abc"), list(b"d")], pad=0)
    rows = engine.generate(ids, 6, attention_mask=mask)[:, 3:].tolist()
    eos = rows[0][1]  # row 0 stops at its second token, row 1 runs on
    assert eos not in rows[1] and eos < 256
    name = os.path.join(out, "generation_config.json")
    json.dump({**json.load(open(name)), "eos_token_id": eos, "pad_token_id": None}, open(name, "w"))
    tok = AutoTokenizer.from_pretrained(out)
    capsys.readouterr()  # what loading printed (DeepSpeed's first import)
    main([out, "--prompt", "abc", "--prompt", "d", "--max-new-tokens", "6", "--device", "cpu"])
    assert capsys.readouterr().out == tok.decode(rows[0][:2]) + "\n" + tok.decode(rows[1]) + "\n"
    main([out, "--prompt", "abc", "--max-new-tokens", "6", "--device", "cpu"])
    assert capsys.readouterr().out == tok.decode(rows[0][:2]) + "\n"


def test_generate_cli_chat(tmp_path, capsys):
    """--chat: each prompt a user turn (after --system's) through the tokenizer's chat template, with no
    special tokens added to what the template wrote; the printed text is the engine's greedy reply to
    those ids. Without a template, or --system without --chat: usage errors before the model loads."""
    from transformers import AutoTokenizer

    from turbomoe.generate import main
    out = byte_model(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([out, "--prompt", "hi", "--chat", "--device", "cpu"])
    assert e.value.code == 2 and "the tokenizer has no chat template" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([out, "--prompt", "hi", "--system", "be brief", "--device", "cpu"])
    assert e.value.code == 2 and "--system needs --chat" in capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    engine = load(out, device="cpu", max_batch=2, max_seq_len=64)
    capsys.readouterr()  # what loading printed (DeepSpeed's first import)
    for system, head in ((None, ""), ("be brief", "<system>be brief\n")):
        texts = [head + "<user>hi\n<assistant>", head + "<user>a longer one\n<assistant>"]
        ids, mask = left_padded([list(t.encode()) for t in texts], pad=256)
        rows = engine.generate(ids, 5, attention_mask=mask, eos_token_id=256, pad_token_id=256)[:, ids.shape[1]:]
        want = "".join(tok.decode(r[:next((i + 1 for i, t in enumerate(r.tolist()) if t == 256), len(r))],
                                  skip_special_tokens=True) + "\n" for r in rows)
        main([out, "--prompt", "hi", "--prompt", "a longer one", "--chat", "--max-new-tokens", "5", "--device", "cpu",
              *(("--system", system) if system else ())])
        assert capsys.readouterr().out == want


def test_generate_cli_chat_kwargs(tmp_path, capsys):
    """--chat-kwargs: a JSON object of the chat template's variables (Qwen3's enable_thinking), passed to
    apply_chat_template; not JSON, not an object, or without --chat: usage errors."""
    from transformers import AutoTokenizer

    from turbomoe.generate import main
    out = byte_model(tmp_path)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
                         "not enable_thinking %}<nothink>{% endif %}{% endif %}")
    tok.save_pretrained(out)
    engine = load(out, device="cpu", max_batch=1, max_seq_len=64)
    capsys.readouterr()
    for kwargs, tail in ((None, ""), ('{"enable_thinking": false}', "<nothink>"), ('{"enable_thinking": true}', "")):
        ids = torch.tensor([list(("<user>hi\n<assistant>" + tail).encode())])
        row = engine.generate(ids, 5, eos_token_id=256, pad_token_id=256)[0, ids.shape[1]:].tolist()
        want = tok.decode(row[:next((i + 1 for i, t in enumerate(row) if t == 256), len(row))], skip_special_tokens=True)
        main([out, "--prompt", "hi", "--chat", "--max-new-tokens", "5", "--device", "cpu",
              *(("--chat-kwargs", kwargs) if kwargs else ())])
        assert capsys.readouterr().out == want + "\n", kwargs
    for argv, message in ((["--chat", "--chat-kwargs", "{nope"], "not JSON"),
                          (["--chat", "--chat-kwargs", "[1]"], "a JSON object of the template's variables"),
                          (["--chat-kwargs", "{}"], "--chat-kwargs needs --chat")):
        with pytest.raises(SystemExit) as e:
            main([out, "--prompt", "hi", "--device", "cpu", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv

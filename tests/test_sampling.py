"""turbomoe.inference.sampling: the token a decode step chooses, against transformers' own logits
processors (RepetitionPenaltyLogitsProcessor, then TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, MinPLogitsWarper, as its generate chains them); Engine.generate's repetition penalty
against transformers' generate; generation_defaults and the CLI's decoding settings."""
import json
import os
import random
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_engine import hf_model, left_padded, random_prompts  # noqa: E402
from turbomoe.inference import generation_defaults, load  # noqa: E402
from turbomoe.inference.sampling import Sampling  # noqa: E402


def transformers_scores(logits_BV, prompt_BT, mask_BT, s: Sampling):
    """The scores transformers' generate samples from (or takes the argmax of), for the same settings."""
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    scores = logits_BV.clone()
    if s.repetition_penalty != 1:
        pad_lengths = mask_BT.int().argmax(1)  # as generate computes prompt_ignore_length
        scores = RepetitionPenaltyLogitsProcessor(s.repetition_penalty, pad_lengths)(prompt_BT, scores)
    if s.do_sample:
        chain = [TemperatureLogitsWarper(s.temperature)] if s.temperature != 1 else []
        chain += [TopKLogitsWarper(s.top_k)] if s.top_k else []
        chain += [TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []
        chain += [MinPLogitsWarper(s.min_p)] if s.min_p > 0 else []
        for warp in chain:
            scores = warp(prompt_BT, scores)
    return scores


def prompt_and_logits(g, B, T, V):
    """Left-padded prompts of random lengths (at least one token), padding holding real ids (ignored by
    the mask), and logits with a spread wide enough for the filters to cut."""
    lengths = torch.randint(1, T + 1, (B, ), generator=g)
    mask = torch.arange(T)[None, :] >= T - lengths[:, None]
    return torch.randint(0, V, (B, T), generator=g), mask, torch.randn(B, V, generator=g) * 3


SETTINGS = [dict(), dict(repetition_penalty=1.7), dict(repetition_penalty=0.6),
            dict(do_sample=True), dict(do_sample=True, temperature=0.7), dict(do_sample=True, top_k=5),
            dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95),  # Qwen3's generation_config.json
            dict(do_sample=True, temperature=1.3, top_p=0.8), dict(do_sample=True, min_p=0.1),
            dict(do_sample=True, top_k=12, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
            dict(do_sample=True, top_k=500)]  # above the vocabulary: off


def checked(**kw) -> Sampling:
    full = dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    return Sampling.checked(**{**full, **kw})


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "greedy")
def test_select_follows_transformers(kw):
    """Greedy: the argmax of transformers' processed scores, row by row. Sampling: 40,000 draws of one
    row's token fall on exactly the tokens transformers' scores keep, at their softmax's frequencies
    (within 6 standard deviations). The seen tokens include each chosen one afterwards."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    s = checked(**kw)
    V = 97
    prompt, mask, logits = prompt_and_logits(g, 5, 9, V)
    want = transformers_scores(logits, prompt, mask, s)
    if not s.do_sample:
        history = s.history(prompt, mask, 2)
        tok = s.select(logits.clone(), history)
        assert torch.equal(tok, want.argmax(-1)), seed
        if history is not None:
            assert torch.equal(history.ids_BL[:, -2], tok) and history.filled == prompt.shape[1] + 1
    else:
        N = 40_000
        row = random.randrange(5)
        history = s.history(prompt[row:row + 1].expand(N, -1), mask[row:row + 1].expand(N, -1), 1)
        tok = s.select(logits[row:row + 1].expand(N, -1), history, torch.Generator().manual_seed(seed))
        freq = torch.bincount(tok, minlength=V).double() / N
        p = want[row].double().softmax(-1)
        assert not ((freq > 0) & (p == 0)).any() and (freq[p > 20 / N] > 0).all(), seed  # e^-20: never missed
        assert ((freq - p).abs() <= 6 * (p * (1 - p) / N).sqrt() + 1e-4).all(), (seed, (freq - p).abs().max())
        if history is not None:
            assert torch.equal(history.ids_BL[:, -1], tok)


def test_penalty_ignores_padding_and_marks_new_tokens():
    """A token only in a row's left padding is not penalised; a token chosen is, at the next step."""
    V = 11
    s = checked(repetition_penalty=100.0)
    prompt = torch.tensor([[3, 3, 5], [4, 6, 7]])
    mask = torch.tensor([[False, False, True], [True, True, True]])
    history = s.history(prompt, mask, 3)
    assert history.ids_BL.tolist() == [[5, 5, 5, 5, 5, 5], [4, 6, 7, 7, 7, 7]]
    logits = torch.zeros(2, V)
    logits[:, 3] = 1.0  # row 0's padding token: kept
    logits[:, 5] = 2.0  # row 0's prompt token: 2 / 100
    before = logits.clone()
    assert s.select(logits, history).tolist() == [3, 5]
    assert torch.equal(logits, before)  # the caller's logits untouched
    # now row 0 has seen 3 (1 / 100) and 5 (2 / 100); row 1 has seen 5, not 3
    assert s.select(logits, history).tolist() == [5, 3]
    s.select(logits, history)
    with pytest.raises(ValueError, match="all 6 slots are filled"):
        s.select(logits, history)


@pytest.mark.parametrize("penalty", [1.8, 0.7])
def test_generate_repetition_penalty_equals_transformers(tmp_path, penalty):
    """Engine.generate's greedy tokens with a repetition penalty equal transformers' generate's, token for
    token, on a ragged left-padded batch (the padding ignored by both)."""
    hf, path = hf_model(tmp_path, 3)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)
    ids, mask = random_prompts((7, 3, 11), torch.Generator().manual_seed(random.randrange(1 << 30)))
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0,
                       repetition_penalty=penalty)
    got = engine.generate(ids, 14, attention_mask=mask, pad_token_id=0, repetition_penalty=penalty)
    assert torch.equal(got, want), (got, want)
    assert not torch.equal(got, engine.generate(ids, 14, attention_mask=mask, pad_token_id=0))  # it acted


def test_generate_min_new_tokens_equals_transformers(tmp_path):
    """min_new_tokens bars the EOS ids (those in the vocabulary) until that many new tokens, greedy or
    sampled, as transformers' generate does; rows still stop at EOS afterwards."""
    hf, path = hf_model(tmp_path, 5)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)
    ids, mask = random_prompts((6, 3, 8), torch.Generator().manual_seed(random.randrange(1 << 30)))
    free = engine.generate(ids, 12, attention_mask=mask, pad_token_id=0)
    T = ids.shape[1]
    eos = [int(free[0, T + 1]), int(free[2, T])]  # row 0 would stop at its second token, row 2 at its first
    for m in (0, 4, 20):
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                           eos_token_id=eos, min_new_tokens=m)
        got = engine.generate(ids, 12, attention_mask=mask, pad_token_id=0, eos_token_id=eos + [10 ** 6],
                              min_new_tokens=m)  # an id past the vocabulary barred by neither
        assert torch.equal(got, want), (m, got, want)
        early = torch.isin(got[:, T:T + max(m, 2)], torch.tensor(eos)).any()
        assert bool(early) == (m == 0)  # row 0's EOS at its second token, unless barred
    sampled = engine.generate(ids, 6, attention_mask=mask, do_sample=True, top_k=3, eos_token_id=eos, pad_token_id=0,
                              min_new_tokens=6, generator=torch.Generator().manual_seed(1))
    assert sampled.shape[1] == T + 6 and not torch.isin(sampled[:, T:], torch.tensor(eos)).any()
    with pytest.raises(ValueError, match="min_new_tokens must be an int >= 0"):
        engine.generate(ids, 2, min_new_tokens=-1)


def test_generate_num_return_sequences(tmp_path):
    """num_return_sequences n (sampled): [B x n, T + new], each prompt's n rows together, as transformers'
    generate; the same as sampling the repeated prompts; greedy refuses n > 1, as transformers does; the
    rows count against max_batch."""
    _, path = hf_model(tmp_path, 4)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=6, max_seq_len=48)
    ids, mask = random_prompts((6, 2), torch.Generator().manual_seed(random.randrange(1 << 30)))
    kw = dict(do_sample=True, top_k=5, temperature=1.5)
    out = engine.generate(ids, 8, attention_mask=mask, num_return_sequences=3, generator=torch.Generator().manual_seed(2),
                          **kw)
    assert out.shape == (6, ids.shape[1] + 8)
    assert torch.equal(out[:, :ids.shape[1]], ids.repeat_interleave(3, 0))
    same = engine.generate(ids.repeat_interleave(3, 0), 8, attention_mask=mask.repeat_interleave(3, 0),
                           generator=torch.Generator().manual_seed(2), **kw)
    assert torch.equal(out, same)
    assert len({tuple(r) for r in out[:3, ids.shape[1]:].tolist()}) > 1  # a prompt's samples differ
    with pytest.raises(ValueError, match="num_return_sequences 2 needs sampling"):
        engine.generate(ids, 2, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences must be an int >= 1, got 0"):
        engine.generate(ids, 2, do_sample=True, num_return_sequences=0)
    with pytest.raises(ValueError, match=r"max_batch=...\)\): 2 prompts x num_return_sequences 4"):
        engine.generate(ids, 2, do_sample=True, num_return_sequences=4)
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(2, "):  # the prompts'
        engine.generate(ids, 2, attention_mask=mask[:, 1:], do_sample=True, num_return_sequences=2)


def test_generate_sampling_settings(tmp_path):
    """top_k=1 and min_p=1 sample the greedy tokens; a seeded generator repeats a sampled run."""
    _, path = hf_model(tmp_path, 4)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)
    ids, mask = random_prompts((6, 2, 9), torch.Generator().manual_seed(random.randrange(1 << 30)))
    greedy = engine.generate(ids, 10, attention_mask=mask)
    for kw in (dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)):
        assert torch.equal(engine.generate(ids, 10, attention_mask=mask, do_sample=True, temperature=0.5, **kw), greedy)
    kw = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.1)
    a = engine.generate(ids, 10, attention_mask=mask, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(a, engine.generate(ids, 10, attention_mask=mask, generator=torch.Generator().manual_seed(7), **kw))


def test_generate_sampling_errors(tmp_path):
    """Bad settings are a ValueError naming the argument before anything runs; greedy decoding ignores
    the warpers' arguments (as transformers' does) but not the penalty."""
    _, path = hf_model(tmp_path, 2)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=2, max_seq_len=32)
    ids = torch.tensor([[1, 2, 3]])
    for kw, message in ((dict(top_k=-1), "top_k >= 0"), (dict(top_k=2.5), "top_k >= 0"), (dict(top_k=True), "top_k"),
                        (dict(min_p=1.5), "min_p <= 1"), (dict(min_p=float("nan")), "min_p"),
                        (dict(temperature=float("inf")), "finite temperature"), (dict(temperature=0), "temperature"),
                        (dict(top_p=0.0), "top_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                        (dict(repetition_penalty=float("nan")), "repetition_penalty")):
        with pytest.raises(ValueError, match=message):
            engine.generate(ids, 2, do_sample=True, **kw)
    assert engine.generate(ids, 2, top_k=-1, temperature=0).shape == (1, 5)
    with pytest.raises(ValueError, match="do_sample must be True or False, got 'False'"):  # a true string
        engine.generate(ids, 2, do_sample="False")
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine.generate(ids, 2, repetition_penalty=-1.0)
    assert engine.generate(ids, 2, do_sample=True, top_k=torch.tensor(3), temperature=torch.tensor(0.5)).shape == (1, 5)
    # None, as transformers' generate takes it: the argument's default (off)
    none = dict(temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None, min_new_tokens=None)
    g = [torch.Generator().manual_seed(3) for _ in range(2)]
    assert torch.equal(engine.generate(ids, 4, do_sample=True, generator=g[0], **none),
                       engine.generate(ids, 4, do_sample=True, generator=g[1]))


def test_generation_defaults(tmp_path):
    """A directory's generation_config.json as transformers' generate runs it: its values, transformers'
    defaults for the rest (no file: all defaults); values of the wrong kind name the file."""
    d = str(tmp_path)
    assert generation_defaults(d) == dict(do_sample=False, temperature=1.0, top_k=50, top_p=1.0, min_p=0.0,
                                          repetition_penalty=1.0, min_new_tokens=0, num_return_sequences=1)
    path = os.path.join(d, "generation_config.json")
    qwen3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
             "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": None, "transformers_version": "4.51.0"}
    json.dump(qwen3, open(path, "w"))
    assert generation_defaults(d) == dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, min_p=0.0,
                                          repetition_penalty=1.0, min_new_tokens=0, num_return_sequences=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing it does not implement
        generation_defaults(d)
    # settings of transformers' generate that turbomoe does not implement: named in a warning where on
    json.dump({**qwen3, "num_beams": 4, "typical_p": 0.9, "min_new_tokens": 0, "bad_words_ids": None,
               "guidance_scale": 1.0}, open(path, "w"))
    with pytest.warns(UserWarning, match="sets num_beams 4, typical_p 0.9: not implemented by turbomoe.inference"):
        assert generation_defaults(d)["top_k"] == 20
    json.dump({"do_sample": False, "penalty_alpha": 0.6, "typical_p": 0.5}, open(path, "w"))  # contrastive search
    with pytest.warns(UserWarning, match="sets penalty_alpha 0.6: not implemented"):  # typical_p: sampling only
        generation_defaults(d)
    json.dump({"do_sample": False, "temperature": 0.0}, open(path, "w"))  # greedy: the warpers' values unused
    assert generation_defaults(d)["temperature"] == 0.0
    for stored, message in (({"do_sample": "yes"}, "do_sample must be true or false"),
                            ({"do_sample": True, "top_k": 2.5}, "top_k"), ({"repetition_penalty": -1}, "repetition"),
                            ([1, 2], "holds a list")):
        json.dump(stored, open(path, "w"))
        with pytest.raises(ValueError, match=message) as e:
            generation_defaults(d)
        assert path in str(e.value)
    open(path, "w").write("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        generation_defaults(d)


def test_generate_cli_decodes_as_generation_config(tmp_path, capsys):
    """python -m turbomoe.generate follows generation_config.json's sampling (here top_k 1: the greedy
    text), says so, and --greedy, --sample and the flags override it."""
    from transformers import AutoTokenizer

    from turbomoe.data import ByteTokenizer
    from turbomoe.generate import main
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 6, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out = os.path.join(tmp_path, "bytes")
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    engine = load(out, device="cpu", max_seq_len=16, max_batch=1)
    engine_of_3 = load(out, device="cpu", max_seq_len=16, max_batch=3)  # the CLI's engine is sized by the rows
    tok = AutoTokenizer.from_pretrained(out)
    prompt = torch.tensor([[104, 105]])  # "hi"

    def text(**kw):
        ids = engine.generate(prompt, 6, eos_token_id=256, pad_token_id=256, **kw)[0, 2:]
        return tok.decode(ids, skip_special_tokens=True) + "\n"

    config_path = os.path.join(out, "generation_config.json")
    config = json.load(open(config_path))
    json.dump({**config, "do_sample": True, "temperature": 0.6, "top_k": 1}, open(config_path, "w"))
    capsys.readouterr()
    argv = [out, "--prompt", "hi", "--max-new-tokens", "6", "--device", "cpu"]
    main(argv)
    printed = capsys.readouterr()
    assert printed.out == text() and "decoding: sampling, temperature 0.6, top_k 1\n" in printed.err
    main(argv + ["--greedy", "--repetition-penalty", "1.5", "--min-new-tokens", "3"])
    printed = capsys.readouterr()
    assert printed.out == text(repetition_penalty=1.5, min_new_tokens=3)
    assert "decoding: greedy, repetition_penalty 1.5, min_new_tokens 3\n" in printed.err
    main(argv + ["--top-k", "0", "--top-p", "0.9", "--seed", "4"])  # generation_config.json's sampling, top-k off
    printed = capsys.readouterr()
    want = text(do_sample=True, temperature=0.6, top_p=0.9, generator=torch.Generator().manual_seed(4))
    assert printed.out == want and "decoding: sampling, temperature 0.6, top_p 0.9\n" in printed.err
    # three samples of the prompt: three lines, what the engine gives the prompt repeated
    main(argv + ["--top-k", "0", "--top-p", "0.9", "--seed", "4", "--num-return-sequences", "3"])
    printed = capsys.readouterr()
    rows = engine_of_3.generate(prompt, 6, eos_token_id=256, pad_token_id=256, do_sample=True, temperature=0.6,
                                top_p=0.9, num_return_sequences=3, generator=torch.Generator().manual_seed(4))[:, 2:]
    lines = [tok.decode(r[:next((i + 1 for i, t in enumerate(r.tolist()) if t == 256), len(r))],
                        skip_special_tokens=True) for r in rows]
    assert printed.out == "".join(line + "\n" for line in lines) and "num_return_sequences 3" in printed.err
    json.dump({**config, "do_sample": True, "temperature": 0.6, "top_k": 1, "no_repeat_ngram_size": 3},
              open(config_path, "w"))
    main(argv)
    printed = capsys.readouterr()
    assert printed.out == text() and "sets no_repeat_ngram_size 3: not implemented" in printed.err
    for extra, message in ((["--min-p", "2"], "min_p <= 1"), (["--greedy", "--sample"], "not allowed with"),
                           (["--num-return-sequences", "2", "--stream"], "--stream prints one row's text"),
                           (["--greedy", "--num-return-sequences", "2"], "needs sampling")):
        with pytest.raises(SystemExit) as e:
            main(argv + extra)
        assert e.value.code == 2 and message in capsys.readouterr().err
    json.dump({**config, "do_sample": True, "top_p": 0}, open(config_path, "w"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "generation_config.json: sampling needs 0 < top_p" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampling(tmp_path):
    """On the GPU (CUDA-graph decode): the penalised greedy tokens, and those with EOS barred for
    min_new_tokens, are the CPU path's in fp32; a seeded
    CUDA generator repeats a sampled run; top_k=1 samples the greedy tokens; the token choice makes no
    host sync."""
    _, path = hf_model(tmp_path, 3)
    cpu = load(path, device="cpu", dtype=torch.float32, max_batch=8, max_seq_len=48)
    gpu = load(path, device="cuda", dtype=torch.float32, max_batch=8, max_seq_len=48)
    ids, mask = random_prompts((7, 3, 11, 5), torch.Generator().manual_seed(random.randrange(1 << 30)))
    want = cpu.generate(ids, 14, attention_mask=mask, repetition_penalty=1.8)
    assert torch.equal(gpu.generate(ids, 14, attention_mask=mask, repetition_penalty=1.8).cpu(), want)
    eos = [int(want[0, ids.shape[1] + 1])]  # EOS barred for 5 steps, then stopping: the CPU path's tokens
    want = cpu.generate(ids, 14, attention_mask=mask, eos_token_id=eos, pad_token_id=0, min_new_tokens=5)
    assert torch.equal(gpu.generate(ids, 14, attention_mask=mask, eos_token_id=eos, pad_token_id=0,
                                    min_new_tokens=5).cpu(), want)
    kw = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.1)
    runs = [gpu.generate(ids, 14, attention_mask=mask, generator=torch.Generator(device).manual_seed(5), **kw)
            for device in ("cuda", "cuda:0")]  # with an index or without
    assert torch.equal(*runs)
    greedy = gpu.generate(ids, 14, attention_mask=mask)
    assert torch.equal(gpu.generate(ids, 14, attention_mask=mask, do_sample=True, top_k=1), greedy)
    assert gpu.graphs
    s = checked(**kw)
    prompt, pmask, logits = prompt_and_logits(torch.Generator().manual_seed(0), 8, 16, 1000)
    history = s.history(prompt.cuda(), pmask.cuda(), 4)
    logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s.select(logits, history)
        checked(top_p=0.9, do_sample=True).select(logits)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_cli_eos_ids_where_transformers_finds_them(tmp_path):
    """The CLI stops at generation_config.json's EOS ids, without that file at config.json's (as
    transformers' generate), then at the tokenizer's; each once."""
    from types import SimpleNamespace

    from turbomoe.generate import eos_ids
    from turbomoe.inference.sampling import generation_file
    tok = SimpleNamespace(eos_token_id=9)
    d = str(tmp_path)
    json.dump({"eos_token_id": [5, 9], "model_type": "qwen3_moe"}, open(os.path.join(d, "config.json"), "w"))
    assert eos_ids(*generation_file(d), tok) == [5, 9]
    json.dump({"eos_token_id": 7}, open(os.path.join(d, "generation_config.json"), "w"))
    assert eos_ids(*generation_file(d), tok) == [7, 9]
    with pytest.raises(FileNotFoundError, match="none is not a directory"):
        eos_ids(*generation_file(str(tmp_path / "none")), tok)
    json.dump({"eos_token_id": "7"}, open(os.path.join(d, "generation_config.json"), "w"))
    with pytest.raises(ValueError, match="generation_config.json's eos_token_id must be a token id"):
        eos_ids(*generation_file(d), tok)  # the CLI turns it into a usage error before the model loads

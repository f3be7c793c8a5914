"""turbomoe.inference.load / Engine.generate on the CPU (the reference path): greedy tokens equal to
transformers' generate, token for token, on random tiny Qwen3-MoE models saved by transformers
(ragged left-padded batches, EOS per row), and the engine's errors."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from turbomoe.inference import load  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest.one_thread


def hf_model(tmp_path, seed, **over):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = dict(vocab_size=101, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2,
               norm_topk_prob=True, max_position_embeddings=64, initializer_range=0.3, mlp_only_layers=[1],
               rope_theta=10000.0, tie_word_embeddings=False)
    cfg.update(over)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()
    path = os.path.join(tmp_path, f"model{seed}")
    model.save_pretrained(path)
    return model, path


def left_padded(rows, pad):
    T = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def random_prompts(lengths, g):
    """ids, mask of random prompts of these lengths (ids below the tiny models' vocabulary), left-padded with 0."""
    return left_padded([torch.randint(0, 101, (n, ), generator=g).tolist() for n in lengths], pad=0)


@pytest.mark.parametrize("seed,over", [(0, {}), (1, dict(norm_topk_prob=False, num_experts_per_tok=1,
                                                         mlp_only_layers=[], tie_word_embeddings=True))])
def test_greedy_equals_transformers(tmp_path, seed, over):
    hf, path = hf_model(tmp_path, seed, **over)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 101, (n, ), generator=g).tolist() for n in (7, 3, 11)]
    ids, mask = left_padded(rows, pad=0)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = engine.generate(ids, 12, attention_mask=mask, pad_token_id=0)
    assert torch.equal(got, want), (got, want)
    # single rows, unpadded, through the same (reused) cache
    for r in rows[:2]:
        one = torch.tensor([r])
        assert torch.equal(engine.generate(one, 9), hf.generate(one, max_new_tokens=9, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("compile", [False, True])
def test_attention_biases_and_one_qkv_copy(tmp_path, compile):
    """q/k/v biases (attention_bias, random here: transformers makes them zero) go through the engine's
    stacked q/k/v GEMM as transformers adds them, compiled or not; the model's q/k/v weights and biases
    become views of the stack (one copy in memory), and keep_model=True leaves them the model's own."""
    from transformers import Qwen3MoeForCausalLM as HF

    from turbomoe.inference import Engine
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 8, attention_bias=True)
    hf = HF.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(9)
    for layer in hf.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(path)
    ids, mask = random_prompts((6, 2, 9), torch.Generator().manual_seed(8))
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = Engine(model, max_batch=4, max_seq_len=32, compile=compile)
    assert torch.equal(engine.generate(ids, 10, attention_mask=mask, pad_token_id=0), want)
    for attn, (w, b) in zip((layer.self_attn for layer in model.model.layers), engine.qkv):
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            for t, whole in ((proj.weight, w), (proj.bias, b)):
                assert t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    kept = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = Engine(kept, max_batch=4, max_seq_len=32, keep_model=True, compile=compile)
    assert torch.equal(engine.generate(ids, 10, attention_mask=mask, pad_token_id=0), want)
    q = kept.model.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() != engine.qkv[0][0].untyped_storage().data_ptr()


@pytest.mark.parametrize("prefill_tokens", [1, 7, 20])
def test_prefill_in_passes_equals_transformers(tmp_path, prefill_tokens):
    """A prompt prefilled a few columns a pass (prefill_tokens // B, at least one): the same greedy
    tokens as transformers', passes that split the padding and the prompts alike; no pass attends
    over more than its columns x the keys so far (the mask was [B, T, T] in one pass)."""
    hf, path = hf_model(tmp_path, 3)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48, prefill_tokens=prefill_tokens)
    ids, mask = random_prompts((13, 4, 9), torch.Generator().manual_seed(prefill_tokens))
    passes = []
    forward = engine._forward

    def spy(x_BTH, pos_BT, slots_T, mask_B1TL, L, head=True, **kw):
        passes.append((x_BTH.shape[1], tuple(mask_B1TL.shape), L, head))
        return forward(x_BTH, pos_BT, slots_T, mask_B1TL, L, head, **kw)

    engine._forward = spy
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = engine.generate(ids, 8, attention_mask=mask, pad_token_id=0)
    assert torch.equal(got, want), (got, want)
    step = max(1, prefill_tokens // 3)
    prefill = passes[:-(8 - 1)]  # then one decode step per new token after the first
    assert [p[0] for p in prefill] == [min(step, 13 - c0) for c0 in range(0, 13, step)]
    assert all(m == (3, 1, t, L) and L == min(13, c0 + t) for (t, m, L, _), c0 in zip(prefill, range(0, 13, step)))
    assert [p[3] for p in prefill] == [False] * (len(prefill) - 1) + [True]  # logits of the last pass only
    with pytest.raises(ValueError, match="prefill_tokens must be a positive int"):
        load(path, device="cpu", prefill_tokens=0)
    with pytest.raises(ValueError, match="compile must be True, False or None"):
        load(path, device="cpu", compile="no")


def test_compiled_decode_equals_transformers(tmp_path):
    """compile=True (CUDA's default): a decode step's dense parts through torch.compile give
    transformers' greedy tokens in fp32 over batch buckets 4, 1, 8 and 2, with no graph break; once
    a batch size above 1 has changed, the graphs are dynamic in it: bucket 2 compiles nothing new
    (nor does a layer: all share the graphs)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    hf, path = hf_model(tmp_path, 4)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=8, max_seq_len=48, compile=True)
    g = torch.Generator().manual_seed(4)
    graphs = []
    for lengths in ((7, 3, 11), (5, ), (2, 9, 4, 8, 6), (6, 10)):
        ids, mask = random_prompts(lengths, g)
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        got = engine.generate(ids, 10, attention_mask=mask, pad_token_id=0)
        assert torch.equal(got, want), (lengths, got, want)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] > 0 and graphs[3] == graphs[2], graphs
    torch._dynamo.reset()


def test_compiled_engines_of_other_models_in_one_process(tmp_path, caplog):
    """Engines of three model shapes in one process (a draft model beside a target, say), each called
    in and out of inference_mode: their compiled parts stay within dynamo's recompile limit (they
    shared one cache, hit it at the second model and ran eager past it), and give transformers'
    tokens."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    for seed, over in [(0, {}), (1, dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8)),
                       (2, dict(hidden_size=40, mlp_only_layers=[]))]:
        hf, path = hf_model(tmp_path, seed, **over)
        engine = load(path, device="cpu", dtype=torch.float32, max_batch=8, max_seq_len=48, compile=True)
        for lengths in ((7, 3, 11), (5, )):
            ids, mask = random_prompts(lengths, g)
            want = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
            with torch.inference_mode():
                assert torch.equal(engine.generate(ids, 6, attention_mask=mask, pad_token_id=0), want)
            assert torch.equal(engine.generate(ids, 6, attention_mask=mask, pad_token_id=0), want)
    assert "recompile_limit" not in caplog.text
    torch._dynamo.reset()


def test_eos_per_row_equals_transformers(tmp_path):
    hf, path = hf_model(tmp_path, 2)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)
    ids, mask = left_padded([[5, 6, 7, 8], [9, 10], [11, 12, 13]], pad=0)
    greedy = engine.generate(ids, 10, attention_mask=mask)
    eos = int(greedy[1, ids.shape[1] + 2])  # a token row 1 emits at its third step: it stops there
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = engine.generate(ids, 10, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want), (got, want)


class Recorder:
    def __init__(self, fail_at=None):
        self.puts, self.ends, self.fail_at = [], 0, fail_at

    def put(self, tokens):
        assert tokens.device.type == "cpu"
        self.puts.append(tokens.clone())
        if len(self.puts) == self.fail_at:
            raise RuntimeError("the consumer went away")

    def end(self):
        self.ends += 1


def test_streamer_gets_the_prompt_then_each_step(tmp_path, capsys):
    """streamer (transformers' protocol): put(the prompt), put(each step's tokens) as made, end() once,
    after an early stop at EOS and after an error too; the tokens are generate's. transformers'
    TextStreamer prints generate's text. Not a streamer: a TypeError before anything is made."""
    _, path = hf_model(tmp_path, 2)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)
    ids, mask = left_padded([[5, 6, 7, 8], [9, 10], [11, 12, 13]], pad=0)
    want = engine.generate(ids, 10, attention_mask=mask)
    eos = int(want[1, ids.shape[1] + 2])
    for kw in ({}, dict(eos_token_id=eos, pad_token_id=0)):
        rec = Recorder()
        got = engine.generate(ids, 10, attention_mask=mask, streamer=rec, **kw)
        assert torch.equal(got, engine.generate(ids, 10, attention_mask=mask, **kw)) and rec.ends == 1
        assert torch.equal(torch.cat([rec.puts[0]] + [t[:, None] for t in rec.puts[1:]], 1), got)
    rec = Recorder(fail_at=3)
    with pytest.raises(RuntimeError, match="the consumer went away"):
        engine.generate(ids, 10, attention_mask=mask, streamer=rec)
    assert rec.ends == 1
    from turbomoe.data import ByteTokenizer
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 5, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out = os.path.join(tmp_path, "bytes")
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    engine = load(out, device="cpu", max_seq_len=40, max_batch=1)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = torch.tensor([tok("def f(x):")["input_ids"]])
    capsys.readouterr()
    got = engine.generate(prompt, 24, streamer=transformers.TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    assert capsys.readouterr().out == tok.decode(got[0, prompt.shape[1]:], skip_special_tokens=True) + "\n"
    with pytest.raises(TypeError, match="streamer must have put"):
        engine.generate(prompt, 4, streamer=print)


def test_mask_inferred_from_pad_token_id_as_transformers(tmp_path):
    """Without attention_mask, an explicit pad_token_id that is no EOS and occurs in the prompt marks the
    padding (transformers' generate rule); a pad id that is an EOS, or absent, leaves every token real."""
    hf, path = hf_model(tmp_path, 2)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)
    ids, mask = left_padded([[5, 6, 7, 8], [9, 10], [11, 12, 13]], pad=0)
    want = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = engine.generate(ids, 8, pad_token_id=0)
    assert torch.equal(got, want) and torch.equal(got, engine.generate(ids, 8, attention_mask=mask)), (got, want)
    eos = int(want[0, -1])  # a pad that is an EOS: no mask inferred
    assert torch.equal(engine.generate(ids, 8, pad_token_id=0, eos_token_id=[eos, 0]),
                       hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=[eos, 0]))
    with pytest.raises(ValueError, match="inferred from pad_token_id 0 in input_ids .* pass attention_mask"):
        engine.generate(torch.tensor([[5, 0, 6]]), 2, pad_token_id=0)


def test_sampling_is_seeded_and_in_vocab(tmp_path):
    _, path = hf_model(tmp_path, 3)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=2, max_seq_len=32)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    a = engine.generate(ids, 8, do_sample=True, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(0))
    b = engine.generate(ids, 8, do_sample=True, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (2, 11) and int(a.max()) < 101 and torch.equal(a[:, :3], ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_generator_on_another_device(tmp_path):
    """A CPU generator for a CUDA engine: a ValueError naming both devices before the prefill (torch's
    multinomial refused it after), and nothing made; greedy decoding ignores the generator."""
    _, path = hf_model(tmp_path, 3)
    engine = load(path, device="cuda", dtype=torch.float32, max_batch=2, max_seq_len=32)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="generator is on cpu; sampling runs on the engine's device cuda"):
        engine.generate(ids, 4, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert engine.cache is None
    engine.generate(ids, 4, generator=torch.Generator())
    out = engine.generate(ids, 4, do_sample=True, generator=torch.Generator(device=engine.device).manual_seed(0))
    assert out.shape == (1, 7)


def test_engine_errors(tmp_path, monkeypatch):
    hf, path = hf_model(tmp_path, 4)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=2, max_seq_len=16)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="exceeds the KV cache's max_seq_len 16"):
        engine.generate(torch.ones(1, 10, dtype=torch.long), 7)
    assert engine.cache is None  # nothing allocated by a call that failed its checks
    with pytest.raises(ValueError, match="largest batch bucket 2"):
        engine.generate(torch.ones(3, 2, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="left padding"):
        engine.generate(ids, 2, attention_mask=torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(ids, 0)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(ids, 2, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got True"):
        engine.generate(ids, True)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size 101\), got ids from -1 to 3"):
        engine.generate(torch.tensor([[1, -1, 3]]), 2)
    with pytest.raises(ValueError, match="got ids from 1 to 101"):
        engine.generate(torch.tensor([[1, 101]]), 2)
    with pytest.raises(ValueError, match="pad_token_id must be one id below vocab_size 101"):
        engine.generate(ids, 2, pad_token_id=101)
    with pytest.raises(ValueError, match="eos_token_id must be a token id or a list of them"):
        engine.generate(ids, 2, eos_token_id="7")
    for raw in (b"7", bytearray(b"7")):  # bytes iterate as ints: b"7" is not id 55
        with pytest.raises(ValueError, match="eos_token_id must be a token id or a list of them"):
            engine.generate(ids, 2, eos_token_id=raw)
        with pytest.raises(ValueError, match="pad_token_id must be a token id or a list of them"):
            engine.generate(ids, 2, eos_token_id=7, pad_token_id=raw)
    with pytest.raises(ValueError, match="attention_mask must be a tensor"):
        engine.generate(ids, 2, attention_mask=[[1, 1, 1]])
    # the default pad (a finished row's next input) is the first EOS id: one past the vocabulary is refused
    # up front, not an index error once a row stops
    with pytest.raises(ValueError, match="the default is eos_token_id's first id, 101: pass pad_token_id"):
        engine.generate(ids, 2, eos_token_id=[101, 5])
    with pytest.raises(ValueError, match="sampling needs a finite temperature > 0"):
        engine.generate(ids, 2, do_sample=True, temperature="hot")
    with pytest.raises(ValueError, match="at least one row and one token per row, got shape"):
        engine.generate(torch.ones(0, 3, dtype=torch.long), 2)
    for dtype in (torch.bool, torch.float32):
        with pytest.raises(ValueError, match=f"input_ids must be an integer tensor \\[B, T\\], got a {dtype}"):
            engine.generate(ids.to(dtype), 2)
    assert engine.cache is None
    want = engine.generate(ids, 3)
    for dtype in (torch.int16, torch.uint8, torch.int32):  # any integer ids, taken as int64
        assert torch.equal(engine.generate(ids.to(dtype), 3), want), dtype
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['max_bach'\]"):
        load(path, device="cpu", max_bach=2)
    # The checkpoint fixes the routing: options that would change it are refused, not silently applied.
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['prescale', 'score_func'\]"):
        load(path, device="cpu", score_func="sigmoid", prescale=True)
    # The MoE options are checked before the checkpoint is read: a directory holding only config.json.
    bare = tmp_path / "config_only"
    bare.mkdir()
    (bare / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="mode 'few_rows' runs Triton kernels: it needs CUDA tensors"):
        load(str(bare), device="cpu", mode="few_rows")
    for bad, match in ((dict(backend="bogus"), "backend must be one of"),
                       (dict(gmm_backend="bogus"), "gmm_backend must be one of"),
                       (dict(few_rows_per_expert=-1), "few_rows_per_expert must be a non-negative int, got -1"),
                       (dict(dense_max="8"), "dense_max must be a non-negative int, got '8'")):
        with pytest.raises(ValueError, match=match):
            load(str(bare), device="cpu", **bad)
    with pytest.raises(ValueError, match="tune measures the few-rows kernels on a GPU; device is cpu"):
        load(path, device="cpu", tune=True)  # refused before the checkpoint is read
    with pytest.raises(ValueError, match=r"few_rows_tiles\[8\]: invalid tiling"):
        load(path, device="cpu", few_rows_tiles={8: ((16, 24, 1, 64, 4, 2), (16, 64, 1, 64, 4, 2))})
    # a tile table set on the engine reaches every MoE layer; a bad one changes nothing
    engine.few_rows_tiles = {"4": [None, None]}
    assert engine.few_rows_tiles == {4: (None, None)}
    assert engine.moes and all(m.few_rows_tiles == {4: (None, None)} for m in engine.moes.values())
    with pytest.raises(ValueError, match=r"few_rows_tiles\[2\]: invalid tiling"):
        engine.few_rows_tiles = {2: ((16, 48, 1, 64, 4, 2), None)}
    assert all(m.few_rows_tiles == {4: (None, None)} for m in engine.moes.values())
    # eos as a numpy integer, a 0-d or 1-d tensor or a tuple: the same stops as a list
    eos = int(engine.generate(ids, 3)[0, 4])
    want = engine.generate(ids, 6, eos_token_id=[eos])
    for form in (np.int64(eos), torch.tensor(eos), torch.tensor([eos]), (eos, )):
        assert torch.equal(engine.generate(ids, 6, eos_token_id=form), want), form
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load(path, device="cpu", max_seq_len=65)
    for bad in (dict(max_seq_len=0), dict(max_batch=0), dict(max_batch=-1), dict(buckets=(0, 2)), dict(buckets=4),
                dict(max_batch=2.0)):
        with pytest.raises(ValueError, match="positive int"):
            load(path, device="cpu", **bad)
    # numpy ints and an iterator of buckets: Python ints (the tune's token counts), every bucket kept
    from turbomoe.inference.tiling import check_token_counts
    engine = load(path, device="cpu", max_batch=np.int64(4), max_seq_len=np.int64(16), buckets=iter([np.int32(1), 2]))
    assert engine.buckets == (1, 2, 4) and check_token_counts(engine.buckets) == [1, 2, 4]
    assert type(engine.max_seq_len) is int
    # transformers' model of the same class name: refused, pointing to load
    from turbomoe.inference import Engine
    with pytest.raises(TypeError, match="turbomoe's Qwen3MoeForCausalLM .* turbomoe.inference.load"):
        Engine(hf, max_batch=1, max_seq_len=16)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["model_type"] = "llama"
    other = os.path.join(tmp_path, "llama")
    os.makedirs(other)
    json.dump(cfg, open(os.path.join(other, "config.json"), "w"))
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        load(other, device="cpu")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(str(tmp_path), device="cpu")


def test_max_new_tokens_a_small_numpy_int(tmp_path):
    """max_new_tokens of any integer type, taken as a Python int: a numpy int8's prompt length + max_new_tokens
    wrapped past the max_seq_len check (then an OverflowError), a uint8's overflowed at the cache's 256 slots."""
    _, path = hf_model(tmp_path, 4)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=1, max_seq_len=16)
    with pytest.raises(ValueError, match=r"prompt length 30 \+ max_new_tokens 100 exceeds the KV cache's max_seq_len"):
        engine.generate(torch.ones(1, 30, dtype=torch.long), np.int8(100))
    assert engine.cache is None
    ids = torch.tensor([[1, 2, 3]])
    want = engine.generate(ids, 4, repetition_penalty=1.5)
    for n in (np.uint8(4), np.int8(4), torch.tensor(4)):
        assert torch.equal(engine.generate(ids, n, repetition_penalty=1.5), want), n


def test_load_in_an_fp8_dtype_is_named(tmp_path):
    """load(dtype=torch.float8_e4m3fn), say for an FP8 checkpoint: a TypeError naming the dtypes the engine
    computes in, not torch.set_default_dtype's "couldn't find storage object Float8_e4m3fnStorage"."""
    _, path = hf_model(tmp_path, 4)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        with pytest.raises(TypeError, match=r"dtype must be .* \(float16, bfloat16, float32 or float64; FP8 "
                                            r"checkpoints are dequantized to it\), got torch.float8"):
            load(path, device="cpu", dtype=dtype)
    assert torch.get_default_dtype() == torch.float32


def test_cache_made_as_calls_need_it(tmp_path, monkeypatch):
    """The KV cache holds the batch's bucket and prompt + new tokens rounded up to CACHE_SLOTS_STEP
    (at most max_batch x max_seq_len), and is made again larger when a call needs more: the tokens stay
    transformers' through every size."""
    from turbomoe.inference import engine as engine_mod
    monkeypatch.setattr(engine_mod, "CACHE_SLOTS_STEP", 16)
    hf, path = hf_model(tmp_path, 6)
    engine = load(path, device="cpu", dtype=torch.float32, max_batch=8)  # max_seq_len: the model's 64
    g = torch.Generator().manual_seed(6)
    for lengths, new, size in (((3, ), 5, (1, 16)), ((11, 4, 7), 12, (4, 32)), ((5, ), 4, (4, 32)),
                               ((20, 9), 30, (4, 64))):
        ids, mask = random_prompts(lengths, g)
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
        assert torch.equal(engine.generate(ids, new, attention_mask=mask, pad_token_id=0), want), lengths
        assert (engine.cache_rows, engine.cache_len) == size
        assert engine.cache[0][0].shape == (size[0], 2, size[1], 12)


def test_engine_takes_the_models_experts(tmp_path):
    """Engine(model) moves the MoE blocks into the engine (one copy of the experts): the model then
    says so when used, saved or wrapped again, instead of failing obscurely or saving a checkpoint
    without its experts; keep_model=True leaves it whole."""
    from turbomoe.inference import Engine
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 5)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    kept = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    logits = kept(ids).logits
    want = Engine(kept, max_batch=1, max_seq_len=16, keep_model=True).generate(ids, 6)
    assert torch.equal(kept(ids).logits, logits)
    kept.save_pretrained(str(tmp_path / "kept"))
    assert torch.equal(Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "kept"), dtype=torch.float32)(ids).logits,
                       logits)
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = Engine(model, max_batch=1, max_seq_len=16)
    assert torch.equal(engine.generate(ids, 6), want)
    for use in (lambda: model(ids), lambda: model.save_pretrained(str(tmp_path / "moved")),
                lambda: Engine(model, max_batch=1, max_seq_len=16), lambda: model.load_hf_weights(path)):
        with pytest.raises(RuntimeError, match="handed to a turbomoe.inference.Engine"):
            use()
    assert not (tmp_path / "moved").exists()


def test_generate_cli(tmp_path, capsys):
    """python -m turbomoe.generate on a directory with the byte tokenizer (turbomoe's save_pretrained):
    the printed text is the decoded greedy continuation of the engine."""
    from turbomoe.generate import main
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 5, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out = os.path.join(tmp_path, "bytes")
    from turbomoe.data import ByteTokenizer
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    engine = load(out, device="cpu", max_seq_len=8, max_batch=1)
    capsys.readouterr()  # what loading printed where this process had not used DeepSpeed yet (its first warning)
    main([out, "--prompt", "abc", "--max-new-tokens", "5", "--device", "cpu"])
    printed = capsys.readouterr()
    ids = engine.generate(torch.tensor([[97, 98, 99]]), 5, eos_token_id=256, pad_token_id=256)[0, 3:]
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(out).decode(ids, skip_special_tokens=True)
    assert printed.out == text + "\n", (printed.out, text)
    # stdout holds the text alone in a process of its own too, where DeepSpeed is first imported (and warns)
    run = subprocess.run([sys.executable, "-m", "turbomoe.generate", out, "--prompt", "abc", "--max-new-tokens", "5",
                          "--device", "cpu"], capture_output=True, check=True)
    assert run.stdout == (text + "\n").encode(), (run.stdout, text)
    assert "prefill" in printed.err and ("tokens/s" in printed.err or "too short to time" in printed.err)
    main([out, "--prompt", "abc", "--max-new-tokens", "5", "--device", "cpu", "--stream"])  # the same text, streamed
    printed = capsys.readouterr()
    assert printed.out == text + "\n" and "streamed" in printed.err, (printed.out, text)
    # Bad arguments: usage errors naming the problem, before anything loads.
    for argv, message in (([str(tmp_path / "nope"), "--prompt", "a"], "nope is not a Hugging Face model directory"),
                          ([out, "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
                          ([out, "--prompt", ""], "--prompt must not be empty"),
                          ([out, "--prompt", "a", "--prompt", "b", "--stream"], "--stream prints one prompt's text"),
                          ([out, "--prompt", "a", "--sample", "--temperature", "0"], "sampling needs a finite temperature > 0, got 0.0: "
                           "--temperature 0.0, --top-k 50"),
                          ([out, "--prompt", "a", "--device", "cpu", "--tune"], "--tune and --tiles choose the GPU"),
                          ([out, "--prompt", "a", "--device", "cpu", "--tiles", str(tmp_path / "t.json")],
                           "the device is cpu"),
                          ([out, "--prompt", "a", "--device", "bogus"], "--device must be cpu, cuda or cuda:N"),
                          ([out, "--prompt", "a", "--device", "cuda" if not torch.cuda.is_available() else "cuda:99"],
                           "--device cuda"),
                          ([out, "--prompt", "a", "--tune", "--tiles", str(tmp_path / "nodir" / "t.json")],
                           "nodir does not exist or is not writable")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    # A directory without tokenizer files (transformers' save_pretrained): a usage error, not an empty prompt.
    with pytest.raises(SystemExit) as e:
        main([path, "--prompt", "a"])
    assert e.value.code == 2 and "has no tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([out, "--prompt", "abc", "--max-new-tokens", "62"])
    assert e.value.code == 2 and "exceeds the model's max_position_embeddings 64" in capsys.readouterr().err
    # It stops at generation_config.json's EOS ids too (chat models list more than the tokenizer's one).
    config = json.load(open(os.path.join(out, "generation_config.json")))
    stops = [256, int(ids[1])]
    json.dump({**config, "eos_token_id": stops}, open(os.path.join(out, "generation_config.json"), "w"))
    main([out, "--prompt", "abc", "--max-new-tokens", "5", "--device", "cpu"])
    last = next(i for i, t in enumerate(ids.tolist()) if t in stops)
    text = AutoTokenizer.from_pretrained(out).decode(ids[:last + 1], skip_special_tokens=True)
    assert capsys.readouterr().out == text + "\n"
    # Sampling prints what a generator seeded --seed gives (the warm-up calls take generators of their own),
    # with transformers' top-k 50 where generation_config.json sets none, and says how it decoded.
    main([out, "--prompt", "abc", "--max-new-tokens", "5", "--device", "cpu", "--sample", "--seed", "3"])
    sampled = engine.generate(torch.tensor([[97, 98, 99]]), 5, do_sample=True, top_k=50, eos_token_id=stops,
                              pad_token_id=256, generator=torch.Generator().manual_seed(3))[0, 3:]
    text = AutoTokenizer.from_pretrained(out).decode(sampled, skip_special_tokens=True)
    printed = capsys.readouterr()
    assert printed.out == text + "\n" and "decoding: sampling, temperature 1.0, top_k 50\n" in printed.err


def test_generate_cli_tile_file_unwritable(tmp_path, capsys, monkeypatch):
    """--tune --tiles FILE whose folder goes away during the load and tune: a usage error saying that FILE
    could not be written, not a traceback (a GPU faked: the engine is the CPU's)."""
    import shutil

    import turbomoe.inference
    from turbomoe.data import ByteTokenizer
    from turbomoe.generate import main
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 5, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out, folder = os.path.join(tmp_path, "bytes"), tmp_path / "tiles"
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    folder.mkdir()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")

    def load_losing_the_folder(*args, **kw):
        shutil.rmtree(folder)
        return load(out, device="cpu", max_batch=1)
    monkeypatch.setattr(turbomoe.inference, "load", load_losing_the_folder)
    with pytest.raises(SystemExit) as e:
        main([out, "--prompt", "abc", "--max-new-tokens", "3", "--tune", "--tiles", str(folder / "t.json")])
    assert e.value.code == 2 and "t.json could not be written" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_fp32_tokens_equal_cpu(tmp_path, seed):
    """The GPU path (CUDA kernels, few-rows and grouped GEMMs, CUDA-graph decode) gives the CPU
    reference path's greedy tokens in fp32, ragged batches of two bucket sizes."""
    _, path = hf_model(tmp_path, seed)
    cpu = load(path, device="cpu", dtype=torch.float32, max_batch=8, max_seq_len=48)
    gpu = load(path, device="cuda", dtype=torch.float32, max_batch=8, max_seq_len=48)
    passes = load(path, device="cuda", dtype=torch.float32, max_batch=8, max_seq_len=48, prefill_tokens=10)
    g = torch.Generator().manual_seed(seed)
    for lengths in ((7, 3, 11), (5, 9, 2, 4, 8)):
        ids, mask = random_prompts(lengths, g)
        want = cpu.generate(ids, 14, attention_mask=mask)
        got = gpu.generate(ids, 14, attention_mask=mask)
        assert torch.equal(got.cpu(), want), (got, want)
        got = passes.generate(ids, 14, attention_mask=mask)  # prefill a few columns a pass
        assert torch.equal(got.cpu(), want), (got, want)
        rec = Recorder()  # streamed: the same tokens, each step's read from the graphs' output
        got = gpu.generate(ids, 14, attention_mask=mask, streamer=rec)
        assert torch.equal(got.cpu(), want) and rec.ends == 1
        assert torch.equal(torch.cat([rec.puts[0]] + [t[:, None] for t in rec.puts[1:]], 1), want)
        # stopping at EOS (read a step behind the GPU), streamed or not: the CPU path's tokens
        eos = [int(want[1, ids.shape[1] + 3]), int(want[0, ids.shape[1] + 5])]
        want = cpu.generate(ids, 14, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
        assert want.shape[1] < ids.shape[1] + 14 or (want[:, ids.shape[1]:] == 0).any()
        rec = Recorder()
        for kw in ({}, dict(streamer=rec)):
            got = gpu.generate(ids, 14, attention_mask=mask, eos_token_id=eos, pad_token_id=0, **kw)
            assert torch.equal(got.cpu(), want), (got, want)
        assert torch.equal(torch.cat([rec.puts[0]] + [t[:, None] for t in rec.puts[1:]], 1), want)
    assert gpu.graphs  # the decode steps ran from CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tuned_tiles_tokens_equal_cpu(tmp_path):
    """Engine(tune=True) measures the few-rows tilings at each bucket and every MoE layer takes the
    table; its greedy fp32 tokens are the CPU path's; a table passed back gives the same bits."""
    _, path = hf_model(tmp_path, 2)
    cpu = load(path, device="cpu", dtype=torch.float32, max_batch=8, max_seq_len=48)
    gpu = load(path, device="cuda", dtype=torch.float32, max_batch=8, max_seq_len=48, buckets=(1, 4), tune=True)
    table = gpu.few_rows_tiles
    assert sorted(table) == [1, 4, 8] and all(m.few_rows_tiles == table for m in gpu.moes.values())
    again = load(path, device="cuda", dtype=torch.float32, max_batch=8, max_seq_len=48, buckets=(1, 4),
                 few_rows_tiles=json.loads(json.dumps(table)))  # a table kept as JSON
    g = torch.Generator().manual_seed(2)
    for lengths in ((6, ), (7, 3, 11), (5, 9, 2, 4, 8)):
        ids, mask = random_prompts(lengths, g)
        got = gpu.generate(ids, 14, attention_mask=mask)
        assert torch.equal(got.cpu(), cpu.generate(ids, 14, attention_mask=mask))
        assert torch.equal(again.generate(ids, 14, attention_mask=mask), got)
    assert gpu.graphs
    gpu.few_rows_tiles = {}  # the rule's tilings: the decode graphs captured on the tuned ones are dropped
    assert not gpu.graphs and all(m.few_rows_tiles == {} for m in gpu.moes.values())
    assert torch.equal(gpu.generate(ids, 14, attention_mask=mask).cpu(), cpu.generate(ids, 14, attention_mask=mask))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_cli_tune_and_tile_file(tmp_path, capsys):
    """python -m turbomoe.generate --tune --tiles FILE keeps the measured table in FILE under this GPU,
    the model's shape and dtype; --tiles FILE alone reads it back: the same greedy text."""
    from turbomoe.data import ByteTokenizer
    from turbomoe.generate import main
    from turbomoe.inference.tiling import read_tile_file, tile_key
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 5, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out, tiles = os.path.join(tmp_path, "bytes"), str(tmp_path / "tiles.json")
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    argv = [out, "--prompt", "abc", "--prompt", "de", "--max-new-tokens", "6", "--dtype", "fp32"]
    main(argv)
    plain = capsys.readouterr().out
    main(argv + ["--tiles", tiles])
    assert "holds no tile table" in capsys.readouterr().err
    main(argv + ["--tune", "--tiles", tiles])
    printed = capsys.readouterr()
    assert "tuned the few-rows tilings in" in printed.err and printed.out == plain
    config = json.load(open(os.path.join(out, "config.json")))
    key = tile_key(torch.cuda.get_device_name(), config["num_experts"], config["num_experts_per_tok"],
                   config["hidden_size"], config["moe_intermediate_size"], torch.float32)
    assert sorted(read_tile_file(tiles, key)) == [2]  # the batch's bucket
    main(argv + ["--tiles", tiles])
    assert capsys.readouterr().out == plain
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as e:  # refused before the load, and left as it was
        main(argv + ["--tune", "--tiles", str(bad)])
    assert e.value.code == 2 and "bad.json is not a turbomoe tile file" in capsys.readouterr().err
    assert bad.read_text() == "{}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_engine_on_a_device_not_current(tmp_path):
    """load(device="cuda:1") with cuda:0 current: the Triton kernels launch and the decode graphs are
    captured on cuda:1 (the engine makes it current inside generate and tune), giving the CPU path's
    greedy fp32 tokens; cuda:0 stays current. A graph captured on cuda:0 first puts torch's default
    capture stream there (made once per process), as earlier tests in the process would."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ones(1, device="cuda:0").add_(1)
    _, path = hf_model(tmp_path, 3)
    cpu = load(path, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=40)
    torch.cuda.set_device(0)
    gpu = load(path, device="cuda:1", dtype=torch.float32, max_batch=4, max_seq_len=40, buckets=(1, ), tune=True)
    assert sorted(gpu.few_rows_tiles) == [1, 4]
    ids, mask = left_padded([[5, 9, 2, 7], [3, 1], [8, 8, 4]], pad=0)
    got = gpu.generate(ids, 12, attention_mask=mask)
    assert got.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0 and gpu.graphs
    assert torch.equal(got.cpu(), cpu.generate(ids, 12, attention_mask=mask))


def test_engine_tune_stopped_leaves_the_model_whole(tmp_path, monkeypatch):
    """Engine(model, tune=True) whose tune fails or is interrupted (minutes on a fresh GPU) leaves the
    model whole: the tune runs on the first MoE layer before the model gives up any (a GPU faked: the
    device the engine reads, and a tune that stops)."""
    from turbomoe.inference import Engine, SparseMoE
    from turbomoe.models import Qwen3MoeForCausalLM
    from turbomoe.models.qwen3_moe import ExpertsMoved
    _, path = hf_model(tmp_path, 5)
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    logits = model(ids).logits

    class Cuda:
        type = "cuda"
    monkeypatch.setattr(Engine, "device", property(lambda self: Cuda, lambda self, device: None), raising=False)
    tuned = []

    def tune(self, token_counts):
        tuned.append(sum(isinstance(layer.mlp, ExpertsMoved) for layer in model.model.layers))
        raise KeyboardInterrupt
    monkeypatch.setattr(SparseMoE, "tune", tune)
    with pytest.raises(KeyboardInterrupt):
        Engine(model, max_batch=2, max_seq_len=16, tune=True)
    assert tuned == [0] and torch.equal(model(ids).logits, logits)


def test_generate_cli_tile_file_without_this_batch_size(tmp_path, capsys, monkeypatch):
    """--tiles FILE whose table for this GPU and model lacks the batch's token count: the decode step
    runs the rule's tilings, and the CLI says so rather than passing for tuned (a GPU faked: the
    engine is the CPU's)."""
    import turbomoe.inference
    from turbomoe.data import ByteTokenizer
    from turbomoe.generate import main
    from turbomoe.inference.tiling import tile_key, write_tile_file
    from turbomoe.models import Qwen3MoeForCausalLM
    _, path = hf_model(tmp_path, 5, vocab_size=257, eos_token_id=256, pad_token_id=256)
    out, tiles = os.path.join(tmp_path, "bytes"), str(tmp_path / "t.json")
    Qwen3MoeForCausalLM.from_pretrained(path).save_pretrained(out, tokenizer=ByteTokenizer())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(turbomoe.inference, "load", lambda *args, **kw: load(out, device="cpu", max_batch=kw["max_batch"]))
    key = tile_key("a GPU", 6, 2, 48, 24, torch.float32)
    write_tile_file(tiles, key, {1: (None, None), 4: (None, None)})
    main([out, "--prompt", "abc", "--prompt", "d", "--max-new-tokens", "2", "--tiles", tiles])
    assert "holds no tiling for 2 tokens (this batch size; it has [1, 4]): the rule's" in capsys.readouterr().err
    main([out, "--prompt", "abc", "--max-new-tokens", "2", "--tiles", tiles])
    assert "holds no tiling" not in capsys.readouterr().err


def test_compiled_parts_few_graphs_and_shared_by_engines_of_one_model(tmp_path):
    """The compiled parts see one kind of input whatever the batch, the layer (MoE or dense) or the pass
    (a one-column prefill pass runs eager): at most 6 graphs for _attention_in (batch 1 and the first
    batch above 1 static, then dynamic; with and without the previous MLP output), room left under
    dynamo's recompile limit (8); engines of one model share them (dynamo frees no code object it compiled:
    a copy an engine leaked its graphs with every engine made)."""
    import gc
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()
    hf, path = hf_model(tmp_path, 4, num_hidden_layers=4, mlp_only_layers=[1])
    g = torch.Generator().manual_seed(4)
    parts = None
    for _ in range(2):
        engine = load(path, device="cpu", dtype=torch.float32, max_batch=16, max_seq_len=48, compile=True)
        assert parts is None or engine._decode_parts is parts
        parts = engine._decode_parts
        for B, T in [(2, 5), (1, 5), (4, 5), (3, 1), (16, 2), (1, 1)]:
            ids = torch.randint(1, 101, (B, T), generator=g)
            assert torch.equal(engine.generate(ids, 4), hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
        del engine
        gc.collect()
    entries = [len(_debug_get_cache_entry_list(f._torchdynamo_orig_callable.__code__)) for f in parts]
    assert entries[0] <= 6 and entries[1] <= 3 and entries[2] <= 3, entries
    torch._dynamo.reset()


@pytest.mark.parametrize("device, match", [("meta", "must be cpu, cuda or cuda:N, got 'meta'"),
                                           ("bogus", "must be cpu, cuda or cuda:N, got 'bogus'"),
                                           (torch.device("cuda:7"), "cuda:7")])
def test_load_on_a_device_the_engine_cannot_run_on_is_named(tmp_path, device, match):
    """load() refused such devices only later: meta built an engine whose first generate failed deep in
    torch, a CUDA device on a machine without one failed in torch's lazy init (the CLI checked both)."""
    if device == torch.device("cuda:7") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    _, path = hf_model(tmp_path, 4)
    with pytest.raises(ValueError, match=match):
        load(path, device=device)


@pytest.mark.parametrize("bad", [2, -1, 0.5, float("nan")])
def test_attention_mask_other_than_zeros_and_ones_is_named(tmp_path, bad):
    """A mask value other than 0 and 1 was read as a real token (transformers' positions would differ)."""
    _, path = hf_model(tmp_path, 4)
    engine = load(path, device="cpu")
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    mask = torch.ones(2, 3, dtype=torch.float32 if isinstance(bad, float) else torch.int64)
    mask[1, 0] = bad
    with pytest.raises(ValueError, match="attention_mask must hold 0 .* and 1 .* alone, got"):
        engine.generate(ids, 2, attention_mask=mask)

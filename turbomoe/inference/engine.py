"""Generation with a static KV cache on turbomoe's Qwen3-MoE model, MoE blocks on SparseMoE.

    engine = turbomoe.inference.load("path/to/hf_dir", device="cuda", dtype=torch.bfloat16)
    out = engine.generate(input_ids_BT, max_new_tokens=64, attention_mask=mask_BT)   # [B, T + n]

Prefill runs the whole (left-padded) prompt once; each decode step runs one token per row against
the cache. The cache is static between calls ([rows, G, slots, D] per layer: made by the first
generate for its batch's bucket and its prompt + new tokens rounded up to CACHE_SLOTS_STEP slots, at
most max_batch x max_seq_len, and made again larger only when a call needs more, so the defaults do not
reserve max_batch x max_position_embeddings) and a cache slot is the column of the padded sequence, the same for every row, so a step
writes its keys with one index_copy_ at a device index and attends over every slot under a mask of
the slots that hold real tokens: no shape depends on the step, and on CUDA the decode step of each
batch-size bucket is captured once as a CUDA graph and replayed. Rotary positions count each row's
real tokens (left padding shifts nothing), as transformers' generate does. The dense parts (embedding,
norms, attention projections, dense MLPs, lm_head) are the model's own modules; each MoE layer's
router and experts are restacked into a SparseMoE, and the model's MoE block is then dropped (one copy
of the experts in memory: the model's MoE layers and save_pretrained then raise, saying so), unless
keep_model=True.
On the CPU the same code runs the reference ops.
"""
import contextlib
import inspect
import json
import math
import numbers
import operator
import os
import types
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .. import ops
from ..models.hf_checkpoint import read_config
from ..models.hf_names import to_hf_state_dict
from ..models.qwen3_moe import ExpertsMoved, Qwen3MoeForCausalLM, rotary_cos_sin
from ..kernels.launch import on_device
from .moe import SparseMoE, check_options
from .sampling import Sampling
from .tiling import check_tile_table

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS = 8192  # tokens (rows x columns) a prefill pass runs: bounds its activations and mask
CACHE_SLOTS_STEP = 256  # the cache's length grows in these steps: fewer remakes (and graph captures)


# The dense parts of a layer around attention. In a decode step torch.compile fuses their norms, rotary,
# adds and cache writes: eager they are ~45 of its ~65 kernels a layer.
def _attention_in(layer, qkv_w, qkv_b, kc_BGLD, vc_BGLD, slots_T, x_BTH, mlp_BTH, cos, sin):
    """x plus the previous layer's MLP output (None at the first layer), and q of its norm; its k and v
    written into the cache at slots_T (the three projections in one GEMM over qkv_w, the layer's
    weights stacked)."""
    if mlp_BTH is not None:
        x_BTH = x_BTH + mlp_BTH
    attn = layer.self_attn
    q, k, v = F.linear(layer.input_layernorm(x_BTH), qkv_w, qkv_b).split(
        [attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim], -1)
    q, k, v = attn.heads(q, k, v, cos, sin)
    kc_BGLD.index_copy_(2, slots_T, k)
    vc_BGLD.index_copy_(2, slots_T, v)
    return x_BTH, q


def _attention_out(layer, x_BTH, o_BNTD):
    """x plus attention's output projection, and its post-attention norm (the MLP's input)."""
    B, N, T, D = o_BNTD.shape
    x_BTH = x_BTH + layer.self_attn.o_proj(o_BNTD.transpose(1, 2).reshape(B, T, N * D))
    return x_BTH, layer.post_attention_layernorm(x_BTH)


def _logits(norm, lm_head, x_BH, mlp_BH):
    return lm_head(norm(x_BH + mlp_BH)).float()


_EAGER_PARTS = (_attention_in, _attention_out, _logits)


_COMPILED_PARTS = {}  # (device, dtype, model config) -> the compiled parts of engines of that model


def _compiled_parts(key):
    """The parts compiled for decode steps, for the engines of one model (key: its device, dtype and
    config): copies of their code, so that its graphs live in a cache of their own (dynamo keeps one
    per code object) and count alone against the recompile limit (8), which another model in the
    process (a draft model, say) would otherwise share, the parts running eager past it. Per model, not
    per engine: dynamo frees no code object it compiled, so a copy per engine leaked its graphs with
    every engine made. A few graphs a model: batch 1, the first batch above 1, then dynamic in the
    batch; the first layer has no MLP output to add. Prefill passes run the parts eager: their GEMMs
    set their time, and their shapes vary."""
    if key not in _COMPILED_PARTS:
        _COMPILED_PARTS[key] = tuple(
            torch.compile(types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                                             f.__closure__)) for f in _EAGER_PARTS)
    return _COMPILED_PARTS[key]


class Engine:
    """model: a turbomoe Qwen3MoeForCausalLM (moe_impl turbomoe or deepspeed) on its device and dtype.
    max_batch: the largest batch (the last bucket); max_seq_len: the most prompt + new tokens a call
    may ask for (default the model's max_position_embeddings; the cache holds only what calls have
    needed, see the module's docstring); cuda_graphs: capture the decode step per bucket on CUDA;
    keep_model: leave the model whole (its experts then take memory twice), else its MoE blocks move
    into the engine; tune: measure the few-rows GEMMs' tilings at each bucket's decode step on this GPU
    (SparseMoE.tune, on the first MoE layer; every MoE layer then uses its table, few_rows_tiles);
    prefill_tokens: the prompt runs in passes of about this many tokens (whole columns of the batch,
    at least one), so that a long prompt's activations and attention mask stay bounded; compile:
    torch.compile the dense parts around attention (norms, rotary, projections, residual adds; default
    on CUDA), compiled on the first decode at batch 1 and above (seconds), once per model a process."""

    def __init__(self, model, max_batch: int = 64, max_seq_len: Optional[int] = None, cuda_graphs: bool = True,
                 buckets: Sequence[int] = BUCKETS, keep_model: bool = False, tune: bool = False,
                 prefill_tokens: int = PREFILL_TOKENS, compile: Optional[bool] = None, **moe_kw):
        if not isinstance(model, Qwen3MoeForCausalLM):  # transformers' class has the same name
            raise TypeError(f"Engine takes turbomoe's Qwen3MoeForCausalLM (turbomoe.models), got "
                            f"{type(model).__module__}.{type(model).__qualname__}: turbomoe.inference.load(model_dir) "
                            f"reads a Hugging Face directory into an Engine")
        _check_keywords(moe_kw)
        for name, value in (("cuda_graphs", cuda_graphs), ("keep_model", keep_model), ("tune", tune)):
            ops.check_bool(name, value)
        model.check_whole()
        cfg = model.config
        self.config = cfg
        # Python ints (numpy's too) and a tuple of buckets (an iterator read once) before anything is
        # moved out of the model: the tune's token counts must be ints.
        try:
            buckets = tuple(buckets)
        except TypeError:
            raise ValueError(f"buckets must be a sequence of positive ints, got {buckets!r}") from None
        max_batch = _positive_index("max_batch", max_batch)
        max_seq_len = None if max_seq_len is None else _positive_index("max_seq_len", max_seq_len)
        buckets = tuple(_positive_index("bucket", b) for b in buckets)
        self.prefill_tokens = _positive_index("prefill_tokens", prefill_tokens)
        self.max_seq_len = cfg.max_position_embeddings if max_seq_len is None else max_seq_len
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        # each bucket once: a repeated one would be tuned (minutes) twice
        self.buckets = tuple(b for b in sorted(set(buckets)) if b < max_batch) + (max_batch, )
        self.max_batch = max_batch
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # checked before any layer hands its experts over: a later layer's refusal would leave the model torn
        odd = next(((n, q) for n, q in model.named_parameters() if (q.dtype, q.device) != (p.dtype, p.device)), None)
        if odd:
            raise ValueError(f"the model's parameters must share one dtype and device ({odd[0]} is {odd[1].dtype} on "
                             f"{odd[1].device}, the first {p.dtype} on {p.device}): model.to(device, dtype) first")
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        if _check_compile(compile) is None:
            compile = self.device.type == "cuda"
        self._decode_parts = (_compiled_parts((str(self.device), self.dtype, json.dumps(cfg.to_dict(), sort_keys=True)))
                              if compile else _EAGER_PARTS)
        if tune and self.device.type != "cuda":
            raise ValueError(f"tune measures the few-rows kernels on a GPU; the model is on {self.device}")
        inner = model.model
        self.embed, self.norm, self.lm_head = inner.embed_tokens, inner.norm, model.lm_head
        self.layers = list(inner.layers)
        sd = to_hf_state_dict(model.state_dict())
        self.moes = {}
        for i, layer in enumerate(self.layers):
            if layer.is_moe:
                prefix = f"model.layers.{i}.mlp."
                self.moes[i] = SparseMoE.from_hf_state_dict(sd, prefix, cfg.num_experts,
                                                           cfg.num_experts_per_tok, cfg.norm_topk_prob, **moe_kw)
                if tune and len(self.moes) == 1:
                    # a decode step of bucket b runs b tokens through each MoE layer; tuned on the first
                    # one before the model gives up any layer, so that a tune that fails or is
                    # interrupted (minutes on a fresh machine) leaves the model whole
                    tiles = self.moes[i].tune(self.buckets)
                # The experts now live (stacked) in the SparseMoE: drop the model's copy before the next
                # layer's stack, so building needs one layer's experts extra, not the whole model's.
                if not keep_model:
                    layer.mlp = ExpertsMoved()
                for key in [key for key in sd if key.startswith(prefix)]:
                    del sd[key]
        del sd
        if tune and self.moes:  # every MoE layer on the first one's table
            self.few_rows_tiles = tiles
        # q, k and v of a layer in one GEMM (a decode step's projections are launch-bound); the model's
        # q / k / v weights become views of the stack, unless it stays whole (keep_model: its own copy)
        self.qkv = [_stack_qkv(layer.self_attn, keep_model) for layer in self.layers]
        self.cos, self.sin = rotary_cos_sin(self.max_seq_len, cfg.head_dim, cfg.rope_theta, self.device)
        self.cache, self.cache_rows, self.cache_len = None, 0, 0
        self.graphs, self._pool = {}, None

    @property
    def few_rows_tiles(self) -> dict:
        """The MoE layers' tile table (SparseMoE.few_rows_tiles): what tune chose, to pass to a later
        load(..., few_rows_tiles=...) for the same kernels and bits."""
        return dict(next(iter(self.moes.values())).few_rows_tiles) if self.moes else {}

    @few_rows_tiles.setter
    def few_rows_tiles(self, table: dict):
        """Every MoE layer on table's tilings (checked) from the next call on; decode graphs captured
        on the old ones are dropped."""
        table = check_tile_table(table)
        for moe in self.moes.values():
            moe.few_rows_tiles = dict(table)
        self.graphs = {}

    # ---- buffers -------------------------------------------------------------------------------
    def reserve(self, batch: int, tokens: int):
        """Makes now the KV cache that a generate call of `batch` rows and `tokens` prompt + new tokens
        a row would make (checked as generate checks them), so that such a call, timed, neither
        allocates nor (on CUDA) recaptures its decode graph."""
        batch, tokens = _positive_index("batch", batch), _positive_index("tokens", tokens)
        self._check_batch(batch)
        if tokens > self.max_seq_len:
            raise ValueError(f"tokens {tokens} exceeds the KV cache's max_seq_len {self.max_seq_len}")
        self._reserve(batch, tokens)

    def _reserve(self, batch: int, tokens: int):
        """reserve's cache, for arguments already checked."""
        steps = -(-tokens // CACHE_SLOTS_STEP)
        self._allocate(self._bucket(batch), min(self.max_seq_len, steps * CACHE_SLOTS_STEP))

    def _check_batch(self, batch: int):
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the engine's largest batch bucket {self.max_batch} "
                             f"(Engine(max_batch=...))")

    def _allocate(self, rows: int, slots: int):
        """The KV cache and the decode step's inputs for at least `rows` rows and `slots` slots (checked
        arguments first): kept while calls fit, else made again at the larger size. The decode graphs
        hold the old buffers, so they go with them (recaptured on the next decode of each bucket)."""
        if self.cache is not None and rows <= self.cache_rows and slots <= self.cache_len:
            return
        B, L = max(rows, self.cache_rows), max(slots, self.cache_len)
        self.cache, self.graphs, self._pool = None, {}, None  # the old buffers freed before the new ones
        cfg = self.config
        kw = dict(device=self.device, dtype=self.dtype)
        shape = (B, cfg.num_key_value_heads, L, cfg.head_dim)
        # Normal tensors even under torch.inference_mode: later calls outside it update them in place,
        # which inference tensors refuse.
        with torch.inference_mode(False):
            self.cache = [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in self.layers]
            self.valid = torch.zeros(B, L, dtype=torch.bool, device=self.device)  # slot holds a real token
            self.tokens = torch.zeros(B, dtype=torch.long, device=self.device)
            self.positions = torch.zeros(B, dtype=torch.long, device=self.device)
            self.slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self.cache_rows, self.cache_len = B, L

    # ---- the model -----------------------------------------------------------------------------
    def _forward(self, x_BTH, pos_BT, slots_T, mask_B1TL, L: int, head: bool = True, decode: bool = False):
        """Decoder layers over x; writes keys/values at cache slots; attends over slots [0, L). Returns
        the last position's logits [B, V] (None without head). decode: a decode step (the compiled parts;
        a prefill pass of one column runs them eager, as its longer passes do)."""
        B, T, _ = x_BTH.shape
        cos, sin = self.cos[pos_BT][:, None], self.sin[pos_BT][:, None]  # [B, 1, T, D]
        # The mask as SDPA makes it from a boolean one, made once, not in every layer's call
        bias_B1TL = torch.zeros(mask_B1TL.shape, dtype=x_BTH.dtype, device=x_BTH.device).masked_fill_(
            mask_B1TL.logical_not(), float("-inf"))
        attention_in, attention_out, logits_of = self._decode_parts if decode else _EAGER_PARTS
        mlp_BTH = None  # the previous layer's MLP output, added to x by the next part
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            kc, vc = self.cache[i]
            x_BTH, q = attention_in(layer, *self.qkv[i], kc[:B], vc[:B], slots_T, x_BTH, mlp_BTH, cos, sin)
            o = F.scaled_dot_product_attention(q, kc[:B, :, :L], vc[:B, :, :L], attn_mask=bias_B1TL,
                                               enable_gqa=attn.num_heads != attn.num_kv_heads)
            x_BTH, h = attention_out(layer, x_BTH, o)
            # over [B * T, H] rows, MoE or dense alike: the compiled parts' guards see one kind of input (a view)
            mlp_BTH = self.moes.get(i, layer.mlp)(h.reshape(B * T, -1)).view(B, T, -1)
        if not head:
            return None
        return logits_of(self.norm, self.lm_head, x_BTH[:, -1], mlp_BTH[:, -1])  # [B, V] of the last position

    @torch.no_grad()
    def _prefill(self, ids_BT, mask_BT):
        B, T = ids_BT.shape
        Bb = self._bucket(B)  # rows B..Bb of the bucket's graph are dummies: no real token, position 0
        self.valid[:Bb].zero_()
        self.positions[:Bb].zero_()
        self.valid[:B, :T] = mask_BT
        pos = (mask_BT.long().cumsum(1) - 1).clamp_min(0)
        slots = torch.arange(T, device=self.device)
        # Columns [c0, c1) a pass, each writing its keys to the cache before the next attends to them.
        step = max(1, self.prefill_tokens // B)
        for c0 in range(0, T, step):
            c1 = min(T, c0 + step)
            q_slots, k_slots = slots[c0:c1, None], slots[None, :c1]
            # Keys: earlier real tokens; a pad query also sees itself (no empty softmax row).
            mask = ((k_slots <= q_slots) & mask_BT[:, None, :c1]) | (k_slots == q_slots)  # [B, c, c1]
            logits = self._forward(self.embed(ids_BT[:, c0:c1]), pos[:, c0:c1], slots[c0:c1], mask[:, None], c1,
                                   head=c1 == T)
        self.positions[:B] = mask_BT.sum(1)
        return logits

    def _decode_step(self, B: int):
        """One token per row at cache slot self.slot; reads self.tokens/positions[:B]."""
        self.valid[:B].index_fill_(1, self.slot, True)
        x = self.embed(self.tokens[:B, None])  # [B, 1, H], no view: as a prefill pass's x
        return self._forward(x, self.positions[:B, None], self.slot, self.valid[:B, None, None, :], self.cache_len,
                             decode=True)

    def _bucket(self, B: int) -> int:
        return next(b for b in self.buckets if b >= B)

    @torch.no_grad()
    def _decode(self, B: int):
        if not self.use_graphs:
            return self._decode_step(B)
        if B not in self.graphs:
            # Warm-up outside the capture (kernel compilation, autotuning, lazy allocations).
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._decode_step(B)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            # captured on s, a stream of this device: torch's default capture stream is made once per
            # process, on whichever device was current at the first capture
            with torch.cuda.graph(graph, pool=self._pool, stream=s):
                out = self._decode_step(B)
            self._pool = graph.pool()
            self.graphs[B] = (graph, out)
        graph, out = self.graphs[B]
        graph.replay()
        return out

    # ---- generation ----------------------------------------------------------------------------
    def _check(self, input_ids, attention_mask, max_new_tokens) -> tuple:
        """The call's arguments checked; returns input_ids as int64 (any integer dtype is taken) and
        max_new_tokens as a Python int."""
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"input_ids must be an integer tensor [B, T], got {type(input_ids).__name__}")
        if (input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.is_complex()
                or input_ids.dtype == torch.bool):
            raise ValueError(f"input_ids must be an integer tensor [B, T], got a {input_ids.dtype} tensor of shape "
                             f"{tuple(input_ids.shape)}")
        input_ids = input_ids.long()
        B, T = input_ids.shape
        if B < 1 or T < 1:
            raise ValueError(f"input_ids must hold at least one row and one token per row, got shape "
                             f"{tuple(input_ids.shape)}")
        V = self.config.vocab_size
        lo, hi = input_ids.aminmax()  # one host sync a call, before the prefill
        if lo < 0 or hi >= V:
            raise ValueError(f"input_ids must lie in [0, vocab_size {V}), got ids from {int(lo)} to {int(hi)}")
        # a Python int: a numpy int8's T + max_new_tokens wrapped past the length check below
        max_new_tokens = _positive_index("max_new_tokens", max_new_tokens)
        self._check_batch(B)
        if T + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} exceeds the KV cache's "
                             f"max_seq_len {self.max_seq_len}")
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise ValueError(f"attention_mask must be a tensor [B, T], got {type(attention_mask).__name__}")
            if tuple(attention_mask.shape) != (B, T):
                raise ValueError(f"attention_mask must have the shape of input_ids {(B, T)}, got "
                                 f"{tuple(attention_mask.shape)}")
            _check_left_padding(attention_mask)
        return input_ids, max_new_tokens

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, eos_token_id=None, attention_mask: Optional[torch.Tensor] = None,
                 pad_token_id: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 streamer=None, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 min_new_tokens: int = 0, num_return_sequences: int = 1) -> torch.Tensor:
        """[B, T + n] tokens: the prompt, then up to max_new_tokens per row; a row that produced
        eos_token_id (an int or a list) gets pad_token_id (default: the first eos) after it, and
        generation stops when every row has. Greedy unless do_sample (temperature, top_k, top_p, min_p:
        transformers' warpers, 0 / 1 / 0 off), after repetition_penalty (1: off) over each row's prompt
        and output; no EOS before min_new_tokens new tokens; sampled, num_return_sequences rows a prompt
        ([B x num_return_sequences, T + n], a prompt's rows together). turbomoe.inference.sampling; its
        generation_defaults(model_dir) gives a model directory's own settings: no value here comes from
        generation_config.json. input_ids: any
        integer dtype; without attention_mask, an explicit pad_token_id that is no EOS marks the padding
        where input_ids hold it (transformers' rule), else every token is real. streamer: transformers'
        streamer protocol (TextStreamer, TextIteratorStreamer): put(the prompt [B, T]), then put(each
        step's tokens [B]), on the CPU, as they are made (a host read a step), and end() when generation
        stops, an error's included."""
        if streamer is not None and not all(callable(getattr(streamer, f, None)) for f in ("put", "end")):
            raise TypeError(f"streamer must have put(tokens) and end() (transformers' TextStreamer, say), got "
                            f"{type(streamer).__name__}")
        sampling = (do_sample, temperature, top_k, top_p, min_p, repetition_penalty, min_new_tokens, num_return_sequences)
        if streamer is None:
            return self._checked_generate(input_ids, max_new_tokens, sampling, eos_token_id, attention_mask,
                                          pad_token_id, generator)
        # end() whatever happens, a bad argument's error included: a consumer of TextIteratorStreamer (in another
        # thread) would otherwise wait for ever; after an error, an error of end()'s own does not replace it
        try:
            out = self._checked_generate(input_ids, max_new_tokens, sampling, eos_token_id, attention_mask,
                                         pad_token_id, generator, streamer)
        except BaseException:
            with contextlib.suppress(Exception):
                streamer.end()
            raise
        streamer.end()
        return out

    def _checked_generate(self, input_ids, max_new_tokens, sampling, eos_token_id, attention_mask, pad_token_id,
                          generator, streamer=None):
        sampling = Sampling.checked(*sampling)
        n = sampling.num_return_sequences
        input_ids, max_new_tokens = self._check(input_ids, attention_mask, max_new_tokens)  # the prompts as given
        if n > 1:  # as transformers: a prompt's samples side by side
            try:
                self._check_batch(input_ids.shape[0] * n)
            except ValueError as e:
                raise ValueError(f"{e}: {input_ids.shape[0]} prompts x num_return_sequences {n}") from None
            input_ids = input_ids.repeat_interleave(n, 0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(n, 0)
        eos = _token_ids(eos_token_id, "eos_token_id")  # checked before anything is allocated
        pad = _token_ids(pad_token_id, "pad_token_id") if pad_token_id is not None else eos[:1] or [0]
        V = self.config.vocab_size
        if len(pad) != 1 or pad[0] >= V:  # a finished row's next input: an id the embedding has
            given = (f"got {pad_token_id!r}" if pad_token_id is not None else
                     f"the default is eos_token_id's first id, {pad[0]}: pass pad_token_id")
            raise ValueError(f"pad_token_id must be one id below vocab_size {V}, {given}")
        do_sample = sampling.do_sample
        if do_sample and generator is not None and not isinstance(generator, torch.Generator):  # a seed, say
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        gen_device = torch.device(generator.device) if do_sample and generator is not None else None  # greedy: unused
        if gen_device is not None and (gen_device.type != self.device.type or
                                       gen_device.index not in (None, self.device.index)):
            # torch.multinomial refuses another kind's, after the prefill has run (torch.Generator("cuda"),
            # with no index, serves any GPU)
            raise ValueError(f"generator is on {generator.device}; sampling runs on the engine's device {self.device}: "
                             f"torch.Generator(device={str(self.device)!r})")
        # transformers' generate rule: an explicit pad id, not an EOS, found in the prompt marks its padding
        if attention_mask is None and pad_token_id is not None and pad[0] not in eos and (input_ids == pad[0]).any():
            attention_mask = input_ids != pad[0]
            _check_left_padding(attention_mask, pad[0])
        # the decode graphs are captured on the current device; the engine runs in its own dtype (a caller's
        # autocast would hand the cache keys of another dtype); inference_mode off, under a caller's too
        # (no_grad holds): one state for the compiled parts' guards, not a second set of graphs
        with on_device(self.device), torch.autocast(self.device.type, enabled=False), torch.inference_mode(False):
            if streamer is not None:
                streamer.put(input_ids.cpu())
            return self._generate(input_ids, attention_mask, max_new_tokens, sampling, generator, eos, pad[0],
                                  streamer.put if streamer is not None else None)

    def _generate(self, input_ids, attention_mask, max_new_tokens, sampling, generator, eos, pad, put=None):
        B, T = input_ids.shape
        Bb = self._bucket(B)
        self._reserve(B, T + max_new_tokens)  # checked by _check
        ids = input_ids.to(self.device, torch.long)
        mask = (torch.ones_like(ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.to(self.device, torch.bool))
        eos_t = torch.tensor(eos, dtype=torch.long, device=self.device)
        barred = torch.tensor([i for i in eos if i < self.config.vocab_size], dtype=torch.long, device=self.device)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        out = [ids]
        history = sampling.history(ids, mask, max_new_tokens)
        logits = self._prefill(ids, mask)
        # The host reads each step's tokens (put) or whether every row is done (EOS): one sync a step. On
        # a GPU they go through pinned memory and the host waits for them after the next step is queued,
        # so the GPU does not idle while the host issues it (at the price of one step queued in vain when
        # all rows have stopped).
        reads, ahead = put is not None or bool(eos), self.device.type == "cuda"
        if reads and ahead:
            tok_host = torch.empty(max_new_tokens, B, dtype=torch.long, pin_memory=True)
            done_host = torch.zeros(max_new_tokens, dtype=torch.bool, pin_memory=True)
        for step in range(max_new_tokens):
            logits_BV = logits[:B]
            if step < sampling.min_new_tokens and len(barred):  # transformers' MinNewTokensLengthLogitsProcessor
                logits_BV = logits_BV.index_fill(1, barred, -math.inf)
            tok = sampling.select(logits_BV, history, generator)
            tok = torch.where(done, pad, tok)
            out.append(tok[:, None])
            if eos:
                done |= torch.isin(tok, eos_t)
            if reads and ahead:
                tok_host[step].copy_(tok, non_blocking=True)
                if eos:
                    done_host[step].copy_(done.all(), non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
            if step + 1 < max_new_tokens:
                self.tokens[:B] = tok
                self.slot.fill_(T + step)
                logits = self._decode(Bb)
                self.positions[:Bb] += 1
            if reads:
                if ahead:
                    copied.synchronize()
                tok_now, finished = (tok_host[step], bool(done_host[step])) if ahead else (tok.clone(), bool(done.all()))
                if put is not None:
                    put(tok_now)
                if finished:
                    break
        return torch.cat(out, 1)


def _check_left_padding(mask_BT: torch.Tensor, inferred_from: Optional[int] = None):
    """mask_BT, given or inferred_from a pad id, must be zeros, then ones up to the last column."""
    raw = mask_BT.to("cpu")
    binary = (raw == 0) | (raw == 1)
    if not bool(binary.all()):  # 2, -1, 0.5 or NaN would read as a real token
        bad = raw[~binary][0].item()
        raise ValueError(f"attention_mask must hold 0 (padding) and 1 (a token) alone, got {bad}")
    m = raw.to(torch.bool)
    if not bool(m[:, -1].all()) or bool((m[:, 1:] < m[:, :-1]).any()):
        if inferred_from is None:
            raise ValueError("attention_mask must be left padding: zeros, then ones up to the last column")
        raise ValueError(f"attention_mask, inferred from pad_token_id {inferred_from} in input_ids (as transformers' "
                         f"generate does), must be left padding: zeros, then ones up to the last column; pass "
                         f"attention_mask")


def _check_compile(value) -> Optional[bool]:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"compile must be True, False or None (on CUDA), got {value!r}")
    return value


def _stack_qkv(attn, copy: bool):
    """attn's q, k and v weights (and biases) as one [(N + 2G) D, H] weight; without copy, the
    modules' own weights become views of it (one copy in memory)."""
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    stacked = []
    for name in ("weight", "bias"):
        if getattr(attn.q_proj, name) is None:
            stacked.append(None)
            continue
        parts = [getattr(p, name).detach() for p in projs]
        whole = torch.cat(parts)
        if not copy:
            for p, view in zip(projs, whole.split([t.shape[0] for t in parts])):
                setattr(p, name, torch.nn.Parameter(view, requires_grad=False))
        stacked.append(whole)
    return tuple(stacked)


def _positive_index(name: str, value) -> int:
    """value as a Python int (from an int, a numpy integer or a 0-d integer tensor), at least 1."""
    try:
        index = operator.index(value)
    except TypeError:
        index = 0
    if isinstance(value, bool) or index < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return index


def _token_ids(ids, name: str) -> list:
    """None, a token id (int, numpy integer, 0-d tensor) or several (a sequence, a 1-d tensor) -> [int]."""
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.dim() > 1:
            raise ValueError(f"{name} must be integer token ids, got a {ids.dtype} tensor of shape {tuple(ids.shape)}")
        ids = ids.reshape(-1).tolist()
    seq = [ids] if isinstance(ids, numbers.Integral) else ids
    try:
        if isinstance(ids, (bytes, bytearray)):  # a sequence of ints: b"7" would read as id 55
            raise TypeError
        out = [operator.index(i) for i in seq]
    except TypeError:
        raise ValueError(f"{name} must be a token id or a list of them, got {ids!r}") from None
    if any(isinstance(i, bool) for i in seq) or any(i < 0 for i in out):
        raise ValueError(f"{name} must hold non-negative integer token ids, got {ids!r}")
    return out


def check_model_dir(model_dir: str) -> dict:
    """A Qwen3-MoE directory's config.json, read (FileNotFoundError or ValueError if it is not one)."""
    config = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory: no config.json")
    raw = read_config(model_dir)  # a file that is not a JSON object: an error that names it
    if raw.get("model_type") != "qwen3_moe":
        raise ValueError(f"{config}: model_type is {raw.get('model_type')!r}; turbomoe.inference serves 'qwen3_moe' "
                         f"models")
    return raw


def _check_keywords(engine_kw: dict) -> dict:
    """load's keywords are Engine's and, passed on to every MoE layer, SparseMoE's options: those of
    them that the checkpoint does not fix (its config sets the routing: k, scores, renormalisation).
    Returns the MoE options given."""
    own = set(inspect.signature(Engine.__init__).parameters) - {"self", "model", "moe_kw"}
    moe = set(inspect.signature(SparseMoE.__init__).parameters) - {
        "self", "router_EM", "w1_EMN", "w2_EFM", "k", "score_func", "renormalize", "shared_w1_MN", "shared_w2_FM",
        "prescale"}
    unknown = sorted(set(engine_kw) - own - moe)
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}: Engine and load() take {sorted(own)} and the MoE "
                        f"layers' options {sorted(moe)}")
    return {key: value for key, value in engine_kw.items() if key in moe}


def engine_device(device=None) -> torch.device:
    """The device an engine runs on: cpu, or a CUDA device this machine has (default: cuda where available)."""
    given = device
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError):  # not a device
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {given!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def load(model_dir: str, device=None, dtype: Optional[torch.dtype] = None, **engine_kw) -> Engine:
    """An Engine for a Hugging Face Qwen3-MoE directory, read by Qwen3MoeForCausalLM.from_pretrained.
    device: default CUDA where available; dtype: default the checkpoint's."""
    check_model_dir(model_dir)
    moe_kw = _check_keywords(engine_kw)  # the arguments checked before the checkpoint is read
    if "prefill_tokens" in engine_kw:
        _positive_index("prefill_tokens", engine_kw["prefill_tokens"])
    _check_compile(engine_kw.get("compile"))
    device = engine_device(device)
    if engine_kw.get("tune") and device.type != "cuda":
        raise ValueError(f"tune measures the few-rows kernels on a GPU; device is {device}")
    check_tile_table(moe_kw.pop("few_rows_tiles", None))
    check_options(device, **moe_kw)
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=dtype, device=device)
    return Engine(model.eval(), **engine_kw)

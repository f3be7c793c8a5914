"""Inference benchmark on one GPU, every peer in the same run, CUDA-graph replays (README "### Inference").

  python scripts/bench_inference.py --out DIR [--sections shuffle,layer,generate] [--quick]

shuffle   index shuffling (routing + counts + expert-contiguous permutation) at T x E =
          128/2048/8192 x 16/128, top-1 sigmoid (Llama 4's routing, the setting of FBGEMM's kernel):
          turbomoe cuda and triton (from bf16 logits) vs plain PyTorch (sigmoid + topk + bincount +
          sort) and FBGEMM's torch.ops.fbgemm.index_shuffling (from bf16 scores)
layer     the decode MoE layer at T = 1, 8, 16, 64, 256 tokens, bf16: Qwen3-30B-A3B's (E 128, k 8,
          M 2048, F 768, softmax, renormalised) and a Llama-4-Scout TP8 shard (E 16, k 1, M 5120,
          F 1024, sigmoid, input pre-scaled, one shared expert); turbomoe's SparseMoE in each mode (and
          "tuned": auto with the few-rows tilings measured on this GPU, SparseMoE.tune) vs
          plain PyTorch (topk, sort, index_select, torch._grouped_mm, index_add_), transformers' own
          block (eager: it syncs with the host) and the floor: bytes of the weights the step must
          read (experts with tokens, the shared expert, the router) over the measured copy bandwidth
generate  tokens/s of a ~1B-parameter random Qwen3-MoE (turbomoe.inference.Engine, CUDA-graph
          decode) vs transformers' generate (eager, and static cache + torch.compile) at batch 1, 8, 64
sampling  (not by default) a decode step's token choice at batch 1, 8, 64 over Qwen3's 151,936-token
          vocabulary (turbomoe.inference.sampling: greedy, repetition penalty, temperature, top-p over
          the whole vocabulary, Qwen3's generation_config.json's top-k 20 / top-p 0.95, min-p) vs
          transformers' logits processors and multinomial draw, the same settings
generate-30b  (not by default) the same at Qwen3-30B-A3B's config (48 layers, 128 experts top-8,
          hidden 2048, 151,936-token vocabulary: 30.5B parameters, 61 GB in bf16) with random weights
          made on the GPU, transformers' eager generate first (its own model, then freed), against the
          floor: the bytes a decode step must read (dense weights, LM head, the experts a uniform
          routing uses in expectation, the KV cache) over the measured copy bandwidth
stages    (not by default) the few-rows layer's kernels each timed alone (router, shuffle, the two
          GEMMs, combine) beside the whole layer, at --tune-tokens: where a decode step's time goes
tune      (not by default) the two few-rows GEMMs swept over their tilings at --tune-tokens, the
          rule's choice beside the best and the floor: the data behind few_rows_tiles

Times: the op captured REPS times in one CUDA graph, the graph replayed, CUDA-event medians / REPS
(peers that cannot be captured: eager medians, each call waited for before the next is issued, so its
host time shows: synced in scripts/timing.py's words; marked). Generation: wall-clock tokens/s of each
way (turbomoe, tuned, transformers eager and compiled) the fastest of GEN_REPEATS calls after a
warm-up, every way alike. JSON and a log go to --out.
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from turbomoe import csrc  # noqa: E402
from turbomoe.inference import SparseMoE, index_shuffling  # noqa: E402
from turbomoe.inference.tiling import tile_space  # noqa: E402
from turbomoe.kernels.shuffling import index_shuffling as triton_shuffling  # noqa: E402
from timing import capture_graph, require_gpu  # noqa: E402

REPS = 20


def graph_us(fn, iters=30):
    """Median us per call of fn replayed from a CUDA graph of REPS calls; None if it cannot be
    captured (then eager_us)."""
    try:
        g = capture_graph(fn, REPS)
    except Exception as e:  # noqa: BLE001 (a peer that syncs with the host)
        print(f"  (not capturable: {type(e).__name__}: {str(e)[:100]})")
        torch.cuda.synchronize()
        return None
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / REPS)
    return statistics.median(times)


def eager_us(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def timed_us(fn):
    t = graph_us(fn)
    return (t, "graph") if t is not None else (eager_us(fn), "eager")


def rounded(row, digits=2):
    """A result row for the log: floats rounded."""
    return {k: (round(v, digits) if isinstance(v, float) else v) for k, v in row.items()}


def copy_bandwidth_gbs():
    """Device copy of 1 GiB: (read + write bytes) / time, the memory's practical ceiling."""
    src = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = eager_us(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() * 2 / (t * 1e-6) / 1e9


def fbgemm_ops():
    try:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401
        return torch.ops.fbgemm
    except Exception as e:  # noqa: BLE001
        print(f"FBGEMM gen_ai not available: {type(e).__name__}: {e}")
        return None


def torch_shuffling(scores_TE, k):
    """Plain PyTorch: top-k, counts, and the expert-sorted permutation (stable: deterministic)."""
    val, ids = scores_TE.topk(k, dim=1)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=scores_TE.shape[1])
    order = torch.sort(flat, stable=True).indices
    return counts, flat[order], order // k, val


def bench_shuffle(args, log):
    fb = fbgemm_ops()
    rows = []
    for T in ([128, 2048] if args.quick else [1, 16, 128, 256, 2048, 8192]):
        for E in (16, 128):
            logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
            scores = torch.sigmoid(logits)
            r = {"T": T, "E": E, "k": 1}
            r["torch_us"], _ = timed_us(lambda: torch_shuffling(torch.sigmoid(logits), 1))
            r["default_us"], _ = timed_us(lambda: index_shuffling(logits, 1, "sigmoid"))  # turbomoe's choice
            r["cuda_us"], _ = timed_us(lambda: csrc.index_shuffling(logits, 1, "sigmoid"))  # one block, whatever T
            r["triton_us"], _ = timed_us(lambda: triton_shuffling(logits, 1, "sigmoid"))
            # each path forced, for the crossovers: CUDA's one block, Triton's one program and two launches
            r["triton_one_block_us"], _ = timed_us(lambda: triton_shuffling(logits, 1, "sigmoid", one_block_tiles=T))
            r["triton_two_launch_us"], _ = timed_us(lambda: triton_shuffling(logits, 1, "sigmoid", one_block_tiles=0))
            if fb is not None:
                try:
                    r["fbgemm_us"], r["fbgemm_timing"] = timed_us(lambda: fb.index_shuffling(scores, top_k=1))
                except Exception as e:  # noqa: BLE001
                    log(f"  FBGEMM index_shuffling failed at T={T} E={E}: {type(e).__name__}: {str(e)[:200]}")
            rows.append(r)
            log("shuffle " + json.dumps(rounded(r)))
    return rows


LAYERS = {
    "qwen3-30b-a3b": dict(E=128, k=8, M=2048, F=768, score_func="softmax", renormalize=True, shared=False,
                          prescale=False),
    "scout-tp8": dict(E=16, k=1, M=5120, F=1024, score_func="sigmoid", renormalize=False, shared=True, prescale=True),
}


def plain_torch_moe(x, router, w1, w2, k, score_func, renormalize, shared_w1, shared_w2, prescale):
    """MoE block in plain PyTorch on torch._grouped_mm: top-k, sort, index_select, two grouped GEMMs,
    index_add_ (graph-capturable: no host sync)."""
    T, M = x.shape
    logits = F.linear(x, router).float()
    p = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    sc, ids = p.topk(k, -1)
    if renormalize:
        sc = sc / sc.sum(-1, keepdim=True)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    tok = order // k
    counts = torch.bincount(flat, minlength=w1.shape[0]).to(torch.int32)
    rows = x.index_select(0, tok)
    s_rows = sc.reshape(-1)[order]
    if prescale:
        rows = (rows * s_rows[:, None]).to(x.dtype)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(rows, w1, offs=offs)
    a = F.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:]
    y = torch._grouped_mm(a, w2, offs=offs)
    if not prescale:
        y = y * s_rows[:, None].to(y.dtype)
    out = torch.zeros(T, M, device=x.device, dtype=torch.float32).index_add_(0, tok, y.float())
    if shared_w1 is not None:
        hs = x @ shared_w1
        out += (F.silu(hs[:, :hs.shape[1] // 2]) * hs[:, hs.shape[1] // 2:]) @ shared_w2
    return out.to(x.dtype)


def hf_block(name, cfg, router, w1, w2, sw1, sw2):
    """transformers' own MoE block with the same weights: Qwen3MoeSparseMoeBlock or Llama4TextMoe."""
    E, M, F_ = cfg["E"], cfg["M"], cfg["F"]
    if name.startswith("qwen3"):
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        c = Qwen3MoeConfig(hidden_size=M, moe_intermediate_size=F_, num_experts=E, num_experts_per_tok=cfg["k"],
                           norm_topk_prob=cfg["renormalize"])
        block = Qwen3MoeSparseMoeBlock(c)
        block.gate.weight.data = router.clone()
    else:
        from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
        c = Llama4TextConfig(hidden_size=M, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=cfg["k"])
        block = Llama4TextMoe(c)
        block.router.weight.data = router.clone()
        block.shared_expert.gate_proj.weight.data = sw1[:, :F_].t().contiguous()
        block.shared_expert.up_proj.weight.data = sw1[:, F_:].t().contiguous()
        block.shared_expert.down_proj.weight.data = sw2.t().contiguous()
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):
        gu = experts.gate_up_proj
        # transformers stores gate_up either [E, 2F, M] (Qwen3 5.x) or [E, M, 2F] (Llama 4)
        experts.gate_up_proj.data = (w1.transpose(1, 2) if gu.shape[1] == 2 * F_ else w1).contiguous()
        experts.down_proj.data = (w2.transpose(1, 2) if experts.down_proj.shape[1] == M else w2).contiguous()
    return block.to(device="cuda", dtype=torch.bfloat16).eval()


COPIES = 3  # weight sets a timing cycles through: no call finds its weights in L2 (H100: 50 MB) from the call before


def chosen_layers(args):
    return [(name, cfg) for name, cfg in LAYERS.items() if name in args.layers]


def cycling(fns):
    """One callable calling fns in turn (captured REPS times, a graph cycles through them)."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def layer_weights(cfg, g):
    """A decode layer's random bf16 weights on g's device: the router and COPIES sets of (w1, w2,
    shared w1, shared w2), drawn from g in a fixed order (every section sees the same weights)."""
    E, M, F_ = cfg["E"], cfg["M"], cfg["F"]
    dev = dict(device=g.device, dtype=torch.bfloat16)
    router = torch.randn(E, M, generator=g, **dev) * M ** -0.5
    sets = [(torch.randn(E, M, 2 * F_, generator=g, **dev) * M ** -0.5,
             torch.randn(E, F_, M, generator=g, **dev) * F_ ** -0.5,
             torch.randn(M, 2 * F_, generator=g, **dev) * M ** -0.5 if cfg["shared"] else None,
             torch.randn(F_, M, generator=g, **dev) * F_ ** -0.5 if cfg["shared"] else None) for _ in range(COPIES)]
    return router, sets


def decode_weight_bytes(cfg, experts_used: int, element_size: int = 2) -> int:
    """Bytes of the weights a decode step of the layer must read: w1 [M, 2F] and w2 [F, M] of each
    routed expert with a token, the shared expert's (always), and the router [E, M]."""
    E, M, F_ = cfg["E"], cfg["M"], cfg["F"]
    return ((experts_used + int(cfg["shared"])) * 3 * M * F_ + E * M) * element_size


def layer_moes(cfg, router, sets, mode):
    return [SparseMoE(router, w1, w2, cfg["k"], shared_w1_MN=sw1, shared_w2_FM=sw2, mode=mode,
                      dense_max=10 ** 9 if mode == "dense" else 0, score_func=cfg["score_func"],
                      renormalize=cfg["renormalize"], prescale=cfg["prescale"]) for w1, w2, sw1, sw2 in sets]


def bench_layer(args, log, bandwidth):
    rows = []
    for name, cfg in chosen_layers(args):
        E, k, M, F_ = cfg["E"], cfg["k"], cfg["M"], cfg["F"]
        g = torch.Generator(device="cuda").manual_seed(0)
        dev = dict(device="cuda", dtype=torch.bfloat16)
        router, sets = layer_weights(cfg, g)
        moes = {mode: layer_moes(cfg, router, sets, mode) for mode in ("auto", "few_rows", "grouped", "dense")}
        moes["tuned"] = layer_moes(cfg, router, sets, "auto")  # auto, the few-rows tilings measured here
        t0 = time.perf_counter()
        blocks = {}
        table = moes["tuned"][0].tune(args.layer_tokens, report=blocks)
        tune_s = time.perf_counter() - t0
        log(f"  {name}: the block in the tune, us on the rule's / the chosen tilings: "
            + json.dumps({T: [round(us, 2) for us in pair] for T, pair in blocks.items()}))
        for m in moes["tuned"][1:]:
            m.few_rows_tiles = dict(table)
        log(f"  {name}: tuned in {tune_s:.0f} s, tilings "
            + json.dumps({T: [tile_name(t) for t in pair] for T, pair in table.items()}))
        try:
            hf = [hf_block(name, cfg, router, *ws) for ws in sets]
        except Exception as e:  # noqa: BLE001
            log(f"  transformers block unavailable for {name}: {type(e).__name__}: {e}")
            hf = None
        for T in args.layer_tokens:
            x = torch.randn(T, M, generator=g, **dev)
            ids = F.linear(x, router).float().topk(k, -1).indices
            used = int(torch.unique(ids).numel())
            weight_bytes = decode_weight_bytes(cfg, used)
            r = {"layer": name, "T": T, "experts_used": used, "floor_us": weight_bytes / (bandwidth * 1e9) * 1e6}
            for mode, ms in moes.items():
                r[f"{mode}_us"], _ = timed_us(cycling([lambda m=m: m(x) for m in ms]))
            r["torch_us"], r["torch_timing"] = timed_us(cycling([lambda ws=ws: plain_torch_moe(
                x, router, ws[0], ws[1], k, cfg["score_func"], cfg["renormalize"], ws[2], ws[3], cfg["prescale"])
                for ws in sets]))
            if hf is not None:
                with torch.no_grad():
                    r["transformers_us"], r["transformers_timing"] = timed_us(cycling([lambda b=b: b(x[None]) for b in hf]))
            r["floor_fraction"] = r["floor_us"] / r["auto_us"]
            rows.append(r)
            log("layer " + json.dumps(rounded(r)))
    return rows


def few_rows_steps(args, device="cuda"):
    """Per decode layer and token count of --tune-tokens: the few-rows SparseMoE over COPIES weight
    sets (the layer section's weights and first draws), the step's x, the router's output `routed`
    (logits, or the split router's parts, and their dtype), the shuffled routes r, the prescale
    scores (or None) and the first GEMM's output h at its rule's tiles."""
    from turbomoe.kernels.few_rows_gemm import few_rows_up
    for name, cfg in chosen_layers(args):
        g = torch.Generator(device=device).manual_seed(0)
        router, sets = layer_weights(cfg, g)
        moes = layer_moes(cfg, router, sets, "few_rows")
        for T in args.tune_tokens:
            x = torch.randn(T, cfg["M"], generator=g, device=device, dtype=torch.bfloat16)
            routed = moes[0]._router(x, "few_rows")  # (logits or the split router's parts, their dtype)
            r = moes[0]._shuffle(*routed, "few_rows")
            scale = r.scores if cfg["prescale"] else None
            h = few_rows_up(x, r.row_routes, r.slots.shape[1], moes[0].w1, r.counts, T, scale)
            yield name, cfg, moes, T, x, routed, r, scale, h


def bench_stages(args, log, device="cuda"):
    """The few-rows layer's kernels each timed alone on the step's real routes, beside the layer."""
    from turbomoe.kernels.few_rows_gemm import combine, few_rows_down, few_rows_up
    rows = []
    for name, cfg, moes, T, x, routed, r, scale, h in few_rows_steps(args, device):
        kk, m0 = r.slots.shape[1], moes[0]
        y = few_rows_down(h, m0.w2, r.counts, T)
        st = {"layer_us": graph_us(cycling([lambda m=m: m(x) for m in moes])),
              "router_us": graph_us(lambda: m0._router(x, "few_rows")),
              "shuffle_us": graph_us(lambda: m0._shuffle(*routed, "few_rows")),
              "up_us": graph_us(cycling([lambda m=m: few_rows_up(x, r.row_routes, kk, m.w1, r.counts, T, scale)
                                         for m in moes])),
              "down_us": graph_us(cycling([lambda m=m: few_rows_down(h, m.w2, r.counts, T) for m in moes])),
              "combine_us": graph_us(lambda: combine(y, r.slots, None if cfg["prescale"] else r.scores, x.dtype))}
        row = {"layer": name, "T": T, "groups_used": int((r.counts > 0).sum()), **st,
               "kernels_sum_us": sum(st.values()) - st["layer_us"], "up_partials": list(h.shape)}
        rows.append(row)
        log("stages " + json.dumps(rounded(row)))
    return rows


def tile_name(t) -> str:
    """block_m x block_n x split x block_k x stages, s: swapped MMA operands, p: per-thread weight loads;
    None (a tune that kept the rule): "rule"."""
    if t is None:
        return "rule"
    return f"{t.block_m}x{t.block_n}x{t.split}x{t.block_k}x{t.num_stages}" + "s" * t.swap + "p" * (not t.tma)


def bench_tune(args, log, bandwidth, device="cuda"):
    """The decode experts' two GEMM kernels (few_rows_up, few_rows_down) swept over tile_space on the
    step's real routes, the rule's choice beside the best and the weight-read floor (the data behind
    few_rows_tiles). down reads up's output at the rule's tiles (SwiGLU rows, or partial sums where
    up splits K; each GEMM alone: up's split also sets down's cost, so it is tuned in the layer too:
    UP_MAX_SPLIT)."""
    from turbomoe.kernels.few_rows_gemm import UP_MAX_SPLIT, few_rows_down, few_rows_tiles, few_rows_up
    rows_out = []
    for name, cfg, moes, T, x, routed, r, scale, h in few_rows_steps(args, device):
        kk, G, M, F_ = r.slots.shape[1], moes[0].w1.shape[0], cfg["M"], cfg["F"]
        used = int((r.counts > 0).sum())
        gemms = (("up", M, 2 * F_, lambda t: cycling([lambda m=m: few_rows_up(x, r.row_routes, kk, m.w1, r.counts, T,
                                                                             scale, tiles=t) for m in moes])),
                 ("down", F_, M, lambda t: cycling([lambda m=m: few_rows_down(h, m.w2, r.counts, T, tiles=t)
                                                    for m in moes])))
        for op, K, N, fn in gemms:
            rule = few_rows_tiles(T, T * kk, G, N, K, x.device, *((UP_MAX_SPLIT, True) if op == "up" else ()))
            res = {}
            for tiles in tile_space(T, K):
                t = graph_us(fn(tiles), iters=10)
                if t is not None:  # None: the tiling does not fit the device (shared memory)
                    res[tiles] = t
            if not res:
                log(f"tune: no tiling of {op} fits at {name} T = {T}")
                continue
            best = min(res, key=res.get)
            row = {"layer": name, "T": T, "gemm": op, "groups_used": used, "rule": list(rule),
                   "rule_us": graph_us(fn(rule), iters=10), "best": list(best), "best_us": res[best],
                   "floor_us": used * K * N * 2 / (bandwidth * 1e9) * 1e6,
                   "top8": {tile_name(c): round(res[c], 1) for c in sorted(res, key=res.get)[:8]}}
            rows_out.append(row)
            log("tune " + json.dumps(rounded(row)))
    return rows_out


GEN_REPEATS = 3  # timed generate calls of each way (turbomoe, tuned, transformers eager, compiled): the fastest


def fastest_wall(fn, sync=lambda: None, repeats: int = GEN_REPEATS):
    """(output, seconds) of the fastest of `repeats` calls of fn, each timed on the wall clock between
    two syncs. Every way of the generate section goes through here, so none gets more tries than another."""
    best = None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        t = time.perf_counter() - t0
        if best is None or t < best[1]:
            best = (out, t)
    return best


class Discard:
    """A streamer (transformers' protocol) that takes each step's tokens, read to the host, and drops them."""
    def put(self, tokens):
        pass

    def end(self):
        pass


GEN_MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=640,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                 num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=512, initializer_range=0.02)


SAMPLINGS = {"greedy": dict(), "greedy, penalty 1.1": dict(repetition_penalty=1.1),
             "temperature 0.7": dict(do_sample=True, temperature=0.7),
             "top-p 0.95": dict(do_sample=True, temperature=0.7, top_p=0.95),
             "Qwen3 (0.6, top-k 20, top-p 0.95)": dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95),
             "Qwen3 + min-p 0.05, penalty 1.1": dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, min_p=0.05,
                                                    repetition_penalty=1.1)}


def bench_sampling(args, log, vocab=151936, prompt_len=512):
    """us per decode step's token choice, turbomoe's Sampling.select against transformers' processors
    (as its generate chains them) and its multinomial draw."""
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from turbomoe.inference.sampling import Sampling
    rows = []
    for B, (name, kw) in itertools.product((1, 8, 64), SAMPLINGS.items()):
        s = Sampling.checked(**{**dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                       repetition_penalty=1.0), **kw})
        logits = torch.randn(B, vocab, device="cuda") * 3
        prompt = torch.randint(0, vocab, (B, prompt_len), device="cuda")
        history = s.history(prompt, torch.ones_like(prompt, dtype=torch.bool), 1)
        chain = [RepetitionPenaltyLogitsProcessor(s.repetition_penalty)] if s.repetition_penalty != 1 else []
        if s.do_sample:
            chain += [TemperatureLogitsWarper(s.temperature)] if s.temperature != 1 else []
            chain += [TopKLogitsWarper(s.top_k)] if s.top_k else []
            chain += [TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []
            chain += [MinPLogitsWarper(s.min_p)] if s.min_p > 0 else []

        def peer():
            scores = logits
            for f in chain:
                scores = f(prompt, scores)
            if not s.do_sample:
                return scores.argmax(-1)
            return torch.multinomial(scores.softmax(-1), 1)[:, 0]

        def ours_fn():  # one new token's slot, written again each call (a graph replays the same write)
            if history is not None:
                history.filled = prompt_len
            return s.select(logits, history)

        ours, how = timed_us(ours_fn)
        theirs, how_peer = timed_us(peer)
        rows.append(dict(batch=B, settings=name, turbomoe_us=ours, transformers_us=theirs, speedup=theirs / ours,
                         timing=how if how == how_peer else f"{how} / {how_peer}"))
        log(json.dumps(rounded(rows[-1])))
    return rows


def bench_generate(args, log, prompt_len=32, new_tokens=64):
    """Tokens/s of generate (prefill + new_tokens greedy steps, all rows to the end) on a random ~1B
    Qwen3-MoE saved by transformers and read by turbomoe.inference.load (and loaded again with
    tune=True: the few-rows tilings measured at these batch sizes, unless --generate-no-tune)."""
    import tempfile

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from turbomoe.inference import load
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**GEN_MODEL)).to(device="cuda", dtype=torch.bfloat16).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    path = tempfile.mkdtemp()
    hf.save_pretrained(path)
    batches = [1, 8] if args.quick else [1, 8, 64]
    engine = load(path, device="cuda", dtype=torch.bfloat16, max_batch=max(batches),
                  max_seq_len=prompt_len + new_tokens)
    tuned = None
    if not args.generate_no_tune:
        t0 = time.perf_counter()
        tuned = load(path, device="cuda", dtype=torch.bfloat16, max_batch=max(batches), buckets=batches,
                     max_seq_len=prompt_len + new_tokens, tune=True)
        log(f"  generate: tuned in {time.perf_counter() - t0:.0f} s (load included), tilings "
            + json.dumps({T: [tile_name(t) for t in pair] for T, pair in tuned.few_rows_tiles.items()}))
    rows = []

    def fastest(fn):
        return fastest_wall(fn, torch.cuda.synchronize)

    for B in batches:
        ids = torch.randint(0, GEN_MODEL["vocab_size"], (B, prompt_len), device="cuda")
        r = {"batch": B, "params": n_params, "prompt": prompt_len, "new_tokens": new_tokens,
             "timed_calls_each": GEN_REPEATS}
        engine.generate(ids, new_tokens)  # warm-up: kernels and this bucket's decode graph
        ours, t = fastest(lambda: engine.generate(ids, new_tokens))
        r["turbomoe_tok_s"] = B * new_tokens / t
        _, t = fastest(lambda: engine.generate(ids, new_tokens, streamer=Discard()))  # a host read a step
        r["turbomoe_streamed_tok_s"] = B * new_tokens / t
        if tuned is not None:
            tuned.generate(ids, new_tokens)
            _, t = fastest(lambda: tuned.generate(ids, new_tokens))
            r["turbomoe_tuned_tok_s"] = B * new_tokens / t
        hf_kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
            # the same timing as turbomoe's above (until 2026-12: one call here against its fastest of 3)
            theirs, t = fastest(lambda: hf.generate(ids, **hf_kw))
            r["transformers_eager_tok_s"] = B * new_tokens / t
            r["same_tokens_as_eager"] = float((theirs == ours).float().mean())
            if B in args.hf_compile_batches:
                try:
                    hf.generate(ids, cache_implementation="static", **hf_kw)  # compiles
                    _, t = fastest(lambda: hf.generate(ids, cache_implementation="static", **hf_kw))
                    r["transformers_static_compiled_tok_s"] = B * new_tokens / t
                except Exception as e:  # noqa: BLE001
                    log(f"  transformers static-cache compiled generate failed: {type(e).__name__}: {str(e)[:200]}")
        r["speedup_vs_eager"] = r["turbomoe_tok_s"] / r["transformers_eager_tok_s"]
        rows.append(r)
        log("generate " + json.dumps(rounded(r, 3)))
    return rows


# Qwen3-30B-A3B's config.json (its decoding-relevant fields)
QWEN3_30B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                 num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)


def random_on_gpu(make):
    """make() built on the meta device, cast to bf16 and given GPU memory, then normal(0, 0.02) weights
    (norms 1): a 61 GB model in seconds, never in host memory. Modules holding buffers (transformers'
    rotary embedding: inv_freq, computed at construction) are made again on the GPU: to_empty leaves
    buffers uninitialised."""
    with torch.device("meta"):
        model = make()
    model = model.to(torch.bfloat16).to_empty(device="cuda")
    for name, module in list(model.named_modules()):
        if next(module.buffers(recurse=False), None) is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, type(module)(config=module.config).to("cuda"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model.eval()


def qwen3_30b_engine(**engine_kw):
    """turbomoe's Engine on a random model of Qwen3-30B-A3B's config (random_on_gpu)."""
    from turbomoe.inference import Engine
    from turbomoe.models import Qwen3MoeForCausalLM
    from turbomoe.models.config import ModelConfig
    fields = {f: QWEN3_30B[f] for f in QWEN3_30B if f in ModelConfig.__dataclass_fields__}
    return Engine(random_on_gpu(lambda: Qwen3MoeForCausalLM(ModelConfig.from_dict(fields))), **engine_kw)


def decode_floor_ms(cfg: dict, B: int, context: int, copy_gbs: float) -> float:
    """Bytes one decode step of B rows must read, over the copy bandwidth: every dense weight and the LM
    head, the experts that B tokens routed uniformly (k distinct each) use in expectation, the router and
    the KV cache of `context` tokens a row; bf16."""
    H, L, E, k = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]
    D, N, G = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attention = H * (N + 2 * G) * D + N * D * H
    used = E * (1 - ((E - k) / E) ** B)
    experts = used * 3 * H * cfg["moe_intermediate_size"]
    elements = L * (attention + E * H + experts + B * context * 2 * G * D) + cfg["vocab_size"] * H
    return elements * 2 / (copy_gbs * 1e9) * 1e3


def bench_generate_30b(args, log, copy_gbs, prompt_len=128, new_tokens=64):
    """Tokens/s at Qwen3-30B-A3B's size, random weights (greedy, all rows to the end): transformers' eager
    generate on its model, which is then freed, and turbomoe's engine on a model of its own."""
    import gc

    from transformers import Qwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM as HF
    batches = [1, 8] if args.quick else [1, 8, 64]
    torch.manual_seed(0)
    prompts = {B: torch.randint(0, QWEN3_30B["vocab_size"], (B, prompt_len), device="cuda") for B in batches}
    rows = {B: {"batch": B, "prompt": prompt_len, "new_tokens": new_tokens, "timed_calls_each": GEN_REPEATS,
                "floor_tok_s": B / decode_floor_ms(QWEN3_30B, B, prompt_len + new_tokens // 2, copy_gbs) * 1e3}
            for B in batches}

    def fastest(fn):
        return fastest_wall(fn, torch.cuda.synchronize)

    t0 = time.perf_counter()
    hf = random_on_gpu(lambda: HF(Qwen3MoeConfig(**QWEN3_30B)))
    rows[1]["params"] = sum(p.numel() for p in hf.parameters())
    log(f"  generate-30b: transformers' model made in {time.perf_counter() - t0:.1f} s, {rows[1]['params']:,} "
        f"parameters, {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    hf_kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for B in batches:
            hf.generate(prompts[B], max_new_tokens=2, do_sample=False, pad_token_id=0)
            _, t = fastest(lambda: hf.generate(prompts[B], **hf_kw))
            rows[B]["transformers_eager_tok_s"] = B * new_tokens / t
            log(f"  generate-30b: transformers eager, batch {B}: {rows[B]['transformers_eager_tok_s']:.1f} tokens/s")
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    engine = qwen3_30b_engine(max_batch=max(batches), max_seq_len=prompt_len + new_tokens)
    engine.reserve(max(batches), prompt_len + new_tokens)
    log(f"  generate-30b: turbomoe's engine made in {time.perf_counter() - t0:.1f} s, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    for B in batches:
        t0 = time.perf_counter()
        engine.generate(prompts[B], new_tokens)  # warm-up: compiles, captures this bucket's decode graph
        warm = time.perf_counter() - t0
        _, t = fastest(lambda: engine.generate(prompts[B], new_tokens))
        r = rows[B]
        r["turbomoe_tok_s"] = B * new_tokens / t
        r["speedup_vs_eager"] = r["turbomoe_tok_s"] / r["transformers_eager_tok_s"]
        r["of_floor"] = r["turbomoe_tok_s"] / r["floor_tok_s"]
        log(f"generate-30b (first call {warm:.1f} s) " + json.dumps(rounded(r, 3)))
    return list(rows.values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/bench_inference")
    p.add_argument("--sections", default="shuffle,layer,generate",
                   help="also: generate-30b (Qwen3-30B-A3B's size), sampling (a step's token choice), stages (the few-rows layer's kernels one by one), "
                   "tune (the few-rows GEMMs' sweep)")
    p.add_argument("--hf-compile-batches", type=lambda v: [int(b) for b in v.split(",") if b], default=[1],
                   help="batch sizes at which to time transformers' static-cache compiled generate")
    p.add_argument("--generate-no-tune", action="store_true",
                   help="generate without the tuned engine (its tune takes ~2 minutes on an H100)")
    p.add_argument("--tune-tokens", type=lambda v: [int(t) for t in v.split(",") if t], default=[1, 8, 16, 64],
                   help="token counts of the stages and tune sections")
    p.add_argument("--layer-tokens", type=lambda v: [int(t) for t in v.split(",") if t], default=[1, 8, 16, 32, 64, 256],
                   help="token counts of the layer section")
    p.add_argument("--layers", type=lambda v: v.split(","), default=list(LAYERS),
                   help="decode layers of the layer, stages and tune sections (default: all)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    require_gpu("bench_inference.py")
    if set(args.layers) - set(LAYERS):
        p.error(f"--layers: unknown {sorted(set(args.layers) - set(LAYERS))}, choose from {list(LAYERS)}")
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "bench_inference.log"), "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    result["copy_GBs"] = copy_bandwidth_gbs()
    log(f"{result['device']} torch {result['torch']} {result['utc']} UTC, copy bandwidth {result['copy_GBs']:.0f} GB/s")
    sections = args.sections.split(",")
    if "shuffle" in sections:
        result["shuffle"] = bench_shuffle(args, log)
    if "layer" in sections:
        result["layer"] = bench_layer(args, log, result["copy_GBs"])
    if "stages" in sections:
        result["stages"] = bench_stages(args, log)
    if "tune" in sections:
        result["tune"] = bench_tune(args, log, result["copy_GBs"])
    if "sampling" in sections:
        result["sampling"] = bench_sampling(args, log)
    if "generate" in sections:
        result["generate"] = bench_generate(args, log)
    if "generate-30b" in sections:
        result["generate_30b"] = bench_generate_30b(args, log, result["copy_GBs"])
    with open(os.path.join(args.out, "bench_inference.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

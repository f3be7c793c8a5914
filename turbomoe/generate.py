"""Generate text from a Hugging Face Qwen3-MoE directory at a terminal, on turbomoe's inference engine.

    python -m turbomoe.generate MODEL_DIR --prompt "def fib(n):" [--max-new-tokens 64] [--sample
        --temperature 0.8 --top-p 0.95] [--dtype bf16|fp16|fp32] [--device cuda|cpu] [--seed 0]

The tokenizer is the directory's (transformers' AutoTokenizer). Prints the continuation, then the
prefill and decode times and the decode tokens/s (the first call of a batch size also captures its
CUDA graph: reported apart).
"""
import argparse
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m turbomoe.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--prompt", required=True, action="append", help="repeat for a batch of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    p.add_argument("--device", default=None, help="default: cuda where available")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if any(not prompt for prompt in args.prompt):
        p.error("--prompt must not be empty")
    if args.sample and not (args.temperature > 0 and 0 < args.top_p <= 1):
        p.error(f"--sample needs --temperature > 0 and 0 < --top-p <= 1, got {args.temperature}, {args.top_p}")

    from transformers import AutoTokenizer

    from .inference import load
    from .inference.engine import check_model_dir
    try:  # before the tokenizer, which would take a missing directory for a Hub model's name
        check_model_dir(args.model_dir)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    batch = tok(args.prompt, return_tensors="pt", padding=True)
    B, T = batch["input_ids"].shape
    engine = load(args.model_dir, device=args.device, dtype=DTYPES.get(args.dtype), max_batch=max(B, 1),
                  max_seq_len=T + args.max_new_tokens)
    gen = torch.Generator(device=engine.device).manual_seed(args.seed)
    kw = dict(attention_mask=batch["attention_mask"], eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
              do_sample=args.sample, temperature=args.temperature, top_p=args.top_p, generator=gen)

    def timed(n):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(batch["input_ids"], n, **kw)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    _, warm = timed(min(2, args.max_new_tokens))  # compiles kernels, captures the decode graph of this batch size
    _, prefill = timed(1)
    out, total = timed(args.max_new_tokens)
    for row in out[:, T:]:
        print(tok.decode(row, skip_special_tokens=True))
    steps = out.shape[1] - T - 1
    decode = total - prefill  # the two calls' difference: noise can exceed it when little is decoded
    rate = f"{B * steps / decode:.1f} tokens/s" if steps > 0 and decode > 0 else "too short to time"
    print(f"\n[{B} x {out.shape[1] - T} new tokens] prefill {prefill * 1e3:.1f} ms, decode "
          f"{max(decode, 0) * 1e3:.1f} ms ({rate}), first call (kernel build, graph capture) {warm:.2f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()

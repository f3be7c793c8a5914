"""Generate text from a Hugging Face Qwen3-MoE directory at a terminal, on turbomoe's inference engine.

    python -m turbomoe.generate MODEL_DIR --prompt "def fib(n):" [--max-new-tokens 64] [--greedy | --sample]
        [--temperature T] [--top-k K] [--top-p P] [--min-p P] [--repetition-penalty R] [--min-new-tokens N]
        [--num-return-sequences N]
        [--chat [--system TEXT] [--chat-kwargs JSON]] [--dtype bf16|fp16|fp32] [--device cuda|cpu] [--seed 0]
        [--tune] [--tiles FILE] [--stream]

The tokenizer is the directory's (transformers' AutoTokenizer); generation stops at the EOS ids of the
directory's generation_config.json (else config.json) and the tokenizer's. With --chat each prompt is a user message put
through the tokenizer's chat template (a published chat model's, such as Qwen3's), after --system's;
--chat-kwargs sets the template's variables ('{"enable_thinking": false}': Qwen3 answers without thinking).
Decoding follows the directory's generation_config.json as transformers' generate does (Qwen3's chat
models sample: temperature 0.6, top-k 20, top-p 0.95), transformers' defaults where it sets nothing
(greedy; top-k 50 when sampling); --greedy, --sample and the sampling flags override it, and the
settings used are printed, with those of the file that the engine does not implement (beam search,
typical-p, ...), which it ignores. Prints the continuation, then the prefill and decode times and the
decode tokens/s (the first call of a batch size also captures its CUDA graph: reported apart). Sampled,
the text is what Engine.generate gives with a generator seeded --seed. On a GPU, --tune first measures
the decode step's few-rows GEMM tilings for this batch size (Engine(tune=True)); --tiles FILE reads the
table measured for this GPU, model shape and dtype from FILE, and after --tune keeps the new one there
(turbomoe.inference.tiling's tile files). --stream (one prompt) prints the text as it is made
(transformers' TextStreamer through Engine.generate's streamer); its timing then includes the printing.
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def eos_ids(path: str, stored: dict, tok) -> list:
    """The EOS ids to stop at: those of stored, the directory's settings file as read at path
    (sampling.generation_file: generation_config.json, else config.json, as transformers' generate; a model
    may list several, as Qwen3's chat models do), then the tokenizer's, each once. Checked here, before the
    model loads, not by the first generate."""
    from .inference.engine import _token_ids
    ids = _token_ids(stored.get("eos_token_id"), f"{path}'s eos_token_id") + [tok.eos_token_id]
    return list(dict.fromkeys(i for i in ids if i is not None))


def describe(decoding: dict) -> str:
    """The decoding settings in use, those that act."""
    on = {"repetition_penalty": decoding["repetition_penalty"] != 1, "min_new_tokens": decoding["min_new_tokens"] > 0}
    if decoding["do_sample"]:
        on.update(temperature=True, top_k=decoding["top_k"] > 0, top_p=decoding["top_p"] < 1, min_p=decoding["min_p"] > 0,
                  num_return_sequences=decoding["num_return_sequences"] > 1)
    words = ["sampling" if decoding["do_sample"] else "greedy"]
    return ", ".join(words + [f"{k} {decoding[k]}" for k, v in on.items() if v])


def json_object(text: str) -> dict:
    """--chat-kwargs' value: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of the template's variables, got {text!r}")
    return value


def chat_texts(tok, prompts: list, system, p, template_kwargs=None) -> list:
    """Each prompt as the chat template's text of one user turn (after a system turn where given), ready
    for the assistant's reply; template_kwargs are the template's own variables (Qwen3's
    enable_thinking, say)."""
    if not tok.chat_template:
        p.error("--chat: the tokenizer has no chat template (chat_template in tokenizer_config.json or "
                "chat_template.jinja): prompt the model as plain text instead")
    from jinja2 import TemplateError
    head = [{"role": "system", "content": system}] if system is not None else []
    try:
        return [tok.apply_chat_template(head + [{"role": "user", "content": text}], tokenize=False,
                                        add_generation_prompt=True, **(template_kwargs or {})) for text in prompts]
    except (TemplateError, ValueError) as e:  # a template's raise_exception (no system role, say), or no default one
        p.error(f"--chat: the tokenizer's chat template failed: {e}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m turbomoe.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--prompt", required=True, action="append", help="repeat for a batch of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--greedy", dest="sample", action="store_false", default=None,
                     help="greedy decoding (default: generation_config.json's do_sample)")
    how.add_argument("--sample", dest="sample", action="store_true", default=None, help="sample")
    for flag, kind, default in (("--temperature", float, 1.0), ("--top-k", int, "50; 0: off"), ("--top-p", float, 1.0),
                                ("--min-p", float, "0: off"), ("--repetition-penalty", float, "1: off"),
                                ("--min-new-tokens", int, "0: off"), ("--num-return-sequences", int, "1")):
        p.add_argument(flag, type=kind, default=None, help=f"default: generation_config.json's, else {default}")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    p.add_argument("--device", default=None, help="default: cuda where available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tune", action="store_true", help="measure the few-rows GEMMs' tilings first (GPU)")
    p.add_argument("--tiles", metavar="FILE", help="tile file: the table for this GPU and model read from it, "
                   "and after --tune written to it")
    p.add_argument("--chat", action="store_true", help="each prompt a user message, through the tokenizer's chat template")
    p.add_argument("--system", help="with --chat: a system message before each prompt")
    p.add_argument("--chat-kwargs", metavar="JSON", type=json_object, default=None,
                   help="with --chat: the chat template's variables, e.g. '{\"enable_thinking\": false}' (Qwen3)")
    p.add_argument("--stream", action="store_true", help="print the text as it is made (one prompt)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if any(not prompt for prompt in args.prompt):
        p.error("--prompt must not be empty")
    if not -(1 << 63) <= args.seed < 1 << 64:  # torch.Generator.manual_seed's range
        p.error(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    if args.system is not None and not args.chat:
        p.error("--system needs --chat")
    if args.chat_kwargs is not None and not args.chat:
        p.error("--chat-kwargs needs --chat")
    if args.stream and len(args.prompt) > 1:
        p.error(f"--stream prints one prompt's text as it is made; got {len(args.prompt)} prompts")

    if args.tune and args.tiles:  # where the tune's table will be written, before the load and the tune
        folder = os.path.dirname(os.path.abspath(args.tiles))
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)):
            p.error(f"--tiles {args.tiles}: its folder {folder} does not exist or is not writable")

    from .inference.engine import engine_device
    try:
        device = engine_device(args.device)
    except ValueError as e:
        p.error(f"--{e}")  # its messages begin "device"
    if (args.tune or args.tiles) and device.type != "cuda":
        p.error(f"--tune and --tiles choose the GPU kernels' tilings; the device is {device}")

    from transformers import AutoTokenizer

    from .data.tokenizer import tokenizer_files
    from .inference import load
    from .inference.engine import check_model_dir
    from .inference.sampling import TRANSFORMERS_DEFAULTS, Sampling, file_settings, ignored_text, not_implemented
    from .inference.tiling import read_tile_file, read_tile_tables, tile_key, write_tile_file
    try:  # before the tokenizer, which would take a missing directory for a Hub model's name
        config = check_model_dir(args.model_dir)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    if not tokenizer_files(args.model_dir):
        # AutoTokenizer would not fail: it makes an empty tokenizer that turns any prompt into no tokens
        p.error(f"{args.model_dir} has no tokenizer (tokenizer.json, vocab.json, ...): save one beside the model")
    try:
        path, stored, held = file_settings(args.model_dir)
    except ValueError as e:
        p.error(str(e))
    given = dict(do_sample=args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                 min_p=args.min_p, repetition_penalty=args.repetition_penalty, min_new_tokens=args.min_new_tokens,
                 num_return_sequences=args.num_return_sequences)
    given = {k: v for k, v in given.items() if v is not None}
    # the directory's decoding settings under the flags given, checked together (as generate's arguments go
    # over the file's): a bad value of the file's that a flag replaces, or that --greedy leaves unused, stops nothing
    decoding = {**TRANSFORMERS_DEFAULTS, **stored, **given}
    try:
        Sampling.checked(**decoding)
    except ValueError as e:
        if not given:
            p.error(f"{path}: {e}")
        # each value as its flag; one no flag gave, but the file, named as the file's
        shown = (f"--{k.replace('_', '-')} {v}" + (f" ({path}'s)" if k in stored and k not in given else "")
                 for k, v in decoding.items() if k != "do_sample")
        p.error(f"{e}: {', '.join(shown)}")
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    try:
        eos = eos_ids(path, held, tok)  # the file file_settings read
    except ValueError as e:
        p.error(str(e))
    if tok.pad_token_id is None and eos:
        tok.pad_token_id = eos[0]
    # Left-padded here, not by the tokenizer, which refuses to pad (even one prompt) without a pad token;
    # the mask marks the padding, so its id is any the embedding has.
    if args.chat:  # the template writes the special tokens it wants (a BOS among them): none added
        rows = tok(chat_texts(tok, args.prompt, args.system, p, args.chat_kwargs), add_special_tokens=False)["input_ids"]
    else:
        rows = tok(args.prompt)["input_ids"]
    empty = [i for i, row in enumerate(rows) if not row]
    if empty:
        p.error(f"--prompt number {empty[0] + 1} makes no tokens with {args.model_dir}'s tokenizer")
    # B: the rows generated (each prompt num_return_sequences times), what the engine and a step are sized by
    B, T = len(rows) * decoding["num_return_sequences"], max(map(len, rows))
    if args.stream and B > 1:
        p.error(f"--stream prints one row's text as it is made; num_return_sequences is "
                f"{decoding['num_return_sequences']}")
    fill = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = {"input_ids": torch.tensor([[fill] * (T - len(row)) + row for row in rows]),
             "attention_mask": torch.tensor([[0] * (T - len(row)) + [1] * len(row) for row in rows])}
    positions = config.get("max_position_embeddings")
    if positions is not None and T + args.max_new_tokens > positions:
        p.error(f"a prompt of {T} tokens + --max-new-tokens {args.max_new_tokens} exceeds the model's "
                f"max_position_embeddings {positions}")
    if args.tiles:  # a file that is not a tile file refused before the load (and a tune's minutes)
        try:
            read_tile_tables(args.tiles)
        except ValueError as e:
            p.error(str(e))
    t0 = time.perf_counter()
    # one bucket, this batch's: the only decode step this run takes (and the only one --tune measures)
    # DeepSpeed, imported with the model's MoE layers, logs to the stdout of its import: stdout holds only the text
    with contextlib.redirect_stdout(sys.stderr):
        engine = load(args.model_dir, device=device, dtype=DTYPES.get(args.dtype), max_batch=B, buckets=(),
                      tune=args.tune)
    if args.tune:
        print(f"tuned the few-rows tilings in {time.perf_counter() - t0:.1f} s (the load included)", file=sys.stderr)
    if args.tiles:
        key = tile_key(torch.cuda.get_device_name(device), config["num_experts"], config["num_experts_per_tok"],
                       config["hidden_size"], config["moe_intermediate_size"], engine.dtype)
        try:
            if args.tune:
                write_tile_file(args.tiles, key, engine.few_rows_tiles)
            elif (tiles := read_tile_file(args.tiles, key)) is not None:
                engine.few_rows_tiles = tiles
                if B not in tiles:  # the decode step runs B tokens a MoE layer: the table's other counts unused
                    print(f"{args.tiles}'s table for {key} holds no tiling for {B} tokens (this batch size; it has "
                          f"{sorted(tiles)}): the rule's tilings (--tune measures them)", file=sys.stderr)
            else:
                print(f"{args.tiles} holds no tile table for {key}: the rule's tilings (--tune measures them)",
                      file=sys.stderr)
        except ValueError as e:
            p.error(str(e))
        except OSError as e:  # the folder was checked before the tune; a full disk, say, remains
            p.error(f"--tiles {args.tiles} could not be written: {e}")
    kw = dict(attention_mask=batch["attention_mask"], eos_token_id=eos, pad_token_id=tok.pad_token_id, **decoding)
    print(f"decoding: {describe(decoding)}", file=sys.stderr)
    ignored = not_implemented(held, decoding["do_sample"])
    if ignored:
        print(ignored_text(path, ignored), file=sys.stderr)

    def timed(n, seed, streamer=None):
        gen = torch.Generator(device=engine.device).manual_seed(seed)
        if engine.device.type == "cuda":  # the engine's GPU, which need not be the current one
            torch.cuda.synchronize(engine.device)
        t0 = time.perf_counter()
        out = engine.generate(batch["input_ids"], n, generator=gen, streamer=streamer, **kw)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        return out, time.perf_counter() - t0

    # The cache for the whole run first: else a run past the warm-up's slots would make it again (and
    # recapture the decode graph) inside the timed call.
    engine.reserve(B, T + args.max_new_tokens)
    # the warm-up compiles kernels (on CUDA the decode step's dense parts too) and captures the decode
    # graph of this batch size; each call its own generator, so the text printed is the one a generator
    # seeded --seed gives
    _, warm = timed(min(2, args.max_new_tokens), args.seed)
    _, prefill = timed(1, args.seed)
    if args.stream:  # one row: generation stops at its EOS, so no pad follows it
        from transformers import TextStreamer
        out, total = timed(args.max_new_tokens, args.seed, TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    else:
        out, total = timed(args.max_new_tokens, args.seed)
        stops = set(eos)
        for row in out[:, T:].tolist():
            # cut after the row's EOS: the pad ids after it are text where the tokenizer has them as no special token
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            print(tok.decode(row[:end], skip_special_tokens=True))
    steps = out.shape[1] - T - 1
    # the two calls' difference: noise can exceed it when little is decoded, and is all of it with no step
    decode = total - prefill if steps > 0 else 0.0
    rate = f"{B * steps / decode:.1f} tokens/s" if steps > 0 and decode > 0 else "too short to time"
    rate += ", streamed" if args.stream else ""
    print(f"\n[{B} x {out.shape[1] - T} new tokens] prefill {prefill * 1e3:.1f} ms, decode "
          f"{max(decode, 0) * 1e3:.1f} ms ({rate}), first call (kernel builds, torch.compile, graph capture) {warm:.2f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()

"""The few-rows GEMMs' tilings measured on this GPU, for SparseMoE.tune / Engine(tune=True).

few_rows_tiles' rule comes from H100 sweeps. On an H200 (4.2 TB/s where the H100 has 2.9 TB/s, the
same 132 SMs) it left Llama-4-Scout's first GEMM at 64 tokens at 111 us where a swept tiling took 85,
the weights' read time (notes/inference.md, 2026-11-29). tune_few_rows times the rule and the swept
tilings on the layer's own weights, with the routes of seeded random tokens and a cold L2 each call
(a decode step finds the layer's weights in DRAM), and keeps per token count the pair of tilings
whose two GEMMs take the least time where the whole layer is then clearly faster. The choice is
measured, so two tunings may choose differently: pass a table back (SparseMoE(few_rows_tiles=...),
load(..., few_rows_tiles=...)) for the same bits across loads, or keep it in a tile file
(read_tile_file / write_tile_file: tables for any number of GPUs and layer shapes, as
`python -m turbomoe.generate --tune --tiles FILE` keeps them).
"""
import fcntl
import itertools
import json
import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch

# The kernels are imported where used: TRITON_INTERPRET must be set before they are, and importing
# turbomoe.inference must not fix it.
TileTable = Dict[int, Tuple[tuple, tuple]]  # token count -> (first GEMM's Tiles, second GEMM's)


def tile_space(T: int, K: int) -> Iterable[tuple]:
    """The few-rows GEMMs' tilings swept (Tiles: block_m, block_n, split, block_k, warps, stages, swap,
    tma): one-row tiles at T = 1 (TMA or per-thread loads); beyond, up to 8 rows on the CUDA cores at
    T <= 8, 16 rows through tl.dot, and from T = 32 16 or 32 with the weights as the MMA's M side;
    N tiles of 32 (CUDA-core tiles only), 64 and 128 (not on multi-row CUDA-core tiles: their
    registers); K split 1-8 ways in 64- or 128-K tiles; 2 or 3 stages. 32-96 tilings a GEMM."""
    from ..kernels.few_rows_gemm import Tiles
    from ..kernels.launch import next_pow2
    if T == 1:
        rows = [(1, False, True), (1, False, False)]
    else:
        rows = [(next_pow2(T), False, True)] if T <= 8 else []
        rows += [(16, False, True)] + ([(16, True, True), (32, True, True)] if T >= 32 else [])
    for (bm, swap, tma), bn, split, bk, stages in itertools.product(rows, (32, 64, 128), (1, 2, 4, 8), (64, 128), (2, 3)):
        if K // split < bk or (bn == 32 and bm >= 16) or (bn == 128 and 1 < bm < 16):
            continue
        yield Tiles(bm, bn, split, bk, 4, stages, swap, tma)


def cold_l2_timer(reps: int = 8, iters: int = 5) -> Callable:
    """timer(op, tiles, fn) -> us of fn on the current CUDA device with a cold L2: a CUDA graph of reps
    x (overwrite L2, fn) less a graph of the overwrites alone, medians of iters replays each.
    Graphs, because events around an eager call time the host's launch too: the first version
    (events around flush; fn) chose tilings that made H200's decode layers 2-70% slower
    (notes/inference.md, 2026-11-29 04:14)."""
    dev = torch.cuda.current_device()
    flush = torch.empty(2 * torch.cuda.get_device_properties(dev).L2_cache_size, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)  # torch's default capture stream is on the first capture's device

    def capture(body):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(reps):
                flush.zero_()
                body()
        return g

    def replay_us(g):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3

    flushes = []

    def timer(op, tiles, fn):
        fn()  # compiles the tiling's kernel outside the capture
        torch.cuda.synchronize()
        if not flushes:
            flushes.append(capture(lambda: None))
        g = capture(fn)
        replay_us(g), replay_us(flushes[0])  # warm
        with_fn = statistics.median(replay_us(g) for _ in range(iters))
        alone = statistics.median(replay_us(flushes[0]) for _ in range(iters))
        return (with_fn - alone) / reps
    return timer


def _timed(timer, op, tiles, fn) -> Optional[float]:
    from triton.runtime.errors import OutOfResources
    try:
        return timer(op, tiles, fn)
    except OutOfResources:  # the tiling's buffers do not fit this device's shared memory
        return None


def _compile_side_by_side(calls, device: torch.device):
    """Each call run once from a pool of threads, so that Triton compiles the tilings' kernels side by
    side (its compiler passes and ptxas leave the GIL) rather than one by one inside the timings; on
    the CPU (the interpreter) nothing."""
    if device.type != "cuda":
        return
    from triton.runtime.errors import OutOfResources

    from ..kernels.launch import on_device

    def run(call):
        with on_device(device):  # a new thread starts on device 0
            # a runtime call makes the device's context current on this thread: Triton's TMA descriptors
            # are made through the driver, which has none on a new thread
            torch.cuda.synchronize(device)
            try:
                call()
            except OutOfResources:  # _timed skips the tiling
                pass
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(run, calls))
    torch.cuda.synchronize(device)


def tune_few_rows(moe, token_counts: Sequence[int], candidates: Optional[Callable] = None,
                  timer: Optional[Callable] = None, keep: int = 3, seed: int = 0, margin: float = 0.03,
                  report: Optional[dict] = None) -> TileTable:
    """{T: (up tiles, down tiles)} for each token count: the first GEMM timed at the rule's tiling and
    at each of candidates(T, K) (default tile_space); for its `keep` fastest (the rule's always among
    them, as the second GEMM's cost depends on whether the first splits K), the second GEMM at its
    rule and at each candidate; the pair with the least summed time wins if the whole block is then
    faster than on the rule's tilings by more than margin (else (None, None): the rule). The margin,
    3%: on an H200 (2026-11-29) pairs this tune timed 1-3% faster ran up to 3% slower in the layer
    benchmark (which replays the layer over weight copies, not after an L2 overwrite), while gains of
    4% and more held there. report, a dict, gets {T: (the block's us on the rule's tilings, on the
    pair's)} where the block was timed. moe: a SparseMoE on CUDA (or under TRITON_INTERPRET=1 with a
    timer given); timer(op, tiles, fn) -> us, default cold_l2_timer()."""
    from ..kernels.few_rows_gemm import UP_MAX_SPLIT, few_rows_down, few_rows_tiles, few_rows_up
    w1, w2 = moe.w1, moe.w2
    if timer is None:
        if not w1.is_cuda:
            raise ValueError(f"tuning times the few-rows kernels on a GPU; the experts are on {w1.device}")
        timer = cold_l2_timer()
    candidates = candidates or tile_space
    G, M, N1 = w1.shape
    F_ = w2.shape[1]
    g = torch.Generator(device=w1.device).manual_seed(seed)
    table = {}
    for T in check_token_counts(token_counts):
        x = torch.randn(T, M, generator=g, device=w1.device, dtype=w1.dtype)
        r = moe._shuffle(*moe._router(x, "few_rows"), "few_rows")
        kk = r.slots.shape[1]
        scale = r.scores if moe.prescale else None

        def up(t):
            return few_rows_up(x, r.row_routes, kk, w1, r.counts, T, scale, tiles=t)
        up_rule = few_rows_tiles(T, T * kk, G, N1, M, w1.device, UP_MAX_SPLIT, True)
        down_rule = few_rows_tiles(T, T * kk, G, M, F_, w1.device)
        ups = list(dict.fromkeys([up_rule, *candidates(T, M)]))
        _compile_side_by_side([lambda t=t: up(t) for t in ups], w1.device)
        up_us = {t: _timed(timer, "up", t, lambda t=t: up(t)) for t in ups}
        up_us = {t: us for t, us in up_us.items() if us is not None}
        if up_rule not in up_us:
            raise RuntimeError(f"the rule's own tiling of the first GEMM does not run at T = {T}: {up_rule}")
        firsts = [up_rule] + [t for t in sorted(up_us, key=up_us.get) if t != up_rule][:keep - 1]
        best = None
        downs = list(dict.fromkeys([down_rule, *candidates(T, F_)]))
        for u in firsts:
            h = up(u)
            _compile_side_by_side([lambda d=d: few_rows_down(h, w2, r.counts, T, tiles=d) for d in downs], w1.device)
            for d in downs:
                us = _timed(timer, "down", d, lambda d=d: few_rows_down(h, w2, r.counts, T, tiles=d))
                if us is not None and (best is None or up_us[u] + us < best[0]):
                    best = (up_us[u] + us, u, d)
        if best[1:] == (up_rule, down_rule):
            table[T] = best[1:]
            continue
        rule_us, pair_us = _block_us(moe, x, T, best[1:], timer)
        if report is not None:
            report[T] = (rule_us, pair_us)
        table[T] = best[1:] if pair_us < (1 - margin) * rule_us else (None, None)
    return table


def _block_us(moe, x, T: int, pair, timer, rounds: int = 3) -> Tuple[float, float]:
    """The whole block's (router to combine) us on the rule's tilings and on pair, medians of rounds
    timed in turn (drift of the clocks falls on both): the GEMMs timed apart miss what they share (the
    first's output, kept in L2 for the second; programs that overlap across launches)."""
    tiles = moe.few_rows_tiles
    saved = tiles.pop(T, None)
    rule_us, pair_us = [], []
    try:
        for _ in range(rounds):
            tiles.pop(T, None)
            rule_us.append(timer("layer", None, lambda: moe(x)))
            tiles[T] = pair
            pair_us.append(timer("layer", pair, lambda: moe(x)))
    finally:  # an error or Ctrl-C in a timing leaves the layer's table as it was, not on the untried pair
        tiles.pop(T, None)
        if saved is not None:
            tiles[T] = saved
    return statistics.median(rule_us), statistics.median(pair_us)


def check_token_counts(token_counts) -> list:
    if isinstance(token_counts, str) or not hasattr(token_counts, "__iter__"):
        raise TypeError(f"token counts must be a sequence of positive ints (e.g. [1, 8, 64]), got {token_counts!r}")
    tokens = list(token_counts)
    for T in tokens:
        if not isinstance(T, int) or isinstance(T, bool) or T < 1:
            raise ValueError(f"token counts must be positive ints, got {T!r}")
    return tokens


def check_tile_table(table) -> TileTable:
    """A tile table as given (Tiles, None for the rule's, or sequences of their fields as JSON keeps
    them; token counts as ints or their strings), checked: token counts >= 1, tile sizes powers of two
    (rows 1 and up, columns and K 16 and up), split, warps (a power of two) and stages >= 1."""
    from ..kernels.few_rows_gemm import Tiles
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ValueError(f"few_rows_tiles must be a dict {{tokens: (up tiles, down tiles)}}, "
                         f"got {type(table).__name__}")
    out = {}
    for T, pair in table.items():
        try:
            tokens = int(T)
            up, down = (t if t is None or isinstance(t, Tiles) else Tiles(*t) for t in pair)
        except (TypeError, ValueError):
            raise ValueError(f"few_rows_tiles[{T!r}] must be a token count and a pair of Tiles (or their fields), "
                             f"got {pair!r}") from None
        if tokens < 1 or str(tokens) != str(T).strip():
            raise ValueError(f"few_rows_tiles' keys must be token counts >= 1, got {T!r}")
        for t in (t for t in (up, down) if t is not None):  # None: the rule's tiling
            # Bounds: TMA's box (256), Triton's warps (32); they keep a CUDA-core tile's products
            # (block_m < 16: block_m x block_k x block_n) under Triton's 2**20 elements a tensor.
            pow2 = all(_is_int(v) and lo <= v <= hi and v & (v - 1) == 0
                       for v, lo, hi in ((t.block_m, 1, 128), (t.block_n, 16, 256), (t.block_k, 16, 256),
                                         (t.num_warps, 1, 32)))
            if not pow2 or not (_is_int(t.split) and t.split >= 1 and _is_int(t.num_stages) and t.num_stages >= 1):
                raise ValueError(f"few_rows_tiles[{T!r}]: invalid tiling {t}")
            if t.swap and t.block_m < 16:
                raise ValueError(f"few_rows_tiles[{T!r}]: swapped MMA operands need block_m >= 16, got {t}")
        out[tokens] = (up, down)
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON's true is no block size


def tile_key(gpu: str, num_experts: int, k: int, hidden: int, expert_hidden: int, dtype: torch.dtype) -> dict:
    """What a tile table was measured for: the GPU's name, the MoE layer's shape and the dtype."""
    return {"gpu": gpu, "experts": [num_experts, k, hidden, expert_hidden], "dtype": str(dtype).replace("torch.", "")}


def read_tile_tables(path: str) -> list:
    """A tile file's entries ({"for": key, "tiles": table}), checked; [] where there is no file;
    ValueError if the file is not a tile file."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            tables = json.load(f)["tables"]
        if not isinstance(tables, list):
            raise TypeError(f"'tables' is a {type(tables).__name__}, not a list")
        for entry in tables:
            if not isinstance(entry, dict):
                raise TypeError(f"an entry is a {type(entry).__name__}, not a dict")
            check_tile_table(entry["tiles"])
            if not isinstance(entry["for"], dict):
                raise TypeError(f"an entry's 'for' is {entry['for']!r}, not a dict")
    except (OSError, ValueError, KeyError, TypeError) as e:  # json's errors are ValueErrors
        raise ValueError(f"{path} is not a turbomoe tile file ({type(e).__name__}: {e})") from None
    return tables


def read_tile_file(path: str, key: dict) -> Optional[TileTable]:
    """The table of a tile file measured for key (tile_key), or None where it holds none (or there is
    no file); ValueError if the file is not a tile file."""
    key = json.loads(json.dumps(key))  # as the file keeps it: lists for tuples
    for entry in read_tile_tables(path):
        if entry["for"] == key:
            return check_tile_table(entry["tiles"])
    return None


def write_tile_file(path: str, key: dict, table: TileTable):
    """Keeps table in the tile file for key: the file's entries for key updated by table's token
    counts, the other keys' tables left as they are; written whole, then renamed over the file. table and
    key are checked first: a file that read_tile_tables would refuse is never written."""
    table = check_tile_table(table)  # an invalid tiling or a key "8" beside 8 would spoil every entry
    if not isinstance(key, dict):
        raise ValueError(f"a tile file's key must be a dict (tile_key), got {key!r}")
    key = json.loads(json.dumps(key))  # as the file keeps it (lists for tuples), so a later write matches it
    # One writer at a time in the file's folder (a lock on the folder, as the file itself is replaced):
    # processes tuning on several GPUs into one file each keep their table, none lost to another's write.
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        tables = read_tile_tables(path)
        entry = next((e for e in tables if e["for"] == key), None)
        if entry is None:
            entry = {"for": key, "tiles": {}}
            tables.append(entry)
        entry["tiles"] = {str(T): pair for T, pair in sorted({**check_tile_table(entry["tiles"]), **table}.items())}
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump({"tables": tables}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:  # a full disk, Ctrl-C: the file as it was, no temporary file left
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    finally:
        os.close(folder)  # releases the lock

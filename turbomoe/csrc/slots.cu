// assign_slots in CUDA: expert ids [S, k] -> buffer rows [S, k] int32, kept counts [E] int32.
//
// Dropless: a rank pass over the routes r = s*k + j in token order. Kernel 1 counts each block's
// routes per expert; kernel 2 adds the counts of the blocks before it and ranks inside the block,
// a warp of 32 routes at a time with __match_any_sync; row = offset of the expert + rank.
// Capacity (every drop policy): one kernel, a block per expert (capacity_slots_kernel below).
// Integer counts only, so deterministic. The keep-order of each policy is the reference's, so
// the rows equal those of the reference and of the Triton kernels (turbomoe/kernels/slots.py).
#include <cub/cub.cuh>

#include "common.cuh"

namespace turbomoe {

struct RankPass {
  int64_t n;  // routes
  int E;
  int64_t chunk;  // routes per block, a multiple of BLOCK_THREADS
};

// The expert of route i, or -1: past the end or an id outside [0, E).
template <typename id_t>
__device__ __forceinline__ int expert_at(const id_t* __restrict__ ids, const RankPass& p, int64_t i, int64_t end) {
  if (i >= end) return -1;
  const int64_t e = ids[i];
  return e < 0 || e >= p.E ? -1 : static_cast<int>(e);
}

// This warp's share of the block's routes: [begin, end).
__device__ __forceinline__ void warp_range(const RankPass& p, int64_t* begin, int64_t* end) {
  const int64_t per_warp = p.chunk / WARPS_PER_BLOCK;
  *begin = blockIdx.x * p.chunk + (threadIdx.x / WARP) * per_warp;
  *end = min(p.n, *begin + per_warp);
}

// counts[e] += routes of expert e in this warp's range (counts in shared memory, one per warp).
template <typename id_t>
__device__ void warp_count(const id_t* __restrict__ ids, const RankPass& p, int* counts) {
  const int lane = threadIdx.x % WARP;
  int64_t begin, end;
  warp_range(p, &begin, &end);
  for (int64_t i0 = begin; i0 < end; i0 += WARP) {
    const int e = expert_at(ids, p, i0 + lane, end);
    const unsigned peers = __match_any_sync(FULL_MASK, e);
    if (e >= 0 && lane == __ffs(peers) - 1) counts[e] += __popc(peers);
    __syncwarp();
  }
}

template <typename id_t>
__global__ void __launch_bounds__(BLOCK_THREADS)
rank_histogram_kernel(const id_t* __restrict__ ids, int* __restrict__ hist, RankPass p) {
  extern __shared__ int warp_counts[];  // [WARPS_PER_BLOCK, E]
  for (int c = threadIdx.x; c < WARPS_PER_BLOCK * p.E; c += BLOCK_THREADS) warp_counts[c] = 0;
  __syncthreads();
  warp_count(ids, p, warp_counts + (threadIdx.x / WARP) * p.E);
  __syncthreads();
  for (int e = threadIdx.x; e < p.E; e += BLOCK_THREADS) {
    int total = 0;
    for (int w = 0; w < WARPS_PER_BLOCK; ++w) total += warp_counts[w * p.E + e];
    hist[int64_t(blockIdx.x) * p.E + e] = total;
  }
}

// In-place exclusive prefix sum of a[0, n) in shared memory (n <= 4 * BLOCK_THREADS).
__device__ void block_exclusive_scan(int* a, int n, int* thread_sums) {
  const int per = (n + BLOCK_THREADS - 1) / BLOCK_THREADS;
  const int lo = threadIdx.x * per, hi = min(n, lo + per);
  int s = 0;
  for (int i = lo; i < hi; ++i) s += a[i];
  thread_sums[threadIdx.x] = s;
  __syncthreads();
  for (int o = 1; o < BLOCK_THREADS; o <<= 1) {  // Hillis-Steele, inclusive
    const int v = threadIdx.x >= o ? thread_sums[threadIdx.x - o] : 0;
    __syncthreads();
    thread_sums[threadIdx.x] += v;
    __syncthreads();
  }
  int run = thread_sums[threadIdx.x] - s;
  for (int i = lo; i < hi; ++i) {
    const int v = a[i];
    a[i] = run;
    run += v;
  }
  __syncthreads();
}

// out[r] = offset of r's expert + rank of r among its expert's routes; totals[e] = routes of e.
template <typename id_t>
__global__ void __launch_bounds__(BLOCK_THREADS)
rank_kernel(const id_t* __restrict__ ids, const int* __restrict__ hist, int32_t* __restrict__ out,
            int32_t* __restrict__ totals, RankPass p, int nblocks) {
  extern __shared__ int smem[];
  int* warp_base = smem;                            // [WARPS_PER_BLOCK, E]: counts, then running ranks
  int* offset = smem + WARPS_PER_BLOCK * p.E;       // [E]: offsets of the experts
  int* thread_sums = offset + p.E;                  // [BLOCK_THREADS]
  for (int c = threadIdx.x; c < WARPS_PER_BLOCK * p.E; c += BLOCK_THREADS) warp_base[c] = 0;
  __syncthreads();
  warp_count(ids, p, warp_base + (threadIdx.x / WARP) * p.E);
  __syncthreads();
  for (int e = threadIdx.x; e < p.E; e += BLOCK_THREADS) {
    int before = 0;  // routes of expert e in earlier blocks
    for (int b = 0; b < blockIdx.x; ++b) before += hist[int64_t(b) * p.E + e];
    int total = before;
    for (int b = blockIdx.x; b < nblocks; ++b) total += hist[int64_t(b) * p.E + e];
    offset[e] = total;
    if (blockIdx.x == 0) totals[e] = total;
    for (int w = 0; w < WARPS_PER_BLOCK; ++w) {  // each warp starts after the warps before it
      const int count = warp_base[w * p.E + e];
      warp_base[w * p.E + e] = before;
      before += count;
    }
  }
  __syncthreads();
  block_exclusive_scan(offset, p.E, thread_sums);  // expert e owns rows from offset[e]

  const int lane = threadIdx.x % WARP;
  int* running = warp_base + (threadIdx.x / WARP) * p.E;
  int64_t begin, end;
  warp_range(p, &begin, &end);
  for (int64_t i0 = begin; i0 < end; i0 += WARP) {
    const int64_t i = i0 + lane;
    const int e = expert_at(ids, p, i, end);
    const unsigned peers = __match_any_sync(FULL_MASK, e);
    const int rank = e >= 0 ? running[e] + __popc(peers & ((1u << lane) - 1u)) : 0;
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) running[e] += __popc(peers);
    __syncwarp();
    if (i < end) out[i] = e >= 0 ? offset[e] + rank : -1;
  }
}

__device__ __forceinline__ uint32_t hash32(uint32_t x) {  // lowbias32, as reference.hash32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

enum Policy : int { POSITION = 0, RTS = 1, PROBS = 2 };

// The keep-order of route r = s*K + j under a capacity policy: smaller is kept first, ties to the
// lower r (the reference's stable sort). position: choice-major index; rts: a seeded bijective
// hash of r; probs: the fp32 score's bits mapped to uint32 so that higher scores come first.
struct Priority {
  const float* scores;
  int64_t S;
  int K;
  uint32_t seed_mix;
  int policy;
  int bits;  // priorities are < 2^bits
  __device__ __forceinline__ uint32_t operator()(int64_t r) const {
    if (policy == RTS) return hash32(static_cast<uint32_t>(r) ^ seed_mix);
    if (policy == POSITION) return static_cast<uint32_t>((r % K) * S + r / K);
    // As the reference: a NaN score ranks as -inf, and -0.0 as +0.0 (equal scores tie).
    const float v = scores[r];
    const uint32_t b = __float_as_uint(isnan(v) ? -INFINITY : (v == 0.0f ? 0.0f : v));
    const uint32_t ordered = b >= 0x80000000u ? 0xFFFFFFFFu - b : (b | 0x80000000u);
    return 0xFFFFFFFFu - ordered;
  }
};

constexpr int SELECT_THREADS = 1024;  // one block per expert, so the widest block
constexpr int SELECT_ITEMS = 4;       // routes per thread per tile
constexpr int DIGIT_BITS = 11;        // radix-select digit: 2048 counters in shared memory
constexpr int DIGIT_BINS = 1 << DIGIT_BITS;
constexpr int BINS_PER_THREAD = DIGIT_BINS / SELECT_THREADS;

// Capacity slots in one launch, one block per expert e. A radix select over the priorities of e's
// routes (one pass over the routes per 11-bit digit, counters in shared memory) finds T, the C-th
// smallest, and keep_at_T, how many routes at exactly T are kept; then one ordered pass gives
// each kept route its row e*C + (kept routes of e before it, in token order). Under-full experts
// skip the select. Integer counts only: the same rows every run. Block 0 also marks routes with
// no valid expert (-1). kept_counts[e] = kept routes of e.
template <typename id_t>
__global__ void __launch_bounds__(SELECT_THREADS)
capacity_slots_kernel(const id_t* __restrict__ ids, Priority prio, int64_t n, int E, int C,
                      int32_t* __restrict__ slots, int32_t* __restrict__ kept_counts) {
  using Scan = cub::BlockScan<int, SELECT_THREADS>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int hist[DIGIT_BINS];
  __shared__ int found_digit, found_rest;
  const int e = blockIdx.x;
  const int64_t tile = int64_t(SELECT_THREADS) * SELECT_ITEMS;

  uint32_t threshold = 0;  // C = 0: nothing kept
  int keep_at_threshold = 0;
  if (C > 0) {
    uint32_t prefix = 0;  // the digits of T found so far
    int rest = C;         // T's rank (1-based) among the routes whose priority starts with prefix
    int shift = prio.bits;
    bool all_kept = false;
    while (shift > 0 && !all_kept) {
      const int prev_shift = shift;
      const bool first_pass = prev_shift == prio.bits;  // counts every route of e
      shift = max(0, shift - DIGIT_BITS);
      const uint32_t digit_mask = (1u << (prev_shift - shift)) - 1u;
      for (int i = threadIdx.x; i < DIGIT_BINS; i += SELECT_THREADS) hist[i] = 0;
      __syncthreads();
      for (int64_t t0 = 0; t0 < n; t0 += tile) {
#pragma unroll
        for (int i = 0; i < SELECT_ITEMS; ++i) {
          const int64_t r = t0 + int64_t(i) * SELECT_THREADS + threadIdx.x;
          if (r < n && ids[r] == e) {
            const uint32_t p = prio(r);
            if (first_pass || (p >> prev_shift) == prefix) atomicAdd(&hist[(p >> shift) & digit_mask], 1);
          }
        }
      }
      __syncthreads();
      int local[BINS_PER_THREAD], sum = 0;
#pragma unroll
      for (int j = 0; j < BINS_PER_THREAD; ++j) sum += local[j] = hist[threadIdx.x * BINS_PER_THREAD + j];
      int before, total;
      Scan(scan_storage).ExclusiveSum(sum, before, total);
      if (first_pass && total <= C) {
        all_kept = true;  // none dropped
      } else if (before < rest && rest <= before + sum) {
        int run = before;
        for (int j = 0; j < BINS_PER_THREAD; ++j) {
          if (run + local[j] >= rest) {
            found_digit = threadIdx.x * BINS_PER_THREAD + j;
            found_rest = rest - run;
            break;
          }
          run += local[j];
        }
      }
      __syncthreads();
      if (!all_kept) {
        prefix = (prefix << (prev_shift - shift)) | static_cast<uint32_t>(found_digit);
        rest = found_rest;
      }
    }
    threshold = all_kept ? 0xFFFFFFFFu : prefix;
    keep_at_threshold = all_kept ? std::numeric_limits<int>::max() : rest;
  }

  // Ordered pass: kept = priority < T, or the first keep_at_threshold routes at T. Each thread
  // takes SELECT_ITEMS consecutive routes; one scan counts both kinds (below T in the low 16 bits).
  int run_below = 0, run_at = 0;  // over earlier tiles
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t r0 = t0 + int64_t(threadIdx.x) * SELECT_ITEMS;
    bool mine[SELECT_ITEMS];  // route r0 + i goes to e
    uint32_t pr[SELECT_ITEMS];
    int below = 0, at = 0;
#pragma unroll
    for (int i = 0; i < SELECT_ITEMS; ++i) {
      const int64_t r = r0 + i;
      const int64_t id = r < n ? static_cast<int64_t>(ids[r]) : -1;
      mine[i] = id == e;
      pr[i] = mine[i] ? prio(r) : 0;
      below += mine[i] && pr[i] < threshold;
      at += mine[i] && pr[i] == threshold;
      if (e == 0 && r < n && (id < 0 || id >= E)) slots[r] = -1;  // block 0 marks routes with no expert
    }
    int before, total;
    Scan(scan_storage).ExclusiveSum(below | (at << 16), before, total);
    int b = run_below + (before & 0xFFFF), a = run_at + (before >> 16);
#pragma unroll
    for (int i = 0; i < SELECT_ITEMS; ++i) {
      if (!mine[i]) continue;
      const bool kept = pr[i] < threshold || (pr[i] == threshold && a < keep_at_threshold);
      slots[r0 + i] = kept ? e * C + b + min(a, keep_at_threshold) : -1;
      b += pr[i] < threshold;
      a += pr[i] == threshold;
    }
    run_below += total & 0xFFFF;
    run_at += total >> 16;
    __syncthreads();  // the scan's storage is reused
  }
  if (threadIdx.x == 0) kept_counts[e] = run_below + min(run_at, keep_at_threshold);
}

namespace {

template <typename id_t>
at::Tensor dropless_slots(const at::Tensor& ids, int64_t S, int K, int E, at::Tensor& totals) {
  const int64_t n = ids.numel();
  const int64_t nblocks0 = std::min<int64_t>(128, std::max<int64_t>(1, cdiv(n, 1024)));
  const int64_t chunk = cdiv(cdiv(n, nblocks0), BLOCK_THREADS) * BLOCK_THREADS;
  const int nblocks = std::max<int64_t>(1, cdiv(n, chunk));
  const RankPass p{n, E, chunk};
  const auto opts = ids.options().dtype(at::kInt);
  at::Tensor hist = at::empty({nblocks, E}, opts);
  at::Tensor out = at::empty({S, K}, opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const id_t* id_ptr = ids.data_ptr<id_t>();
  rank_histogram_kernel<id_t><<<nblocks, BLOCK_THREADS, WARPS_PER_BLOCK * E * sizeof(int), stream>>>(
      id_ptr, hist.data_ptr<int>(), p);
  TURBOMOE_CHECK_LAUNCH();
  rank_kernel<id_t><<<nblocks, BLOCK_THREADS, ((WARPS_PER_BLOCK + 1) * E + BLOCK_THREADS) * sizeof(int), stream>>>(
      id_ptr, hist.data_ptr<int>(), out.data_ptr<int32_t>(), totals.data_ptr<int32_t>(), p, nblocks);
  TURBOMOE_CHECK_LAUNCH();
  return out;
}

}  // namespace

// policy: 0 position, 1 rts, 2 probs; capacity < 0: dropless. Returns slots [S, k] int32 and the
// kept counts [E] int32.
std::vector<at::Tensor> assign_slots(const at::Tensor& ids, const c10::optional<at::Tensor>& scores, int64_t E,
                                     int64_t capacity, int64_t policy, int64_t seed_mix) {
  check_2d(ids, "expert_ids");
  TORCH_CHECK(E >= 1 && E <= MAX_EXPERTS, "assign_slots: E must be in [1, ", MAX_EXPERTS, "] on the CUDA backend");
  TORCH_CHECK(policy >= POSITION && policy <= PROBS, "assign_slots: unknown policy ", policy);
  TORCH_CHECK(ids.numel() < (int64_t(1) << 31), "assign_slots: too many routes for the CUDA backend");
  const c10::cuda::CUDAGuard guard(ids.device());
  const int64_t S = ids.size(0), n = ids.numel();
  const int K = ids.size(1);
  const auto opts = ids.options().dtype(at::kInt);
  at::Tensor totals = at::empty({E}, opts);
  if (n == 0) return {at::empty({S, K}, opts), totals.zero_()};
  at::Tensor slots;
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "turbomoe_assign_slots", [&] {
    if (capacity < 0) {
      slots = dropless_slots<index_t>(ids, S, K, E, totals);
      return;
    }
    TORCH_CHECK(capacity <= std::numeric_limits<int>::max() / MAX_EXPERTS, "assign_slots: capacity too large");
    const bool by_score = policy == PROBS;
    TORCH_CHECK(!by_score || (scores.has_value() && scores->scalar_type() == at::kFloat && scores->is_contiguous() &&
                              scores->numel() == n),
                "the probs policy needs contiguous fp32 scores [S, k]");
    int bits = 32;
    if (policy == POSITION) {  // priorities < n
      bits = 1;
      while ((int64_t(1) << bits) < n) ++bits;
    }
    const Priority prio{by_score ? scores->data_ptr<float>() : nullptr, S, K, static_cast<uint32_t>(seed_mix),
                        static_cast<int>(policy), bits};
    slots = at::empty({S, K}, opts);
    capacity_slots_kernel<index_t><<<E, SELECT_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
        ids.data_ptr<index_t>(), prio, n, E, static_cast<int>(capacity), slots.data_ptr<int32_t>(),
        totals.data_ptr<int32_t>());
    TURBOMOE_CHECK_LAUNCH();
  });
  return {slots, totals};
}

}  // namespace turbomoe

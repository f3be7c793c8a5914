// assign_slots in CUDA: expert ids [S, k] -> buffer rows [S, k] int32, kept counts [E] int32.
//
// The building block is a rank pass: for routes in a given order (token-major r = s*k + j, or
// choice-major: every first choice before any second), the rank of each route among the routes
// of its expert. Kernel 1 counts each block's routes per expert; kernel 2 adds the counts of the
// blocks before it and ranks inside the block, a warp of 32 routes at a time with
// __match_any_sync, then writes the rank or the final row. Integer only, so deterministic.
// Priority policies (rts, probs) radix-sort (expert, priority) keys and keep the first C of each
// expert, as the Triton kernels (turbomoe/kernels/slots.py) do, with the same keys.
#include <cub/cub.cuh>

#include "common.cuh"

namespace turbomoe {

enum RankMode : int { SELECT = 0, CAPACITY = 1, DROPLESS = 2 };

struct RankPass {
  int64_t n, S;  // routes, tokens
  int K, E, C;
  bool choice_major;
  int64_t chunk;  // routes per block, a multiple of BLOCK_THREADS
  __device__ __forceinline__ int64_t route(int64_t i) const { return choice_major ? (i % S) * K + i / S : i; }
};

// The expert of the route at position i, or -1: past the end, an id outside [0, E), or (with a
// selection rank) not among the first C.
template <typename id_t>
__device__ __forceinline__ int expert_at(const id_t* __restrict__ ids, const int32_t* __restrict__ sel,
                                         const RankPass& p, int64_t i, int64_t end) {
  if (i >= end) return -1;
  const int64_t r = p.route(i);
  const int64_t e = ids[r];
  if (e < 0 || e >= p.E || (sel && sel[r] >= p.C)) return -1;
  return static_cast<int>(e);
}

// This warp's share of the block's routes: [begin, end).
__device__ __forceinline__ void warp_range(const RankPass& p, int64_t* begin, int64_t* end) {
  const int64_t per_warp = p.chunk / WARPS_PER_BLOCK;
  *begin = blockIdx.x * p.chunk + (threadIdx.x / WARP) * per_warp;
  *end = min(p.n, *begin + per_warp);
}

// counts[e] += routes of expert e in this warp's range (counts in shared memory, one per warp).
template <typename id_t>
__device__ void warp_count(const id_t* __restrict__ ids, const int32_t* __restrict__ sel, const RankPass& p,
                           int* counts) {
  const int lane = threadIdx.x % WARP;
  int64_t begin, end;
  warp_range(p, &begin, &end);
  for (int64_t i0 = begin; i0 < end; i0 += WARP) {
    const int e = expert_at(ids, sel, p, i0 + lane, end);
    const unsigned peers = __match_any_sync(FULL_MASK, e);
    if (e >= 0 && lane == __ffs(peers) - 1) counts[e] += __popc(peers);
    __syncwarp();
  }
}

template <typename id_t>
__global__ void __launch_bounds__(BLOCK_THREADS)
rank_histogram_kernel(const id_t* __restrict__ ids, const int32_t* __restrict__ sel, int* __restrict__ hist,
                      RankPass p) {
  extern __shared__ int warp_counts[];  // [WARPS_PER_BLOCK, E]
  for (int c = threadIdx.x; c < WARPS_PER_BLOCK * p.E; c += BLOCK_THREADS) warp_counts[c] = 0;
  __syncthreads();
  warp_count(ids, sel, p, warp_counts + (threadIdx.x / WARP) * p.E);
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

template <typename id_t>
__global__ void __launch_bounds__(BLOCK_THREADS)
rank_kernel(const id_t* __restrict__ ids, const int32_t* __restrict__ sel, const int* __restrict__ hist,
            int32_t* __restrict__ out, int32_t* __restrict__ totals, RankPass p, int nblocks, int mode) {
  extern __shared__ int smem[];
  int* warp_base = smem;                            // [WARPS_PER_BLOCK, E]: counts, then running ranks
  int* offset = smem + WARPS_PER_BLOCK * p.E;       // [E]: dropless offsets of the experts
  int* thread_sums = offset + p.E;                  // [BLOCK_THREADS]
  for (int c = threadIdx.x; c < WARPS_PER_BLOCK * p.E; c += BLOCK_THREADS) warp_base[c] = 0;
  __syncthreads();
  warp_count(ids, sel, p, warp_base + (threadIdx.x / WARP) * p.E);
  __syncthreads();
  const bool need_totals = mode == DROPLESS || (totals && blockIdx.x == 0);
  for (int e = threadIdx.x; e < p.E; e += BLOCK_THREADS) {
    int before = 0;  // routes of expert e in earlier blocks
    for (int b = 0; b < blockIdx.x; ++b) before += hist[int64_t(b) * p.E + e];
    if (need_totals) {
      int total = before;
      for (int b = blockIdx.x; b < nblocks; ++b) total += hist[int64_t(b) * p.E + e];
      offset[e] = total;
      if (totals && blockIdx.x == 0) totals[e] = total;
    }
    for (int w = 0; w < WARPS_PER_BLOCK; ++w) {  // each warp starts after the warps before it
      const int count = warp_base[w * p.E + e];
      warp_base[w * p.E + e] = before;
      before += count;
    }
  }
  __syncthreads();
  if (mode == DROPLESS) block_exclusive_scan(offset, p.E, thread_sums);  // expert e owns rows from offset[e]

  const int lane = threadIdx.x % WARP;
  int* running = warp_base + (threadIdx.x / WARP) * p.E;
  int64_t begin, end;
  warp_range(p, &begin, &end);
  for (int64_t i0 = begin; i0 < end; i0 += WARP) {
    const int64_t i = i0 + lane;
    const int e = expert_at(ids, sel, p, i, end);
    const unsigned peers = __match_any_sync(FULL_MASK, e);
    const int rank = e >= 0 ? running[e] + __popc(peers & ((1u << lane) - 1u)) : 0;
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) running[e] += __popc(peers);
    __syncwarp();
    if (i < end) {
      int32_t v;
      if (mode == SELECT) v = e >= 0 ? rank : p.C;            // kept iff < C
      else if (mode == CAPACITY) v = e >= 0 ? e * p.C + rank : -1;  // expert e owns rows [e*C, (e+1)*C)
      else v = e >= 0 ? offset[e] + rank : -1;
      out[p.route(i)] = v;
    }
  }
}

__device__ __forceinline__ uint32_t hash32(uint32_t x) {  // lowbias32, as reference.hash32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// key = expert << 32 | priority (smaller first); routes with no expert sort after every expert.
template <typename id_t>
__global__ void priority_key_kernel(const id_t* __restrict__ ids, const float* __restrict__ scores,
                                    uint64_t* __restrict__ keys, int32_t* __restrict__ routes, int64_t n, int E,
                                    uint32_t seed_mix, bool by_score) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n) return;
  int64_t e = ids[r];
  e = (e >= 0 && e < E) ? e : E;
  uint32_t prio;
  if (by_score) {
    // Order-preserving map of fp32 bits to uint32, inverted so that higher scores come first.
    const uint32_t bits = __float_as_uint(scores[r]);
    const uint32_t ordered = bits >= 0x80000000u ? 0xFFFFFFFFu - bits : (bits | 0x80000000u);
    prio = 0xFFFFFFFFu - ordered;
  } else {
    prio = hash32(static_cast<uint32_t>(r) ^ seed_mix);
  }
  keys[r] = (static_cast<uint64_t>(e) << 32) | prio;
  routes[r] = static_cast<int32_t>(r);
}

// Sorted keys group the routes by expert: position i is among its expert's first C exactly when
// i < C or the key C places earlier belongs to another expert. sel = 0 kept, C dropped.
__global__ void select_kernel(const uint64_t* __restrict__ keys, const int32_t* __restrict__ routes,
                              int32_t* __restrict__ sel, int64_t n, int C) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const bool kept = i < C || (keys[i - C] >> 32) != (keys[i] >> 32);
  sel[routes[i]] = kept ? 0 : C;
}

namespace {

template <typename id_t>
at::Tensor rank_pass(const at::Tensor& ids, const int32_t* sel, int64_t S, int K, int E, int C, bool choice_major,
                     int mode, at::Tensor* totals) {
  const int64_t n = ids.numel();
  const int64_t nblocks0 = std::min<int64_t>(128, std::max<int64_t>(1, cdiv(n, 1024)));
  const int64_t chunk = cdiv(cdiv(n, nblocks0), BLOCK_THREADS) * BLOCK_THREADS;
  const int nblocks = std::max<int64_t>(1, cdiv(n, chunk));
  const RankPass p{n, S, K, E, C, choice_major, chunk};
  const auto opts = ids.options().dtype(at::kInt);
  at::Tensor hist = at::empty({nblocks, E}, opts);
  at::Tensor out = at::empty({n}, opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const id_t* id_ptr = ids.data_ptr<id_t>();
  rank_histogram_kernel<id_t><<<nblocks, BLOCK_THREADS, WARPS_PER_BLOCK * E * sizeof(int), stream>>>(
      id_ptr, sel, hist.data_ptr<int>(), p);
  TURBOMOE_CHECK_LAUNCH();
  rank_kernel<id_t><<<nblocks, BLOCK_THREADS, ((WARPS_PER_BLOCK + 1) * E + BLOCK_THREADS) * sizeof(int), stream>>>(
      id_ptr, sel, hist.data_ptr<int>(), out.data_ptr<int32_t>(), totals ? totals->data_ptr<int32_t>() : nullptr, p,
      nblocks, mode);
  TURBOMOE_CHECK_LAUNCH();
  return out;
}

template <typename id_t>
at::Tensor priority_selection(const at::Tensor& ids, const c10::optional<at::Tensor>& scores, int E, int C,
                              bool by_score, uint32_t seed_mix) {
  const int64_t n = ids.numel();
  TORCH_CHECK(n < (int64_t(1) << 31), "assign_slots: too many routes for the CUDA backend");
  const auto opts = ids.options();
  at::Tensor keys = at::empty({n}, opts.dtype(at::kLong));
  at::Tensor keys_sorted = at::empty({n}, opts.dtype(at::kLong));
  at::Tensor routes = at::empty({n}, opts.dtype(at::kInt));
  at::Tensor routes_sorted = at::empty({n}, opts.dtype(at::kInt));
  at::Tensor sel = at::empty({n}, opts.dtype(at::kInt));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto* k_in = reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>());
  auto* k_out = reinterpret_cast<uint64_t*>(keys_sorted.data_ptr<int64_t>());
  priority_key_kernel<id_t><<<cdiv(n, 1024), 1024, 0, stream>>>(
      ids.data_ptr<id_t>(), by_score ? scores->data_ptr<float>() : nullptr, k_in, routes.data_ptr<int32_t>(), n, E,
      seed_mix, by_score);
  TURBOMOE_CHECK_LAUNCH();
  int expert_bits = 1;  // keys hold experts 0 .. E (E = no expert)
  while ((int64_t(1) << expert_bits) <= E) ++expert_bits;
  size_t temp_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, k_in, k_out, routes.data_ptr<int32_t>(),
                                  routes_sorted.data_ptr<int32_t>(), n, 0, 32 + expert_bits, stream);
  at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, opts.dtype(at::kByte));
  cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, k_in, k_out, routes.data_ptr<int32_t>(),
                                  routes_sorted.data_ptr<int32_t>(), n, 0, 32 + expert_bits, stream);
  TURBOMOE_CHECK_LAUNCH();
  select_kernel<<<cdiv(n, 1024), 1024, 0, stream>>>(k_out, routes_sorted.data_ptr<int32_t>(), sel.data_ptr<int32_t>(),
                                                    n, C);
  TURBOMOE_CHECK_LAUNCH();
  return sel;
}

}  // namespace

// policy: 0 position, 1 rts, 2 probs; capacity < 0: dropless. Returns slots [S, k] int32 and the
// kept counts [E] int32.
std::vector<at::Tensor> assign_slots(const at::Tensor& ids, const c10::optional<at::Tensor>& scores, int64_t E,
                                     int64_t capacity, int64_t policy, int64_t seed_mix) {
  TORCH_CHECK(ids.is_cuda() && ids.dim() == 2 && ids.is_contiguous(), "expert_ids: contiguous CUDA [S, k]");
  TORCH_CHECK(E >= 1 && E <= MAX_EXPERTS, "assign_slots: E must be in [1, ", MAX_EXPERTS, "] on the CUDA backend");
  const c10::cuda::CUDAGuard guard(ids.device());
  const int64_t S = ids.size(0);
  const int K = ids.size(1);
  at::Tensor totals = at::empty({E}, ids.options().dtype(at::kInt));  // written by the last rank pass
  if (ids.numel() == 0) return {at::empty({S, K}, ids.options().dtype(at::kInt)), totals.zero_()};
  const int C = static_cast<int>(std::max<int64_t>(capacity, 0));
  at::Tensor slots;
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "turbomoe_assign_slots", [&] {
    if (capacity < 0) {
      slots = rank_pass<index_t>(ids, nullptr, S, K, E, 0, false, DROPLESS, &totals);
      return;
    }
    at::Tensor sel;
    if (policy == 0) {  // first choices of every token before any second choice
      sel = rank_pass<index_t>(ids, nullptr, S, K, E, C, true, SELECT, nullptr);
    } else {
      TORCH_CHECK(policy != 2 || (scores.has_value() && scores->scalar_type() == at::kFloat &&
                                  scores->is_contiguous() && scores->numel() == ids.numel()),
                  "the probs policy needs contiguous fp32 scores [S, k]");
      sel = priority_selection<index_t>(ids, scores, E, C, policy == 2, static_cast<uint32_t>(seed_mix));
    }
    slots = rank_pass<index_t>(ids, sel.data_ptr<int32_t>(), S, K, E, C, false, CAPACITY, &totals);
  });
  return {slots.view({S, K}), totals};
}

}  // namespace turbomoe

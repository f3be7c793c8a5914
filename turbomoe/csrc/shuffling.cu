// index_shuffling in CUDA (serving's routing step; spec: reference.index_shuffling): logits [T, E] ->
// top-k ids [T, k], scores [T, k], counts [E], slots [T, k] (expert-contiguous rows, token order
// within an expert) and row_routes [T * k] (the route each row holds, -1 past the routed total).
//
// One block, one launch. Top-k: a warp owns a token (lane l holds columns l, l + 32, ...); counts go
// to shared memory by integer atomics (same totals every run). Ranks go by chunks of CHUNK tokens in
// token order: each expert gets a CHUNK-bit mask of the tokens that chose it (atomicOr), and a
// route's rank is the expert's running base plus the popcount of the mask below its token: integer
// only, deterministic. Beyond the sizes where one block wins, turbomoe.inference.index_shuffling
// takes the Triton kernels (faster there than any multi-block CUDA variant measured:
// notes/inference.md). No host sync: graph-capturable.
#include <cub/cub.cuh>

#include "topk.cuh"

namespace turbomoe {

constexpr int CHUNK = BLOCK_THREADS;       // tokens ranked per step, one a thread
constexpr int MASK_WORDS = CHUNK / WARP;   // 32-bit words of an expert's token mask
constexpr int SCAN_ITEMS = MAX_EXPERTS / BLOCK_THREADS;

template <typename acc_t> struct ShuffleOut {
  int32_t* ids;
  acc_t* scores;
  int32_t* counts;
  int32_t* slots;
  int32_t* routes;
};

// Top-k of token t (warp_topk: ties to the lower column) by warp; lane j < k writes choice j into a
// row of kr routes, and with a shared expert (kr = k + 1) lane k writes its route (expert E, score 1).
// Adds the chosen experts to counts (shared memory). Softmax or sigmoid in acc_t; rows with a
// non-finite logit route nowhere (ids -1, scores 0), except to the shared expert.
template <typename scalar_t, typename acc_t, int CPL>
__device__ void topk_token(const scalar_t* __restrict__ logits, int64_t t, int E, int k, int kr, bool sigmoid,
                           bool renorm, ShuffleOut<acc_t> out, int* counts) {
  const int lane = threadIdx.x % WARP;
  acc_t p[CPL], softmax[CPL];
  const RowProbs<acc_t> rp = row_probs<scalar_t, acc_t, CPL>(logits, t, E, sigmoid, p, softmax);
  int my_id = -1;
  acc_t my_score = 0;
  if (rp.valid) {
    const unsigned chosen = warp_topk<acc_t, CPL>(p, p, E, k, renorm, my_id, my_score);
#pragma unroll
    for (int i = 0; i < CPL; ++i)
      if ((chosen >> i) & 1u) atomicAdd(&counts[lane + WARP * i], 1);
  }
  if (lane == k && kr > k) {
    my_id = E;
    my_score = 1;
    atomicAdd(&counts[E], 1);
  }
  if (lane < kr) {
    out.ids[t * kr + lane] = my_id;
    out.scores[t * kr + lane] = my_score;
  }
}

// Exclusive scan of v[0..E) in place (E <= MAX_EXPERTS); returns the total. All threads call it.
__device__ int exclusive_scan(int* v, int E) {
  using Scan = cub::BlockScan<int, BLOCK_THREADS>;
  __shared__ typename Scan::TempStorage storage;
  int items[SCAN_ITEMS];
  __syncthreads();  // v was written by other threads
#pragma unroll
  for (int i = 0; i < SCAN_ITEMS; ++i) {
    const int e = threadIdx.x * SCAN_ITEMS + i;
    items[i] = e < E ? v[e] : 0;
  }
  int total;
  Scan(storage).ExclusiveSum(items, items, total);
#pragma unroll
  for (int i = 0; i < SCAN_ITEMS; ++i) {
    const int e = threadIdx.x * SCAN_ITEMS + i;
    if (e < E) v[e] = items[i];
  }
  __syncthreads();
  return total;
}

// Slots and row_routes of tokens t0 .. t0 + CHUNK; base[e] (shared) is expert e's next free row
// and moves past this chunk's routes.
template <typename acc_t>
__device__ void rank_chunk(int64_t t0, int64_t T, int E, int k, ShuffleOut<acc_t> out, int* base, uint32_t* masks) {
  for (int i = threadIdx.x; i < E * MASK_WORDS; i += BLOCK_THREADS) masks[i] = 0;
  __syncthreads();
  const int64_t t = t0 + threadIdx.x;
  const int word = threadIdx.x / WARP, bit = threadIdx.x % WARP;
  int ids[MAX_K + 1];  // kr routes: k, plus one with a shared expert
  for (int j = 0; j < k; ++j) {
    ids[j] = t < T ? out.ids[t * k + j] : -1;
    if (ids[j] >= 0) atomicOr(&masks[ids[j] * MASK_WORDS + word], 1u << bit);
  }
  __syncthreads();
  for (int j = 0; j < k; ++j) {
    const int e = ids[j];
    if (t >= T) break;
    int slot = -1;
    if (e >= 0) {
      slot = base[e] + __popc(masks[e * MASK_WORDS + word] & ((1u << bit) - 1u));
      for (int w = 0; w < word; ++w) slot += __popc(masks[e * MASK_WORDS + w]);
      out.routes[slot] = static_cast<int32_t>(t * k + j);
    }
    out.slots[t * k + j] = slot;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += BLOCK_THREADS) {
    int n = 0;
    for (int w = 0; w < MASK_WORDS; ++w) n += __popc(masks[e * MASK_WORDS + w]);
    base[e] += n;
  }
  __syncthreads();
}

__device__ void clear_rows(int32_t* routes, int64_t r0, int64_t r1, int64_t total) {
  for (int64_t r = max(r0, total) + threadIdx.x; r < r1; r += BLOCK_THREADS) routes[r] = -1;
}

template <typename scalar_t, typename acc_t, int CPL>
__global__ void __launch_bounds__(BLOCK_THREADS)
shuffle_one_block_kernel(const scalar_t* __restrict__ logits, int64_t T, int E, int k, bool shared, bool sigmoid,
                         bool renorm, ShuffleOut<acc_t> out) {
  __shared__ int base[MAX_EXPERTS];
  extern __shared__ uint32_t masks[];  // [ec, MASK_WORDS]
  const int ec = E + shared, kr = k + shared;  // count columns, routes per token
  for (int e = threadIdx.x; e < ec; e += BLOCK_THREADS) base[e] = 0;
  __syncthreads();
  for (int64_t t = threadIdx.x / WARP; t < T; t += WARPS_PER_BLOCK)
    topk_token<scalar_t, acc_t, CPL>(logits, t, E, k, kr, sigmoid, renorm, out, base);
  __syncthreads();  // ids in global memory and the counts are complete for the whole block
  for (int e = threadIdx.x; e < ec; e += BLOCK_THREADS) out.counts[e] = base[e];
  const int total = exclusive_scan(base, ec);
  for (int64_t t0 = 0; t0 < T; t0 += CHUNK) rank_chunk<acc_t>(t0, T, ec, kr, out, base, masks);
  clear_rows(out.routes, 0, T * kr, total);
}

// Returns ids, scores, counts, slots, row_routes.
std::vector<at::Tensor> index_shuffling(const at::Tensor& logits, int64_t k, bool shared, bool sigmoid, bool renorm) {
  check_2d(logits, "logits");
  const int64_t T = logits.size(0);
  const int E = logits.size(1);
  TORCH_CHECK(E >= 1 && E + shared <= MAX_EXPERTS && k >= 1 && k <= std::min(E, MAX_K),
              "index_shuffling: bad E or k");
  const int ec = E + shared;
  const int64_t kr = k + shared;
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto opts = logits.options();
  at::Tensor ids = at::empty({T, kr}, opts.dtype(at::kInt));
  at::Tensor scores = at::empty({T, kr}, opts.dtype(acc));
  at::Tensor counts = at::empty({ec}, opts.dtype(at::kInt));
  at::Tensor slots = at::empty({T, kr}, opts.dtype(at::kInt));
  at::Tensor routes = at::empty({T * kr}, opts.dtype(at::kInt));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const size_t mask_bytes = size_t(ec) * MASK_WORDS * sizeof(uint32_t);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "turbomoe_index_shuffling", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    ShuffleOut<acc_t> out{ids.data_ptr<int32_t>(), scores.data_ptr<acc_t>(), counts.data_ptr<int32_t>(),
                          slots.data_ptr<int32_t>(), routes.data_ptr<int32_t>()};
    TURBOMOE_DISPATCH_CPL(E, [&] {
      shuffle_one_block_kernel<scalar_t, acc_t, CPL>
          <<<1, BLOCK_THREADS, mask_bytes, stream>>>(logits.data_ptr<scalar_t>(), T, E, k, shared, sigmoid, renorm, out);
    });
    TURBOMOE_CHECK_LAUNCH();
  });
  return {ids, scores, counts, slots, routes};
}

}  // namespace turbomoe

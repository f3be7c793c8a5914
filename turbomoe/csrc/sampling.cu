// The second expert of DeepSpeed's top-2 gating, fused:
//   second = argmax over e != first of logits[s, e] + gumbel[s, e],   score2 = p1 * exp(l2 - l1)
// with gumbel from the uniforms rand (top2_2nd_expert_sampling), or 0 where rand is null (stock's
// unsampled top-2: the best other logit).
// gumbel = -log(-log(tiny + rand * range)) from the uniforms torch.rand drew, rounded op by op as
// torch.distributions.Gumbel(0, 1).rsample computes it (no FMA contraction), so the same uniforms
// give the same experts as stock. One warp owns a row (as in gating.cu), or up to 32 experts one
// thread; ties go to the lower id, as torch.argmax (beats / warp_argmax, topk.cuh: a total order on
// the finite rows that get a second expert, so a thread's scan and the warp's butterfly agree). The
// counts are added per block in shared memory, then once a block and expert into the global ones:
// 32k tokens' atomics on 16 addresses had made this kernel ~8x its memory time. The backward is one
// thread per row: two logits and the first score get gradient.
#include "topk.cuh"

namespace turbomoe {

// LANES threads own a row (a warp, with CPL columns each; or one thread, CPL = E <= 32).
template <typename scalar_t, int CPL, int LANES>
__global__ void __launch_bounds__(BLOCK_THREADS)
second_expert_fwd_kernel(const scalar_t* __restrict__ logits, const float* __restrict__ rand,
                         const int32_t* __restrict__ first, const scalar_t* __restrict__ first_score,
                         int32_t* __restrict__ ids, scalar_t* __restrict__ scores, int32_t* __restrict__ counts,
                         int64_t S, int E, float tiny, float range) {
  __shared__ int32_t block_counts[MAX_EXPERTS];
  for (int c = threadIdx.x; c < E; c += BLOCK_THREADS) block_counts[c] = 0;
  __syncthreads();
  const int64_t row = int64_t(blockIdx.x) * (BLOCK_THREADS / LANES) + threadIdx.x / LANES;
  const int lane = threadIdx.x % LANES;
  const int f = row < S ? first[row] : -1;  // no early return: the block meets at the barrier below
  const scalar_t neg_inf = -std::numeric_limits<scalar_t>::infinity();
  scalar_t best = neg_inf;
  int best_id = NO_COLUMN;
  if (f >= 0) {
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + LANES * i;
      if (c < E && c != f) {
        scalar_t v = logits[row * E + c];
        if (rand != nullptr) {
          const float u = __fadd_rn(tiny, __fmul_rn(rand[row * E + c], range));
          v += static_cast<scalar_t>(-logf(-logf(u)));
        }
        if (beats(v, c, best, best_id)) {
          best = v;
          best_id = c;
        }
      }
    }
  }
  if constexpr (LANES == WARP) warp_argmax(best, best_id);  // (max value, then lowest id) over the warp
  if (lane == 0 && row < S) {
    const scalar_t p1 = first_score[row];
    const bool routed = f >= 0 && best_id < E;
    ids[row * 2] = f;
    ids[row * 2 + 1] = routed ? best_id : -1;
    scores[row * 2] = p1;
    scores[row * 2 + 1] = routed ? p1 * exp(logits[row * E + best_id] - logits[row * E + f]) : scalar_t(0);
    if (routed) atomicAdd(block_counts + best_id, 1);  // integer adds: the same counts in any order
  }
  __syncthreads();
  for (int c = threadIdx.x; c < E; c += BLOCK_THREADS) {
    if (block_counts[c]) atomicAdd(counts + c, block_counts[c]);
  }
}

template <typename scalar_t>
__global__ void second_expert_bwd_kernel(const scalar_t* __restrict__ logits, const int32_t* __restrict__ ids,
                                         const scalar_t* __restrict__ first_score,
                                         const scalar_t* __restrict__ grad_scores, scalar_t* __restrict__ grad_logits,
                                         scalar_t* __restrict__ grad_first, int64_t S, int E) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= S) return;
  const int f = ids[row * 2], e2 = ids[row * 2 + 1];
  const scalar_t g1 = grad_scores[row * 2], g2 = grad_scores[row * 2 + 1];
  if (e2 < 0) {
    grad_first[row] = g1;
    return;
  }
  const scalar_t r = exp(logits[row * E + e2] - logits[row * E + f]);
  const scalar_t d = g2 * first_score[row] * r;  // d score2 / d l2 = score2, / d l1 = -score2
  grad_first[row] = g1 + g2 * r;
  grad_logits[row * E + e2] = d;
  grad_logits[row * E + f] = -d;
}

// Returns ids [S, 2] int32, scores [S, 2] and counts [E] int32 (counts_first + second choices).
std::vector<at::Tensor> second_expert_forward(const at::Tensor& logits, const at::Tensor& first,
                                              const at::Tensor& first_score, const at::Tensor& counts_first,
                                              const c10::optional<at::Tensor>& rand) {
  check_2d(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble, "logits: fp32 or fp64");
  TORCH_CHECK(logits.size(1) <= MAX_EXPERTS, "second expert: E must be at most ", MAX_EXPERTS);
  TORCH_CHECK(first.scalar_type() == at::kInt && first.is_contiguous() && first.numel() == logits.size(0),
              "first ids: contiguous int32 [S]");
  const int64_t S = logits.size(0);
  const int E = logits.size(1);
  TORCH_CHECK(logits.size(1) >= 2, "second expert: E must be at least 2");
  TORCH_CHECK(!rand || (rand->scalar_type() == at::kFloat && rand->is_contiguous() && rand->sizes() == logits.sizes()),
              "rand: contiguous fp32 [S, E], or None");
  TORCH_CHECK(first_score.scalar_type() == logits.scalar_type() && first_score.is_contiguous() &&
                  first_score.numel() == S, "first scores: contiguous [S] in the logits' dtype");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor ids = at::empty({S, 2}, first.options());
  at::Tensor scores = at::empty({S, 2}, logits.options());
  at::Tensor counts = counts_first.to(at::kInt, /*non_blocking=*/false, /*copy=*/true).contiguous();
  if (S == 0) return {ids, scores, counts};
  // torch.distributions.Uniform(tiny, 1 - eps), whose rsample rounds high - low in fp32.
  const float tiny = std::numeric_limits<float>::min();
  const float range = (1.0f - std::numeric_limits<float>::epsilon()) - tiny;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "turbomoe_second_expert_fwd", [&] {
    auto launch = [&](auto kernel, int rows_per_block) {
      kernel<<<cdiv(S, rows_per_block), BLOCK_THREADS, 0, stream>>>(
          logits.data_ptr<scalar_t>(), rand ? rand->data_ptr<float>() : nullptr, first.data_ptr<int32_t>(),
          first_score.data_ptr<scalar_t>(), ids.data_ptr<int32_t>(), scores.data_ptr<scalar_t>(),
          counts.data_ptr<int32_t>(), S, E, tiny, range);
    };
    if (E <= WARP) {
      launch(second_expert_fwd_kernel<scalar_t, WARP, 1>, BLOCK_THREADS);
    } else {
      TURBOMOE_DISPATCH_CPL(E, [&] { launch(second_expert_fwd_kernel<scalar_t, CPL, WARP>, WARPS_PER_BLOCK); });
    }
    TURBOMOE_CHECK_LAUNCH();
  });
  return {ids, scores, counts};
}

// Returns grad_logits [S, E] (two entries per routed row) and grad of the first scores [S].
std::vector<at::Tensor> second_expert_backward(const at::Tensor& logits, const at::Tensor& ids,
                                               const at::Tensor& first_score, const at::Tensor& grad_scores) {
  check_2d(logits, "logits");
  TORCH_CHECK(ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.dim() == 2 && ids.size(1) == 2 &&
                  ids.size(0) == logits.size(0), "ids: contiguous int32 [S, 2]");
  TORCH_CHECK(grad_scores.scalar_type() == logits.scalar_type() && grad_scores.is_contiguous() &&
                  grad_scores.sizes() == ids.sizes(), "grad of scores: contiguous [S, 2] in the logits' dtype");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t S = logits.size(0);
  at::Tensor grad_logits = at::zeros_like(logits);
  at::Tensor grad_first = at::empty({S}, logits.options());
  if (S == 0) return {grad_logits, grad_first};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "turbomoe_second_expert_bwd", [&] {
    second_expert_bwd_kernel<scalar_t><<<cdiv(S, BLOCK_THREADS), BLOCK_THREADS, 0, stream>>>(
        logits.data_ptr<scalar_t>(), ids.data_ptr<int32_t>(), first_score.data_ptr<scalar_t>(),
        grad_scores.data_ptr<scalar_t>(), grad_logits.data_ptr<scalar_t>(), grad_first.data_ptr<scalar_t>(), S,
        logits.size(1));
    TURBOMOE_CHECK_LAUNCH();
  });
  return {grad_logits, grad_first};
}

}  // namespace turbomoe

// A routing row held by LANES threads: a warp (lane l holds columns l, l + 32, ...: CPL of them), or
// for few experts one thread (all CPL >= E columns: no shuffles, and a block of rows in one wave
// where a warp a row was latency-bound). Its softmax or sigmoid, the argmax and the top-k of gating.cu
// and shuffling.cu (sampling.cu's argmax too).
#pragma once

#include <climits>

#include "common.cuh"

namespace turbomoe {

template <typename acc_t> struct RowProbs {
  bool valid;  // all logits finite: else the row routes nowhere and gets no gradient
  acc_t lse;
};

// Loads a row; fills probs (softmax or sigmoid) and softmax for this lane's columns.
template <typename scalar_t, typename acc_t, int CPL, int LANES = WARP>
__device__ __forceinline__ RowProbs<acc_t> row_probs(const scalar_t* __restrict__ logits, int64_t row, int E,
                                                     bool sigmoid, acc_t (&probs)[CPL], acc_t (&softmax)[CPL]) {
  const int lane = threadIdx.x % LANES;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  acc_t x[CPL];
  bool bad = false;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + LANES * i;
    x[i] = c < E ? static_cast<acc_t>(logits[row * E + c]) : neg_inf;
    bad |= c < E && !isfinite(x[i]);
  }
  RowProbs<acc_t> r;
  r.valid = !lanes_any<LANES>(bad);
  acc_t mx = neg_inf;
#pragma unroll
  for (int i = 0; i < CPL; ++i) mx = max(mx, x[i]);
  mx = r.valid ? lanes_max<LANES>(mx) : acc_t(0);
  acc_t den = 0;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    softmax[i] = (r.valid && lane + LANES * i < E) ? exp(x[i] - mx) : acc_t(0);
    den += softmax[i];
  }
  den = r.valid ? lanes_sum<LANES>(den) : acc_t(1);
  r.lse = r.valid ? mx + log(den) : acc_t(0);
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    softmax[i] = softmax[i] / den;
    const bool cell = r.valid && lane + LANES * i < E;
    probs[i] = sigmoid ? (cell ? acc_t(1) / (acc_t(1) + exp(-x[i])) : acc_t(0)) : softmax[i];
  }
  return r;
}

// The value held at column c (register c / LANES of lane c % LANES), in every lane of the row.
template <typename acc_t, int CPL, int LANES = WARP>
__device__ __forceinline__ acc_t column_value(const acc_t (&v)[CPL], int c) {
  acc_t mine = 0;
#pragma unroll
  for (int i = 0; i < CPL; ++i) mine = (i == c / LANES) ? v[i] : mine;
  if constexpr (LANES == 1) return mine;
  else return __shfl_sync(FULL_MASK, mine, c % WARP);
}

constexpr int NO_COLUMN = INT_MAX;  // an argmax's column before it has seen a candidate

// The order of every argmax here: the larger value, then the lower column (ties to the lower expert
// id, as torch.argmax), and any column over NO_COLUMN (so -inf values stay choosable, and a lone NaN
// candidate is still taken over none: sampling.cu's rule; gating and shuffling never rank a NaN).
template <typename T>
__device__ __forceinline__ bool beats(T v, int c, T best, int best_c) {
  return v > best || (v == best && c < best_c) || (best_c == NO_COLUMN && c != NO_COLUMN);
}

// Butterfly argmax over the warp in that order: every lane ends with the same (best, best_c).
template <typename T>
__device__ __forceinline__ void warp_argmax(T& best, int& best_c) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const T v = __shfl_xor_sync(FULL_MASK, best, o);
    const int c = __shfl_xor_sync(FULL_MASK, best_c, o);
    if (beats(v, c, best, best_c)) {
      best = v;
      best_c = c;
    }
  }
}

// Top-k of a row: k times the largest sel among the columns < E not chosen yet (a mask, not -inf:
// -inf is a value an expert may hold), ties to the lower column. Choice j's score is score at its
// column (sel may differ from score: gating's bias), divided by the sum of the k scores with renorm
// (a warp adds them by butterfly, a thread in choice order). A warp's lane j < k gets choice j in
// (id[0], s[0]); a lone thread gets choice j in (id[j], s[j]). Returns this lane's chosen columns
// (bit i: column lane + LANES i).
template <typename acc_t, int CPL, int LANES = WARP>
__device__ __forceinline__ unsigned row_topk(const acc_t (&sel)[CPL], const acc_t (&score)[CPL], int E, int k,
                                             bool renorm, int (&id)[MAX_K], acc_t (&s)[MAX_K]) {
  const int lane = threadIdx.x % LANES;
  unsigned chosen = 0;
  for (int j = 0; j < k; ++j) {
    acc_t bv = -std::numeric_limits<acc_t>::infinity();
    int bc = NO_COLUMN;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + LANES * i;
      if (c < E && !((chosen >> i) & 1u) && beats(sel[i], c, bv, bc)) {
        bv = sel[i];
        bc = c;
      }
    }
    if constexpr (LANES == WARP) warp_argmax(bv, bc);
    const acc_t sc = column_value<acc_t, CPL, LANES>(score, bc);
    if (lane == bc % LANES) chosen |= 1u << (bc / LANES);
    if constexpr (LANES == 1) {
#pragma unroll
      for (int q = 0; q < MAX_K; ++q) {  // register q of a run-time j: unrolled, no local memory
        if (q == j) {
          id[q] = bc;
          s[q] = sc;
        }
      }
    } else if (lane == j) {
      id[0] = bc;
      s[0] = sc;
    }
  }
  if (renorm) {
    acc_t total = 0;
    if constexpr (LANES == 1) {
#pragma unroll
      for (int q = 0; q < MAX_K; ++q) total += q < k ? s[q] : acc_t(0);
    } else {
      total = warp_sum(lane < k ? s[0] : acc_t(0));
    }
    total = total > 0 ? total : acc_t(1);
#pragma unroll
    for (int q = 0; q < (LANES == 1 ? MAX_K : 1); ++q) s[q] = s[q] / total;  // IEEE: for k = 1 exactly 1
  }
  return chosen;
}

// row_topk of a warp's row: lane j < k gets choice j in (id, s).
template <typename acc_t, int CPL>
__device__ __forceinline__ unsigned warp_topk(const acc_t (&sel)[CPL], const acc_t (&score)[CPL], int E, int k,
                                              bool renorm, int& id, acc_t& s) {
  int ids[MAX_K] = {id};
  acc_t scores[MAX_K] = {s};
  const unsigned chosen = row_topk<acc_t, CPL, WARP>(sel, score, E, k, renorm, ids, scores);
  id = ids[0];
  s = scores[0];
  return chosen;
}

}  // namespace turbomoe

// A routing row held by one warp (lane l holds columns l, l + 32, ...: CPL of them): its softmax or
// sigmoid, the warp argmax and the top-k of gating.cu and shuffling.cu (sampling.cu's argmax too).
#pragma once

#include <climits>

#include "common.cuh"

namespace turbomoe {

template <typename acc_t> struct RowProbs {
  bool valid;  // all logits finite: else the row routes nowhere and gets no gradient
  acc_t lse;
};

// Loads a row; fills probs (softmax or sigmoid) and softmax for this lane's columns.
template <typename scalar_t, typename acc_t, int CPL>
__device__ __forceinline__ RowProbs<acc_t> row_probs(const scalar_t* __restrict__ logits, int64_t row, int E,
                                                     bool sigmoid, acc_t (&probs)[CPL], acc_t (&softmax)[CPL]) {
  const int lane = threadIdx.x % WARP;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  acc_t x[CPL];
  bool bad = false;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + WARP * i;
    x[i] = c < E ? static_cast<acc_t>(logits[row * E + c]) : neg_inf;
    bad |= c < E && !isfinite(x[i]);
  }
  RowProbs<acc_t> r;
  r.valid = !__any_sync(FULL_MASK, bad);
  acc_t mx = neg_inf;
#pragma unroll
  for (int i = 0; i < CPL; ++i) mx = max(mx, x[i]);
  mx = r.valid ? warp_max(mx) : acc_t(0);
  acc_t den = 0;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    softmax[i] = (r.valid && lane + WARP * i < E) ? exp(x[i] - mx) : acc_t(0);
    den += softmax[i];
  }
  den = r.valid ? warp_sum(den) : acc_t(1);
  r.lse = r.valid ? mx + log(den) : acc_t(0);
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    softmax[i] = softmax[i] / den;
    const bool cell = r.valid && lane + WARP * i < E;
    probs[i] = sigmoid ? (cell ? acc_t(1) / (acc_t(1) + exp(-x[i])) : acc_t(0)) : softmax[i];
  }
  return r;
}

// The value a lane holds at column c (c / 32 in its registers), broadcast from lane c % 32.
template <typename acc_t, int CPL>
__device__ __forceinline__ acc_t column_value(const acc_t (&v)[CPL], int c) {
  acc_t mine = 0;
#pragma unroll
  for (int i = 0; i < CPL; ++i) mine = (i == c / WARP) ? v[i] : mine;
  return __shfl_sync(FULL_MASK, mine, c % WARP);
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
// column (sel may differ from score: gating's bias); lane j < k gets choice j in (id, s), divided by
// the sum of the k scores with renorm. Returns this lane's chosen columns (bit i: lane + 32 i).
template <typename acc_t, int CPL>
__device__ __forceinline__ unsigned warp_topk(const acc_t (&sel)[CPL], const acc_t (&score)[CPL], int E, int k,
                                              bool renorm, int& id, acc_t& s) {
  const int lane = threadIdx.x % WARP;
  unsigned chosen = 0;
  for (int j = 0; j < k; ++j) {
    acc_t bv = -std::numeric_limits<acc_t>::infinity();
    int bc = NO_COLUMN;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + WARP * i;
      if (c < E && !((chosen >> i) & 1u) && beats(sel[i], c, bv, bc)) {
        bv = sel[i];
        bc = c;
      }
    }
    warp_argmax(bv, bc);
    const acc_t sc = column_value<acc_t, CPL>(score, bc);
    if (lane == bc % WARP) chosen |= 1u << (bc / WARP);
    if (lane == j) {
      id = bc;
      s = sc;
    }
  }
  if (renorm) {
    acc_t total = warp_sum(lane < k ? s : acc_t(0));
    total = total > 0 ? total : acc_t(1);
    s = s / total;  // IEEE division: for k = 1 exactly 1, as in the reference
  }
  return chosen;
}

}  // namespace turbomoe

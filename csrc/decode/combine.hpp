// Combine kernel of the split-KV decode: out = sum_s exp(lse_s - lse) o_s, lse = log sum_s exp(lse_s), over
// the splits' fp32 partials (DecodeParams::o_accum / lse_accum). One warp per output row; a row whose
// splits all saw no key gets out = 0 and lse = -inf.
#pragma once

#include <cutlass/array.h>
#include <cutlass/numeric_types.h>

#include <cmath>

#include "../common/softmax.hpp"
#include "../params.h"

namespace flash4 {

template <class Element, int kHeadDim>
struct DecodeCombine {
  static constexpr int kWarps = 4;
  static constexpr int kNumThreads = 32 * kWarps;
  static constexpr int kPerLane = kHeadDim / 32;  // columns per lane (2..8)
  static_assert(kHeadDim % 32 == 0);

  static dim3 grid(DecodeParams const& p) {
    const int64_t rows = int64_t(p.batch) * p.nheads_q * p.seqlen_q;
    return dim3(unsigned((rows + kWarps - 1) / kWarps));
  }

  CUTE_DEVICE void operator()(DecodeParams const& p) const {
    const int64_t rows = int64_t(p.batch) * p.nheads_q * p.seqlen_q;
    const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float* lse_s = p.lse_accum + row;  // split s at lse_s[s * rows]
    float m = -INFINITY;
    for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, lse_s[s * rows]);
    m = allreduce_max<32>(m);
    float sum = 0.f;
    if (m != -INFINITY) {
      for (int s = lane; s < p.num_splits; s += 32) sum += expf(lse_s[s * rows] - m);
    }
    sum = allreduce_sum<32>(sum);
    const float lse = sum > 0.f ? m + logf(sum) : -INFINITY;

    float acc[kPerLane] = {};
    if (sum > 0.f) {
      for (int s = 0; s < p.num_splits; ++s) {
        const float l = lse_s[s * rows];
        if (l == -INFINITY) continue;
        const float w = expf(l - lse);
        const float* o = p.o_accum + (s * rows + row) * kHeadDim + lane * kPerLane;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) acc[j] += w * o[j];
      }
    }
    // row = (b * nheads_q + h) * seqlen_q + t
    const int t = int(row % p.seqlen_q), h = int(row / p.seqlen_q % p.nheads_q), b = int(row / p.seqlen_q / p.nheads_q);
    Element* out = static_cast<Element*>(p.o) + int64_t(b) * p.o_batch_stride + int64_t(t) * p.o_row_stride +
                   int64_t(h) * p.o_head_stride + lane * kPerLane;
    cutlass::Array<Element, kPerLane> v;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = Element(acc[j]);
    *reinterpret_cast<cutlass::Array<Element, kPerLane>*>(out) = v;
    if (lane == 0) p.lse[row] = lse;
  }
};

}  // namespace flash4

// The backward's pre-pass (arch-independent CUDA, one warp per query row): D = rowsum(dout * out) - dlse, lse in
// log2 units (+inf where exp must give 0), dq_accum zeroed. A memory-bound pass over (batch, heads,
// seqlen_q, head_dim) with 16-byte loads. The post-pass depends on the order in which the main kernel
// leaves dq_accum, so it lives beside that kernel (sm90/bwd_postprocess_sm90.hpp).
#pragma once

#include <cuda_runtime_api.h>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <cmath>

#include "../params.h"

namespace flash4 {

constexpr int kPrePostThreads = 128;

// Row r of the padded (batch * nheads_q * seqlen_q_rounded) range, or false past its end.
struct RowIndex {
  int64_t bh;  // b * nheads_q + h
  int b, h, row;
};

__device__ __forceinline__ bool row_index(const BwdParams& p, RowIndex& r) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t total = int64_t(p.batch) * p.nheads_q * p.seqlen_q_rounded;
  if (warp >= total) return false;
  r.row = int(warp % p.seqlen_q_rounded);
  r.bh = warp / p.seqlen_q_rounded;
  r.h = int(r.bh % p.nheads_q);
  r.b = int(r.bh / p.nheads_q);
  return true;
}

template <class Element>
__global__ void __launch_bounds__(kPrePostThreads) bwd_preprocess_kernel(const BwdParams p) {
  RowIndex r;
  if (!row_index(p, r)) return;
  const int lane = threadIdx.x % 32;
  using Vec = cutlass::Array<Element, 8>;  // 16 bytes
  float d = 0.f;
  if (r.row < p.seqlen_q) {
    const Element* o = static_cast<const Element*>(p.out) + r.b * p.out_batch_stride + r.row * p.out_row_stride +
                       r.h * p.out_head_stride;
    const Element* dout = static_cast<const Element*>(p.dout) + r.b * p.dout_batch_stride +
                          r.row * p.dout_row_stride + r.h * p.dout_head_stride;
    for (int c = lane * 8; c < p.head_dim; c += 32 * 8) {
      const Vec ov = *reinterpret_cast<const Vec*>(o + c);
      const Vec dv = *reinterpret_cast<const Vec*>(dout + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) d += float(ov[i]) * float(dv[i]);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) d += __shfl_xor_sync(0xffffffffu, d, offset);

  float4* acc = reinterpret_cast<float4*>(p.dq_accum + (r.bh * p.seqlen_q_rounded + r.row) * p.head_dim);
  for (int c = lane; c < p.head_dim / 4; c += 32) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);

  if (lane == 0) {
    const int64_t i = r.bh * p.seqlen_q_rounded + r.row;
    const bool real_row = r.row < p.seqlen_q;
    p.dpsum[i] = real_row && p.dlse != nullptr ? d - p.dlse[r.bh * p.seqlen_q + r.row] : d;
    const float lse = real_row ? p.lse[r.bh * p.seqlen_q + r.row] : -INFINITY;
    p.lse_log2[i] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
  }
}

inline dim3 prepost_grid(const BwdParams& p) {
  const int64_t rows = int64_t(p.batch) * p.nheads_q * p.seqlen_q_rounded;
  return dim3(unsigned((rows * 32 + kPrePostThreads - 1) / kPrePostThreads));
}

}  // namespace flash4

// Post-pass of the sm90 backward: dq = dq_accum * softmax_scale in the input dtype.
//
// The main kernel leaves each 64-row block of dq_accum in its dQ accumulator's register order (float4 i of
// consumer thread t at i * 128 + t within its warpgroup's half, see BwdTraitsSm90::SharedStorage::dq). One
// CTA per (query block, head, batch) with the main kernel's 256 consumer threads reads that back with the
// same TiledMma partition, so every thread recovers the (row, column) of its values without a table.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "../common/bwd_prepost.cuh"
#include "../params.h"

namespace flash4 {

using namespace cute;

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumMmaThreads) bwd_postprocess_sm90_kernel(const BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  const int m_block = blockIdx.x, bidh = blockIdx.y, bidb = blockIdx.z;
  const int thread_idx = threadIdx.x, warp_group = thread_idx / 128, wg_thread = thread_idx % 128;
  typename Traits::TiledMmadQ mma_dq;
  Tensor cdQ = mma_dq.get_thread_slice(thread_idx).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  const PrePostRow r = prepost_row(p, bidh, bidb);
  if (m_block * kBlockM >= r.seq.seqlen_q) return;  // packed batches: past this sequence's end
  const float4* acc = reinterpret_cast<const float4*>(p.dq_accum) +
                      ((r.accum_row0 + int64_t(m_block) * kBlockM) * kHeadDim + warp_group * Traits::kdQChunk) / 4;
  Element* dq = static_cast<Element*>(p.dq) + r.seq.batch * p.dq_batch_stride + bidh * p.dq_head_stride +
                r.seq.offset_q * p.dq_row_stride;
  cutlass::NumericArrayConverter<Element, float, 2> convert;
#pragma unroll
  for (int e = 0; e < size(cdQ); e += 4) {
    const float4 a = acc[(e / 4) * 128 + wg_thread];
    const float v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
      // Elements e + j and e + j + 1 are adjacent columns (even first) of one row.
      const int row = m_block * kBlockM + get<0>(cdQ(e + j)), col = get<1>(cdQ(e + j));
      if (row < r.seq.seqlen_q) {
        cutlass::Array<float, 2> f;
        f[0] = v[j] * p.softmax_scale;
        f[1] = v[j + 1] * p.softmax_scale;
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dq + row * p.dq_row_stride + col) = convert(f);
      }
    }
  }
}

}  // namespace flash4

// Post-pass of the sm90 backward: dq = dq_accum * softmax_scale in the input dtype.
//
// The main kernel leaves each 64-row block of dq_accum in its dQ accumulator's register order (float4 i of
// consumer thread t at i * 128 + t within its warpgroup's half, see BwdTraitsSm90::SharedStorage::dq). One
// CTA per (query block, head, batch) with the main kernel's 256 consumer threads reads that back, coalesced,
// with the same TiledMma partition, so every thread recovers the (row, column) of its values without a table.
// The converted values leave through store_dq_staged (common/bwd_prepost.cuh).
#pragma once

#include <cute/tensor.hpp>

#include "../common/bwd_prepost.cuh"
#include "../params.h"

namespace flash4 {

using namespace cute;

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumMmaThreads) bwd_postprocess_sm90_kernel(const BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim, kThreads = Traits::kNumMmaThreads;
  const int m_block = blockIdx.x, bidh = blockIdx.y, bidb = blockIdx.z;
  const int thread_idx = threadIdx.x, warp_group = thread_idx / 128, wg_thread = thread_idx % 128;
  const PrePostRow r = prepost_row(p, bidh, bidb);
  if (m_block * kBlockM >= r.seq.seqlen_q) return;  // packed batches: past this sequence's end
  typename Traits::TiledMmadQ mma_dq;
  Tensor cdQ = mma_dq.get_thread_slice(thread_idx).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  const float4* acc = reinterpret_cast<const float4*>(p.dq_accum) +
                      ((r.accum_row0 + int64_t(m_block) * kBlockM) * kHeadDim + warp_group * Traits::kdQChunk) / 4;
  float4 a[size(cdQ) / 4];
#pragma unroll
  for (int i = 0; i < size(cdQ) / 4; ++i) a[i] = acc[i * 128 + wg_thread];  // all loads in flight at once
  auto value = [&](int e) {
    const float4& v = a[e / 4];
    return e % 4 == 0 ? v.x : e % 4 == 1 ? v.y : e % 4 == 2 ? v.z : v.w;  // e is a constant after unrolling
  };
  Element* dq = static_cast<Element*>(p.dq) + r.seq.batch * p.dq_batch_stride + bidh * p.dq_head_stride +
                (r.seq.offset_q + int64_t(m_block) * kBlockM) * p.dq_row_stride;
  store_dq_staged<Element, kBlockM, kHeadDim, kThreads>(cdQ, value, p.softmax_scale, dq, p.dq_row_stride,
                                                         min(kBlockM, r.seq.seqlen_q - m_block * kBlockM));
}

}  // namespace flash4

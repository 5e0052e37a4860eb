// The sm80 backward's post-pass: dq = dq_accum * softmax_scale, read back from the main kernel's register
// order (kernel_bwd_sm80.hpp).
#pragma once

#include <cute/tensor.hpp>

#include "../common/bwd_prepost.cuh"
#include "../params.h"

namespace flash4 {

using namespace cute;

// dq = dq_accum * softmax_scale. One CTA per (query block, head, batch) with the main kernel's threads: each
// reads its dQ elements back from the register order (coalesced), recovers their (row, column) from the same
// TiledMma partition and hands them to store_dq_staged (common/bwd_prepost.cuh).
template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads) bwd_postprocess_sm80_kernel(const BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim, kThreads = Traits::kNumThreads;
  const int m_block = blockIdx.x, bidh = blockIdx.y, bidb = blockIdx.z, tid = threadIdx.x;
  const PrePostRow r = prepost_row(p, bidh, bidb);
  if (m_block * kBlockM >= r.seq.seqlen_q) return;  // packed batches: past this sequence's end
  typename Traits::TiledMmadQ mma_dq;
  Tensor cdQ = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  const float* acc = p.dq_accum + (r.accum_row0 + int64_t(m_block) * kBlockM) * kHeadDim + tid;
  float a[size(cdQ)];
#pragma unroll
  for (int e = 0; e < size(cdQ); ++e) a[e] = acc[e * kThreads];
  Element* dq = static_cast<Element*>(p.dq) + r.seq.batch * p.dq_batch_stride + bidh * p.dq_head_stride +
                (r.seq.offset_q + int64_t(m_block) * kBlockM) * p.dq_row_stride;
  store_dq_staged<Element, kBlockM, kHeadDim, kThreads>(cdQ, [&](int e) { return a[e]; }, p.softmax_scale, dq,
                                                         p.dq_row_stride, min(kBlockM, r.seq.seqlen_q - m_block * kBlockM));
}

}  // namespace flash4

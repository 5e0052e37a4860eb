// The backward's pre-pass (arch-independent CUDA, a few lanes per query row of each sequence): D =
// rowsum(dout * out) - dlse, lse in log2 units (+inf where exp must give 0). A memory-bound pass over (batch, heads,
// seqlen_q, head_dim) with 16-byte loads. The post-passes depend on the order in which each main kernel
// leaves dq_accum, so they live beside those kernels (sm90/bwd_postprocess_sm90.hpp, sm80/kernel_bwd_sm80.hpp);
// their common tail (store_dq_staged) is here.
#pragma once

#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <cmath>

#include "../params.h"
#include "block_info.hpp"

namespace flash4 {

constexpr int kPrePostThreads = 128;

// Where row `row` of sequence bidb / head bidh lives: in q-shaped tensors (offset_q + row) and in the
// scratch (accum_row0 + row). Rows past the padded end of the sequence (packed batches: the grid covers the
// longest sequence) are never read by the main kernel.
struct PrePostRow {
  SeqInfo seq;
  int64_t accum_row0;  // scratch row of the sequence's row 0 for this head
};

__device__ __forceinline__ PrePostRow prepost_row(const BwdParams& p, int bidh, int bidb) {
  const SeqInfo seq = make_seq_info(p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, bidb, p.seqlen_q,
                                    p.seqlen_k, p.total_q, p.total_k);
  const int64_t offset = p.cu_seqlens_q ? padded_row_offset(seq.offset_q, bidb) : 0;
  return {seq, seq.batch * p.accum_batch_stride + bidh * p.accum_head_stride + offset};
}

// Threads per row: one 16-byte vector of out and dout each (a power of two, so the row sum is a butterfly).
template <int kHeadDim>
constexpr int kPreThreadsPerRow = kHeadDim / 8 <= 8 ? 8 : kHeadDim / 8 <= 16 ? 16 : 32;
template <int kHeadDim>
constexpr int kPreRowsPerCta = kPrePostThreads / kPreThreadsPerRow<kHeadDim>;

// Grid (seqlen_q_rounded / kPreRowsPerCta, nheads_q, batch). dq_accum is zeroed separately (a fill kernel
// runs at full bandwidth; this pass only reads out and dout and writes two floats per row).
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kPrePostThreads) bwd_preprocess_kernel(const BwdParams p) {
  constexpr int kThreads = kPreThreadsPerRow<kHeadDim>;
  const int bidh = blockIdx.y, bidb = blockIdx.z;
  const int row = blockIdx.x * kPreRowsPerCta<kHeadDim> + threadIdx.x / kThreads;
  const int t = threadIdx.x % kThreads;
  const PrePostRow r = prepost_row(p, bidh, bidb);
  const int seqlen_q = r.seq.seqlen_q;
  // Whole rows leave together, so the butterfly below only ever mixes lanes of live rows.
  if (row >= (seqlen_q + kAccumRowAlign - 1) / kAccumRowAlign * kAccumRowAlign) return;
  const bool real_row = row < seqlen_q;
  const int64_t q_row = int64_t(r.seq.offset_q) + row;
  using Vec = cutlass::Array<Element, 8>;  // 16 bytes
  float d = 0.f;
  if (real_row && t * 8 < kHeadDim) {
    const Element* o = static_cast<const Element*>(p.out) + r.seq.batch * p.out_batch_stride +
                       q_row * p.out_row_stride + bidh * p.out_head_stride;
    const Element* dout = static_cast<const Element*>(p.dout) + r.seq.batch * p.dout_batch_stride +
                          q_row * p.dout_row_stride + bidh * p.dout_head_stride;
#pragma unroll
    for (int c = t * 8; c < kHeadDim; c += kThreads * 8) {
      const Vec ov = *reinterpret_cast<const Vec*>(o + c);
      const Vec dv = *reinterpret_cast<const Vec*>(dout + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) d += float(ov[i]) * float(dv[i]);
    }
  }
  // The rows of a warp finish together (row ranges are multiples of a warp's rows), so all 32 lanes are here.
#pragma unroll
  for (int offset = kThreads / 2; offset > 0; offset /= 2) d += __shfl_xor_sync(0xffffffffu, d, offset);

  if (t == 0) {
    const int64_t i = r.accum_row0 + row;
    const int64_t lse_i = r.seq.batch * p.lse_batch_stride + bidh * p.lse_head_stride + q_row;
    p.dpsum[i] = real_row && p.dlse != nullptr ? d - p.dlse[lse_i] : d;
    const float lse = real_row ? p.lse[lse_i] : -INFINITY;
    p.lse_log2[i] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
  }
}

template <int kHeadDim>
inline dim3 prepost_grid(const BwdParams& p) {
  return dim3(unsigned(p.seqlen_q_rounded / kPreRowsPerCta<kHeadDim>), unsigned(p.nheads_q), unsigned(p.batch));
}

// A kRows x kCols fp32 accumulator tile, times `scale`, to global memory as 16-bit values through shared memory
// (`tile`: kRows x staged_pitch<kCols> elements). value(e) is this thread's element e, at (row, column) c(e)
// (+ col0) of the tile, elements e and e + 1 adjacent columns (even first) of one row. They are converted in
// pairs into the padded tile (16 bytes of padding a row: the 8 rows x 4 pairs of a warp's store land in 32
// banks) and leave as whole 16-byte row pieces, rows from `rows` on skipped. Storing the pairs straight from
// the MMA layout (4 bytes per thread, 8 rows per warp instruction) ran at a third of the bandwidth (88 us vs
// cuDNN's 30 us for dq of 2 x 4096 x 16 heads at d 128 on the H200). Callers make `tile` free of other
// readers before, and keep it until every thread is past the barrier inside. The kThreads threads that call it
// are numbered tid = 0 .. kThreads - 1 and meet at sync() (by default the whole CTA, threadIdx.x and
// __syncthreads).
template <int kCols>
constexpr int staged_pitch = kCols + 8;

template <class Element, int kRows, int kCols, int kThreads, class Coord, class Value, class Sync>
__device__ __forceinline__ void store_staged(Coord const& c, Value const& value, float scale, Element* out,
                                             int64_t row_stride, int rows, Element* tile, int col0, int tid,
                                             Sync&& sync) {
  constexpr int kPitch = staged_pitch<kCols>;
  constexpr int kVecs = kCols / 8;  // 16-byte pieces per row
  cutlass::NumericArrayConverter<Element, float, 2> convert;
#pragma unroll
  for (int e = 0; e < cute::size(c); e += 2) {
    cutlass::Array<float, 2> f;
    f[0] = value(e) * scale;
    f[1] = value(e + 1) * scale;
    *reinterpret_cast<cutlass::Array<Element, 2>*>(&tile[cute::get<0>(c(e)) * kPitch + col0 + cute::get<1>(c(e))]) =
        convert(f);
  }
  sync();
#pragma unroll
  for (int i = tid; i < kRows * kVecs; i += kThreads) {
    const int row = i / kVecs, v = i % kVecs;
    if (row < rows) {
      *reinterpret_cast<uint4*>(out + row * row_stride + v * 8) =
          *reinterpret_cast<const uint4*>(&tile[row * kPitch + v * 8]);
    }
  }
}

template <class Element, int kRows, int kCols, int kThreads, class Coord, class Value>
__device__ __forceinline__ void store_staged(Coord const& c, Value const& value, float scale, Element* out,
                                             int64_t row_stride, int rows, Element* tile, int col0 = 0) {
  store_staged<Element, kRows, kCols, kThreads>(c, value, scale, out, row_stride, rows, tile, col0, int(threadIdx.x),
                                                [] { __syncthreads(); });
}

// The post-passes' common tail: dq of one kBlockM x kHeadDim block through a static shared tile.
template <class Element, int kBlockM, int kHeadDim, int kThreads, class Coord, class Value>
__device__ __forceinline__ void store_dq_staged(Coord const& cdQ, Value const& value, float scale, Element* dq,
                                                int64_t row_stride, int rows) {
  __shared__ alignas(16) Element tile[kBlockM * staged_pitch<kHeadDim>];
  store_staged<Element, kBlockM, kHeadDim, kThreads>(cdQ, value, scale, dq, row_stride, rows, tile);
}

}  // namespace flash4

// Compile-time configuration of the sm90 backward kernel.
//
// One CTA owns kBlockN = 128 keys of one kv head (64 per consumer warpgroup: one WGMMA M-atom) and loops
// over the query heads of its GQA group and over query blocks of kBlockM = 64 rows (128 at head dim 64). Per
// query block each consumer warpgroup computes, for its 64 keys k and the block's 64 queries q:
//   S^T  = K_k Q_q^T            (SS)      P^T  = exp2(S^T * scale_log2 - lse_log2[q])
//   dP^T = V_k dO_q^T           (SS)      dS^T = P^T * (dP^T - D[q])
//   dV_k += P^T dO_q            (RS: P^T stays in registers, dO read through an MN-major view)
//   dK_k += dS^T Q_q            (RS)
// and then, with both warpgroups' dS in shared memory, dQ_q = dS_q K (SS; the warpgroups split head_dim, or the
// queries when a step has 128).
// dQ_q goes to shared memory in the accumulator's register order and a warp of the producer warpgroup adds
// it to an fp32 buffer with one bulk reduce-add per warpgroup (cp.reduce.async.bulk), off the MMA warps'
// critical path; the post-pass undoes the order, scales and converts.
// Working in the transposed (keys x queries) orientation puts P^T and dS^T in the accumulator layout
// that the RS GEMMs for dV and dK take as their A operand, so neither needs a shared-memory round trip.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "kernel_traits_fwd_sm90.hpp"  // gmma_smem_atom

namespace flash4 {

using namespace cute;

// kBlockM, kBlockN, kStages: bwd_tile_sm90 (common/tile_size.h).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct BwdTraitsSm90 {
  using Element = Element_;
  static constexpr bool kWide = false;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDim_;  // one head dim (MLA heads take the wide traits)
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kStages = kStages_;
  static_assert(kBlockN == 128 && (kBlockM == 64 || kBlockM == 128),
                "64 keys per consumer warpgroup (one WGMMA M-atom), 64 or 128 queries a step");
  // dK and dV accumulators (64 x head_dim fp32 each per warpgroup) must fit beside S^T, dP^T and dQ.
  static_assert(kHeadDim <= 128, "the sm90 backward handles head_dim <= 128 so far");

  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using AtomLayoutKeys = Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>;  // warpgroup w owns keys [64w, 64w+64)
  // S^T and dP^T: (keys, queries, head_dim).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(), AtomLayoutKeys{}));
  // dV and dK: (keys, head_dim, queries), A from registers, B = dO^T / Q^T (MN-major views).
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomLayoutKeys{}));
  using TiledMmadV = TiledMmadKV;
  // dQ = dS K: (queries, head_dim, keys), A = dS with queries contiguous, B = K^T; both warpgroups read all
  // 128 keys of dS, so dS goes through shared memory from both. With 64 queries a step the warpgroups split
  // head_dim (each a 64 x head_dim/2 accumulator: 32 registers at hdim 128 instead of 64 for a split over
  // keys); with 128 (hdim 64) they split the queries, 64 x head_dim each: the same 32 registers, but N = 64
  // GEMMs instead of N = 32 ones, which read dS from shared memory once instead of twice (64 KB a step
  // instead of 80 for the dQ GEMM's operands).
  static constexpr bool kdQSplitsQueries = kBlockM == 128;
  static constexpr int kdQCols = kdQSplitsQueries ? kHeadDim : kHeadDim / 2;  // head_dim columns a warpgroup
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kdQCols>, Int<kBlockN>>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      std::conditional_t<kdQSplitsQueries, Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>,
                         Layout<Shape<_1, Int<kNumMmaWarpGroups>, _1>>>{}));

  // K's swizzle atom is sized by the per-warpgroup dQ width, not by head_dim: each warpgroup's slice of the
  // K^T view (the dQ GEMM's B operand) must start on an atom boundary to be a canonical GMMA layout (at hdim
  // 96 a 48-column slice of 32-wide SW64 atoms is not). V is not split, so it keeps the widest atom and the
  // largest TMA boxes.
  using SmemLayoutK = decltype(tile_to_shape(gmma_smem_atom<Element, kdQCols, GMMA::Major::K>(),
                                             Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = decltype(tile_to_shape(gmma_smem_atom<Element, kHeadDim, GMMA::Major::K>(),
                                             Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(gmma_smem_atom<Element, kHeadDim, GMMA::Major::K>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutdO = SmemLayoutQ;
  // The same bytes seen transposed, (head_dim, rows[, stage]), as MN-major GMMA operands.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutdOt = SmemLayoutQt;
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // dS: (queries, keys, buffer) with queries contiguous (the dQ GEMM's MN-major A operand). Double
  // buffered: step m+1 writes one buffer while the other warpgroup may still be reading step m's.
  using SmemLayoutdS = decltype(tile_to_shape(gmma_smem_atom<Element, kBlockM, GMMA::Major::MN>(),
                                              Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  using SmemLayoutRow = Layout<Shape<Int<kBlockM>, Int<kStages>>>;  // lse_log2 and D per stage

  using PipelineQdO = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineQdO::PipelineState;

  static constexpr int kdQChunk = kBlockM * kHeadDim / kNumMmaWarpGroups;  // floats per warpgroup per step
  static_assert(kdQChunk % (4 * 128) == 0, "each thread's dQ fragment must be whole float4s");

  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesQdO = 2 * kBlockM * kHeadDim * sizeof(Element) + 2 * kBlockM * sizeof(float);

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdO>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>> ds;
    // dQ of one query block: warpgroup w's half is floats [w * kdQChunk, (w + 1) * kdQChunk), float4 i of
    // thread t at i * 128 + t (16-byte stores, no bank conflicts), the order the post-pass expects.
    // 1024-aligned (it follows ds, a multiple of 1024 bytes, so this adds no padding): the persistent kernel's
    // dV leaves through it by TMA store from a 128-byte-swizzled tile.
    alignas(1024) cute::array_aligned<float, kBlockM * kHeadDim> dq;
    alignas(128) cute::array_aligned<float, cosize_v<SmemLayoutRow>> lse_log2;  // TMA destinations: 128 B
    alignas(128) cute::array_aligned<float, cosize_v<SmemLayoutRow>> dpsum;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;
    typename PipelineQdO::SharedStorage pipeline_qdo;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

// Head dims 192 and 256: a 64 x head_dim fp32 dK plus dV per warpgroup (192 / 256 registers) no longer fit, so
// the two consumer warpgroups split dK and dV along head_dim instead of along keys. One CTA owns kBlockN = 64
// keys; per 64-query block:
//   S^T, dP^T (keys x queries): warpgroup w computes queries [32w, 32w + 32)         (SS)
//   P^T and dS^T go to shared memory (stmatrix), both warpgroups' halves behind one barrier, then
//   dV[:, half w] += P^T dO[:, half w],  dK[:, half w] += dS^T Q[:, half w]          (SS, A = P^T / dS^T)
//   dQ[:, half w]  = dS K[:, half w]                                                  (SS, as the narrow kernel)
// and dQ goes straight from registers to dq_accum with 16-byte reductions in the post-pass's order (its
// shared-memory staging would not fit beside two Q/dO stages at head dim 256).
// kHeadDimV: v's and dO's head dim (MLA heads, 192 / 128: below kHeadDim); it shapes V, dO, dP^T's reduction
// and the dV accumulator (kHeadDimV / 2 columns a warpgroup).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, int kHeadDimV_ = kHeadDim_>
struct BwdWideTraitsSm90 {
  using Element = Element_;
  static constexpr bool kWide = true;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static_assert(kHeadDimV <= kHeadDim && kHeadDimV % 32 == 0);
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kStages = kStages_;
  static_assert(kBlockN == 64 && kBlockM == 64, "one WGMMA M-atom of keys, 32 queries per warpgroup for S^T");
  static_assert(kHeadDim > 128 && kHeadDim <= 256 && kHeadDim % 32 == 0);

  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kHalf = kHeadDim / 2;    // head_dim columns per warpgroup (dK, dQ)
  static constexpr int kHalfV = kHeadDimV / 2;  // v head_dim columns per warpgroup (dV)

  using SplitN = Layout<Shape<_1, Int<kNumMmaWarpGroups>, _1>>;  // warpgroup w owns N block w
  // S^T and dP^T: (keys, queries, head_dim); warpgroup w: queries [32w, 32w + 32).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM / 2>, Int<kHeadDim>>>(), SplitN{}));
  // dK and dV: (keys, head_dim, queries); A = dS^T / P^T (queries contiguous), B = Q^T / dO^T (MN-major).
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHalf>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      SplitN{}));
  using TiledMmadV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHalfV>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      SplitN{}));  // TiledMmadKV's type where kHeadDimV == kHeadDim
  // dQ = dS K: (queries, head_dim, keys), A = dS (queries contiguous), B = K^T.
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHalf>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      SplitN{}));

  // Operands sliced along head_dim by warpgroup (K, Q, dO) use atoms sized by the half, so each slice
  // starts on an atom boundary (a canonical GMMA layout); V is only read whole.
  using SmemLayoutK = decltype(tile_to_shape(gmma_smem_atom<Element, kHalf, GMMA::Major::K>(),
                                             Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = decltype(tile_to_shape(gmma_smem_atom<Element, kHeadDimV, GMMA::Major::K>(),
                                             Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(gmma_smem_atom<Element, kHalf, GMMA::Major::K>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  // dO: Q's layouts at v's head dim (the same types where kHeadDimV == kHeadDim).
  using SmemLayoutdO = decltype(tile_to_shape(gmma_smem_atom<Element, kHalfV, GMMA::Major::K>(),
                                              Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kStages>>{}));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_layout(Shape<Int<kHeadDimV>, Int<kBlockM>, Int<kStages>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDimV>>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // P and dS: (queries, keys, buffer), queries contiguous; the (keys, queries, buffer) view of the same
  // bytes is the K-major A operand of the dV / dK GEMMs and the stmatrix destination.
  using SmemLayoutdS = decltype(tile_to_shape(gmma_smem_atom<Element, kBlockM, GMMA::Major::MN>(),
                                              Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kBlockN>>{})));
  using SmemLayoutRow = Layout<Shape<Int<kBlockM>, Int<kStages>>>;

  using PipelineQdO = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineQdO::PipelineState;

  static constexpr int kdQChunk = kBlockM * kHeadDim / kNumMmaWarpGroups;  // floats per warpgroup per step
  static_assert(kdQChunk % (4 * 128) == 0, "each thread's dQ fragment must be whole float4s");

  static constexpr uint32_t kTmaBytesKV = kBlockN * (kHeadDim + kHeadDimV) * sizeof(Element);
  static constexpr uint32_t kTmaBytesQdO =
      kBlockM * (kHeadDim + kHeadDimV) * sizeof(Element) + 2 * kBlockM * sizeof(float);

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdO>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>> p;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>> ds;
    alignas(128) cute::array_aligned<float, cosize_v<SmemLayoutRow>> lse_log2;
    alignas(128) cute::array_aligned<float, cosize_v<SmemLayoutRow>> dpsum;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;
    typename PipelineQdO::SharedStorage pipeline_qdo;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

}  // namespace flash4

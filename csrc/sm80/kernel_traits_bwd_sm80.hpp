// Compile-time configuration of the sm80 backward (cp.async + ldmatrix + mma.sync), head dims <= 128.
//
// One CTA of 8 warps owns kBlockN = 128 keys of one kv head and loops over the query heads of its GQA group
// and over query blocks of kBlockM = 64 rows (FlashAttention-2's algorithm, keys as the GEMM rows):
//   S^T = K Q^T, dP^T = V dO^T          (warp w: keys [16w, 16w + 16) x all 64 queries)
//   P^T = exp(S^T - lse), dS^T = P^T * (dP^T - D)
//   dV += P^T dO, dK += dS^T Q          (A from the registers of S^T / dP^T: no shared-memory round trip)
//   dQ  = dS K                          (dS^T through shared memory; 4 x 2 warps over 64 queries x head_dim)
// dK and dV stay in registers for the CTA's life; dQ is added into fp32 dq_accum with atomics (or in a fixed
// order with deterministic=True). Q and dO are double-buffered so the next block loads under this one's GEMMs.
#pragma once

#include "sm80_building_blocks.hpp"

namespace flash4 {

using namespace cute;

template <class Element_, int kHeadDim_>
struct BwdTraitsSm80 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // queries per step; 128 at hdim 64 (FA2's tile) measured -2.5% (255 registers with a spill, twice the work
  // between barriers with all 8 warps in lockstep; docs/perf_notes.md)
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 128;  // keys per CTA
  static constexpr int kNWarps = 8;
  static constexpr int kNumThreads = kNWarps * 32;
  static constexpr int kStages = 2;  // Q / dO buffers
  // K and V as the A operands of S^T / dP^T stay in registers for the CTA's life instead of being re-read
  // from shared memory every step (ncu: the kernel is bound by shared-memory reads); measured +4-7% at hdim
  // 64. 32 registers at hdim 64; at hdim 128 it would be 64, which the 255-register budget does not have.
  static constexpr bool kKVInRegs = kHeadDim <= 64;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 128, "the sm80 backward covers head dims 32..128");

  using MmaAtom = Sm80MmaAtom<Element>;
  // Rows = keys: S^T, dP^T, dV, dK. 8 warps x 16 keys.
  using TiledMmaKey = TiledMMA<MmaAtom, Layout<Shape<_8, _1, _1>>, Tile<_128, _16, _16>>;
  // Rows = queries: dQ. 2 x 4 warps over (64 queries, head_dim), 16 head-dim columns a warp per N tile (the
  // width a transposing ldmatrix.x4 loads for B). Against 4 x 2, each warp reads 32 instead of 16 rows of dS
  // and half the columns of K^T: at hdim 128, 128 instead of 160 KB of ldmatrix a step for this GEMM (the
  // kernel is bound by shared-memory reads).
  using TiledMmadQ = TiledMMA<MmaAtom, Layout<Shape<_2, _4, _1>>, Tile<_32, _64, _16>>;

  using Tiling = Sm80SmemTiling<Element, kHeadDim, kNumThreads>;
  using SmemLayoutAtom = typename Tiling::SmemLayoutAtom;
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // one stage
  // Transposed views, read with transposing ldmatrix: Q^T and dO^T (head_dim, queries), K^T (head_dim, keys).
  using SmemLayoutQt =
      decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  // dS^T as written from the accumulators (keys, queries), 64 queries = one 128-byte swizzle atom wide, and
  // the same bytes as dS (queries, keys) for the dQ GEMM's A operand.
  using SmemLayoutdSt = decltype(tile_to_shape(
      composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}), Shape<Int<kBlockN>, Int<kBlockM>>{}));
  using SmemLayoutdS =
      decltype(composition(SmemLayoutdSt{}, make_layout(Shape<Int<kBlockM>, Int<kBlockN>>{}, GenRowMajor{})));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomdS = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  using GmemTiledCopy = typename Tiling::GmemTiledCopy;

  static constexpr int kElemsKV = cosize_v<SmemLayoutKV>;
  static constexpr int kElemsQ = cosize_v<SmemLayoutQ>;
  static constexpr int kElemsdS = cosize_v<SmemLayoutdSt>;
  // K, V, kStages x (Q, dO), dS^T, then kStages x (lse_log2, D) floats.
  static constexpr int kSmemBytes =
      int(sizeof(Element)) * (2 * kElemsKV + 2 * kStages * kElemsQ + kElemsdS) + kStages * 2 * kBlockM * 4;
};

}  // namespace flash4

// Compile-time configuration of the sm80 backward (cp.async + ldmatrix + mma.sync).
//
// One CTA of 8 warps owns kBlockN keys of one kv head and loops over the query heads of its GQA group and over
// query blocks of kBlockM rows (FlashAttention-2's algorithm, keys as the GEMM rows):
//   S^T = K Q^T, dP^T = V dO^T          (a warp: 16 keys x all kBlockM queries)
//   P^T = exp(S^T - lse), dS^T = P^T * (dP^T - D)
//   dV += P^T dO, dK += dS^T Q          (A from the registers of S^T / dP^T: no shared-memory round trip)
//   dQ  = dS K                          (dS^T through shared memory; all 8 warps over kBlockM x head_dim)
// dK and dV stay in registers for the CTA's life; dQ is added into fp32 dq_accum with atomics (or in a fixed
// order with deterministic=True). Q and dO are double-buffered so the next block loads under this one's GEMMs.
//
// Head dims <= 128: 8 warps x 16 keys = 128 keys a CTA, 64 queries a step; each warp holds dK and dV for its
// 16 keys x head_dim (128 registers at hdim 128).
// Head dims > 128 (kSplit = 2): that would be 256 registers at hdim 256, so the warps form two halves of 4
// (64 keys a CTA), each half owning head-dim columns [half * head_dim / 2, ...) of dK and dV for all 64 keys
// (128 registers at hdim 256). S^T and dP^T contract over the whole head dim and every half needs all of
// them, so both halves compute them (320 useful of 448 HMMA a step at hdim 256); only half 0 writes dS^T.
// 32 queries a step keep shared memory at 132.5 KiB at hdim 256 (A100: 164 KB a CTA).
#pragma once

#include "utils_sm80.hpp"

namespace flash4 {

using namespace cute;

// kBlockM, kBlockN, kNWarps, kStages: bwd_tile_sm80 (common/tile_size.h).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_ = 2>
struct BwdTraitsSm80 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNumThreads = kNWarps * 32;
  // Every warp computes 16 keys of S^T, so 16 * kNWarps / kBlockN warp groups ("halves") split dK / dV's
  // head-dim columns.
  static constexpr int kSplit = 16 * kNWarps / kBlockN;
  static_assert(kSplit * kBlockN == 16 * kNWarps && (kSplit == 1 || kSplit == 2), "one or two warp halves");
  static constexpr int kHeadDimKV = kHeadDim / kSplit;      // dK / dV columns a half owns
  static constexpr int kKeyThreads = kNumThreads / kSplit;  // the threads of one half
  // Q / dO buffers. Two: the next query block loads during all of this one's work. One (cards with 99 KB a
  // CTA, tile_size.h): it loads once this step's last reader of Q and dO is done (kernel_bwd_sm80.hpp).
  static constexpr int kStages = kStages_;
  static_assert(kStages == 1 || kStages == 2);
  // K and V as the A operands of S^T / dP^T stay in registers for the CTA's life instead of being re-read
  // from shared memory every step (ncu: the kernel is bound by shared-memory reads); measured +4-7% at hdim
  // 64. 32 registers at hdim 64; at hdim 128 it would be 64, which the 255-register budget does not have.
  static constexpr bool kKVInRegs = kHeadDim <= 64;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256 && kHeadDimKV % 16 == 0, "head dims 32..256");

  using MmaAtom = Sm80MmaAtom<Element>;
  // Rows = keys: S^T, dP^T, dV, dK. The warps of one half x 16 keys.
  using TiledMmaKey =
      TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps / kSplit>, _1, _1>>, Tile<Int<kBlockN>, _16, _16>>;
  // Rows = queries: dQ, all 8 warps. Above hdim 64, 2 x 4 over (kBlockM queries, head_dim), 16 head-dim
  // columns a warp per N tile (the width a transposing ldmatrix.x4 loads for B): against 4 x 2 at 64 queries,
  // each warp reads 32 instead of 16 rows of dS and half the columns of K^T, at hdim 128 128 instead of 160 KB
  // of ldmatrix a step (the kernel is bound by shared-memory reads); measured +1.5-2.5% at hdim 128. At hdim
  // 64 both read the same bytes and 2 x 4 measured 3.5-4.5% slower, so it keeps 4 x 2, as
  // does hdim 96, which is not a whole number of 64-column N tiles.
  static constexpr bool kdQ2x4 = kHeadDim > 64 && kHeadDim % 64 == 0;
  static_assert(kdQ2x4 || kBlockM == 64, "the 4 x 2 dQ layout covers 64 queries");
  using TiledMmadQ = std::conditional_t<!kdQ2x4,
                                        TiledMMA<MmaAtom, Layout<Shape<_4, _2, _1>>, Tile<_64, _32, _16>>,
                                        TiledMMA<MmaAtom, Layout<Shape<_2, _4, _1>>, Tile<_32, _64, _16>>>;

  // The swizzle atom follows a half's width: a half's column slice of Q^T / dO^T must be whole atoms (hdim
  // 192: halves of 96 columns, so 32-column atoms).
  using Tiling = Sm80SmemTiling<Element, kHeadDimKV, kNumThreads, kHeadDim>;
  static_assert(kBlockM % Tiling::kRowsPerPass == 0 && kBlockN % Tiling::kRowsPerPass == 0,
                "a global -> shared copy pass must not cover more rows than a Q or K tile");
  using SmemLayoutAtom = typename Tiling::SmemLayoutAtom;
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // one stage
  // Transposed views, read with transposing ldmatrix: Q^T and dO^T (head_dim, queries), K^T (head_dim, keys).
  using SmemLayoutQt =
      decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  // dS^T as written from the accumulators (keys, queries), one swizzle atom wide (64 queries: 128 bytes; 32:
  // 64 bytes, conflict-free with 2 swizzle bits), and the same bytes as dS (queries, keys) for the dQ GEMM's
  // A operand.
  using SmemLayoutdSt = decltype(tile_to_shape(
      composition(Swizzle<kBlockM == 64 ? 3 : 2, 3, 3>{}, Layout<Shape<_8, Int<kBlockM>>, Stride<Int<kBlockM>, _1>>{}),
      Shape<Int<kBlockN>, Int<kBlockM>>{}));
  using SmemLayoutdS =
      decltype(composition(SmemLayoutdSt{}, make_layout(Shape<Int<kBlockM>, Int<kBlockN>>{}, GenRowMajor{})));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomdS = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  using GmemTiledCopy = typename Tiling::GmemTiledCopy;

  static constexpr int kElemsKV = cosize_v<SmemLayoutKV>;
  static constexpr int kElemsQ = cosize_v<SmemLayoutQ>;
  static constexpr int kElemsdS = cosize_v<SmemLayoutdSt>;
  // With one buffer at hdim 256, K + V + Q + dO + dS^T are 100.25 KB, over the 99 KB of a consumer card: dS^T
  // takes Q's bytes instead, once the dK GEMM (dS^T Q, A from registers) has read Q^T.
  static constexpr bool kdSInQ = kStages == 1 && kHeadDim > 192;
  static_assert(!kdSInQ || kElemsdS <= kElemsQ);
  // K, V, kStages x (Q, dO), dS^T, then kStages x (lse_log2, D) floats.
  static constexpr int kSmemBytes =
      int(sizeof(Element)) * (2 * kElemsKV + 2 * kStages * kElemsQ + (kdSInQ ? 0 : kElemsdS)) +
      kStages * 2 * kBlockM * 4;
};

}  // namespace flash4

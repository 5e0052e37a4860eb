// Compile-time configuration of the sm80 forward kernel (Ampere and later: cp.async + ldmatrix + mma.sync).
//
// One CTA of kNWarps warps owns kBlockM query rows; warp w computes rows [16w, 16w + 16) of every 16 * kNWarps
// row slab, over the whole key block, so softmax rows never cross warps. Q, K and V tiles live in shared
// memory with the swizzle atom of utils_sm80.hpp.
#pragma once

#include "utils_sm80.hpp"

namespace flash4 {

using namespace cute;

// How O accumulates P V (the forward's AccumPV policy). AccumPVF32: in the fp32 accumulators, as every GEMM
// here. AccumPVF16 (float16 inputs, opt-in): each key block's P V in a fresh fp16 accumulator, added into the
// fp32 O after the block, so rounding grows over one block's keys (32-64), not the sequence. GeForce tensor
// cores run fp16-accumulate mma.sync at twice their fp32-accumulate rate; data-center ones at the same rate.
struct AccumPVF32 {};
struct AccumPVF16 {};

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdTraitsSm80 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNumThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0 && kBlockM % (16 * kNWarps) == 0);

  using TiledMma =
      TiledMMA<Sm80MmaAtom<Element>, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;
  // AccumPVF16's P V: the same warp layout and operand fragments, fp16 accumulators.
  using TiledMmaF16 = TiledMMA<MMA_Atom<SM80_16x8x16_F16F16F16F16_TN>, Layout<Shape<Int<kNWarps>, _1, _1>>,
                               Tile<Int<16 * kNWarps>, _16, _16>>;

  using Tiling = Sm80SmemTiling<Element, kHeadDim, kNumThreads>;
  using SmemLayoutAtom = typename Tiling::SmemLayoutAtom;
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V seen as (head_dim, keys): the B operand of O += P V, read with transposing ldmatrix.
  using SmemLayoutVt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  using GmemTiledCopy = typename Tiling::GmemTiledCopy;
  using GmemTiledCopyO = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{},
                                                  typename Tiling::GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));

  // K and V buffers: two of each up to hdim 128, so block n - 1 loads during all of block n's work (ncu, hdim
  // 128 at 2k with one buffer each: 7% of the loop's stall samples waited on cp.async data, 4% on the second
  // barrier a step). Hdim 256 keeps one (two would be 192 KB, over the A100's 164 KB). Hdim 96 keeps one
  // until measured: one of its variants spills with either (24 B with one buffer, 16 B with two; ptxas).
  static constexpr int kStages = kHeadDim <= 128 && kHeadDim % 64 == 0 ? 2 : 1;
  static constexpr int kElemsKV = cosize_v<SmemLayoutKV>;
  static constexpr int kSmemBytes = int(sizeof(Element)) * (cosize_v<SmemLayoutQ> + 2 * kStages * kElemsKV);
};

}  // namespace flash4

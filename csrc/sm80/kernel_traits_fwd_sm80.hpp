// Compile-time configuration of the sm80 forward kernel (Ampere and later: cp.async + ldmatrix + mma.sync).
//
// One CTA of kNWarps warps owns kBlockM query rows; warp w computes rows [16w, 16w + 16) of every 16 * kNWarps
// row slab, over the whole key block, so softmax rows never cross warps. Q, K and V tiles live in shared
// memory with an 8-row x (64 | 32)-element swizzle atom: 16-byte cp.async writes and ldmatrix reads are
// both bank-conflict free.
#pragma once

#include <cute/algorithm/copy.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

namespace flash4 {

using namespace cute;

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdTraitsSm80 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNumThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0 && kBlockM % (16 * kNWarps) == 0);

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>, MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

  // Swizzle atom: 8 rows of 64 elements (128 bytes) when the head dim allows, else 32 (64 bytes).
  static constexpr int kAtomCols = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kAtomCols == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                                              Layout<Shape<_8, Int<kAtomCols>>, Stride<Int<kAtomCols>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V seen as (head_dim, keys): the B operand of O += P V, read with transposing ldmatrix.
  using SmemLayoutVt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // Global <-> shared: 16-byte vectors, kAtomCols / 8 threads per row.
  static constexpr int kThreadsPerRow = kAtomCols / 8;
  using GmemThreadLayout = Layout<Shape<Int<kNumThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
                                                 GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));
  using GmemTiledCopyO = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{},
                                                  GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));

  static constexpr int kSmemBytes =
      int(sizeof(Element)) * (cosize_v<SmemLayoutQ> + 2 * cosize_v<SmemLayoutKV>);
};

}  // namespace flash4

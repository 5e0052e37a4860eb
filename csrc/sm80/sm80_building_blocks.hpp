// Pieces the sm80 forward and backward traits share: the mma.sync atom for the input dtype, the shared-memory
// swizzle atom, and the 16-byte cp.async tiled copy that fills it.
#pragma once

#include <cute/algorithm/copy.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

namespace flash4 {

using namespace cute;

template <class Element>
using Sm80MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                       MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>, MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;

// Swizzle atom: 8 rows of 64 elements (128 bytes) when kAtomHeadDim allows, else 32 (64 bytes); 16-byte cp.async
// writes and ldmatrix reads are both bank-conflict free. Global <-> shared copies move 16-byte vectors, 8
// threads per row when the copied rows (kCopyHeadDim wide) are whole 64-element lines, else 4. The backward at
// hdim 192 has 32-column atoms (its warp halves own 96 columns each) but copies 192-wide rows: with 4 threads a
// row its 256 threads would cover 64 rows a pass, more than its 32-row Q tile.
template <class Element, int kAtomHeadDim, int kNumThreads, int kCopyHeadDim = kAtomHeadDim>
struct Sm80SmemTiling {
  static constexpr int kAtomCols = kAtomHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kAtomCols == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                                              Layout<Shape<_8, Int<kAtomCols>>, Stride<Int<kAtomCols>, _1>>{}));
  static constexpr int kThreadsPerRow = kCopyHeadDim % 64 == 0 ? 8 : 4;
  static constexpr int kRowsPerPass = kNumThreads / kThreadsPerRow;
  using GmemThreadLayout = Layout<Shape<Int<kRowsPerPass>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
                                                 GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));
};

}  // namespace flash4

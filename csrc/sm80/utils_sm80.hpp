// Pieces the sm80 forward and backward share: the mma.sync atom for the input dtype, the shared-memory swizzle
// atom and the 16-byte cp.async tiled copy that fills it (used by the traits), and the device helpers of both
// kernels: accumulator views, predicated row copies and the register-pipelined GEMMs.
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

// mma.sync m16n8 accumulator, per thread ((2, 2), MMA_M, MMA_N) = (column pair, row + 8): as (rows, cols).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto sm80_acc_rowcol_layout(Layout acc) {
  static_assert(decltype(rank<0>(acc))::value == 2 && decltype(rank(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

// The same registers as the A operand of an m16n8k16 MMA: two neighbouring n8 accumulator tiles form one k16
// A tile, ((2, 2), M, N) -> ((2, 2, 2), M, N / 2). No data movement.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto sm80_acc_as_a_layout(Layout acc) {
  static_assert(decltype(size<2>(acc))::value % 2 == 0);
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2, 2), M, (2, N / 2))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// Rows [0, valid_rows) of a tile from global to shared memory with cp.async; the other rows are zeroed with
// plain stores (nothing past the tensor's end is read). `coord` is the copy partition of the tile's identity.
// kAllValid (the kernels' kEven): every row exists, so no predicates.
template <bool kAllValid = false, class TiledCopy, class TS, class TD, class TC>
CUTE_DEVICE void copy_rows(TiledCopy const& tiled_copy, TS const& src, TD&& dst, TC const& coord, int valid_rows) {
  if constexpr (kAllValid) {
    copy(tiled_copy, src, dst);
  } else {
#pragma unroll
    for (int m = 0; m < size<1>(dst); ++m) {
      if (get<0>(coord(0, m, 0)) < valid_rows) {
        copy(tiled_copy, src(_, m, _), dst(_, m, _));
      } else {
        clear(dst(_, m, _));
      }
    }
  }
}

// acc += A B with both operands in shared memory, loading k-slice k + 1 into registers while slice k
// multiplies.
template <class TiledMma, class TA, class TB, class TC, class SA, class SB, class CopyA, class CopyB>
CUTE_DEVICE void gemm_smem(TiledMma& mma, TA& tCrA, TB& tCrB, TC& acc, SA const& tCsA, SB const& tCsB,
                           CopyA const& copy_a, CopyB const& copy_b) {
  auto thr_a = copy_a.get_thread_slice(threadIdx.x);
  auto thr_b = copy_b.get_thread_slice(threadIdx.x);
  Tensor tCrA_view = thr_a.retile_D(tCrA);
  Tensor tCrB_view = thr_b.retile_D(tCrB);
  copy(copy_a, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
  copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
#pragma unroll
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k + 1 < size<2>(tCrA)) {
      copy(copy_a, tCsA(_, _, k + 1), tCrA_view(_, _, k + 1));
      copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
    }
    cute::gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// acc += A B with A already in registers.
template <class TiledMma, class TA, class TB, class TC, class SB, class CopyB>
CUTE_DEVICE void gemm_rs(TiledMma& mma, TA const& tCrA, TB& tCrB, TC& acc, SB const& tCsB, CopyB const& copy_b) {
  auto thr_b = copy_b.get_thread_slice(threadIdx.x);
  Tensor tCrB_view = thr_b.retile_D(tCrB);
  copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
#pragma unroll
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k + 1 < size<2>(tCrA)) copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
    cute::gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// acc (fp32) += A B with A in registers, kChunk n-atoms of acc at a time accumulated in fp16 over the whole
// K extent first and then added into acc (the forward's AccumPVF16; `mma` has fp16 accumulators and the
// thread-value layouts of the TiledMma that made the fragments). One chunk's fp16 accumulators are live at a
// time: kChunk registers instead of half of acc's (all of them spilled 12-16 B at hdim 128).
template <int kChunk, class TiledMma, class TA, class TB, class TC, class SB, class CopyB>
CUTE_DEVICE void gemm_rs_accum_f16(TiledMma& mma, TA const& tCrA, TB& tCrB, TC& acc, SB const& tCsB,
                                   CopyB const& copy_b) {
  auto thr_b = copy_b.get_thread_slice(threadIdx.x);
  Tensor tCrB_view = thr_b.retile_D(tCrB);
  constexpr int kN = decltype(size<1>(tCrB))::value, kCopyN = decltype(size<1>(tCrB_view))::value;
  static_assert(kN % kChunk == 0 && (kCopyN * kChunk) % kN == 0, "whole copies per chunk");
  constexpr int kCopyChunk = kCopyN * kChunk / kN;
  Tensor rB = logical_divide(tCrB, Shape<Underscore, Int<kChunk>, Underscore>{});         // (V, (c, C), K)
  Tensor rB_view = logical_divide(tCrB_view, Shape<Underscore, Int<kCopyChunk>, Underscore>{});
  Tensor sB = logical_divide(tCsB, Shape<Underscore, Int<kCopyChunk>, Underscore>{});
  Tensor acc_div = logical_divide(acc, Shape<Underscore, Underscore, Int<kChunk>>{});     // (V, M, (c, C))
#pragma unroll
  for (int c = 0; c < kN / kChunk; ++c) {
    Tensor acc_c = acc_div(_, _, make_coord(_, c));
    Tensor acc_h = make_fragment_like<cutlass::half_t>(acc_c);
    clear(acc_h);
#pragma unroll
    for (int k = 0; k < size<2>(tCrA); ++k) {
      copy(copy_b, sB(_, make_coord(_, c), k), rB_view(_, make_coord(_, c), k));
      cute::gemm(mma, tCrA(_, _, k), rB(_, make_coord(_, c), k), acc_h);
    }
#pragma unroll
    for (int i = 0; i < size(acc_h); ++i) acc_c(i) += float(acc_h(i));
  }
}

}  // namespace flash4

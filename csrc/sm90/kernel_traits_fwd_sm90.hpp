// Compile-time configuration of the sm90 forward kernel: tile shapes, shared-memory layouts, WGMMA
// tiled MMAs and the shared-storage struct. Everything here is derived from (Element, head dim, tile).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace flash4 {

using namespace cute;

// Largest GMMA swizzle atom whose contiguous extent (in bytes: 128, 64 or 32) divides `extent` elements.
template <class Element, int kExtent, GMMA::Major kMajor>
constexpr auto gmma_smem_atom() {
  constexpr int kBytes = kExtent * int(sizeof(Element));
  if constexpr (kMajor == GMMA::Major::K) {
    if constexpr (kBytes % 128 == 0) return GMMA::Layout_K_SW128_Atom<Element>{};
    else if constexpr (kBytes % 64 == 0) return GMMA::Layout_K_SW64_Atom<Element>{};
    else return GMMA::Layout_K_SW32_Atom<Element>{};
  } else {
    if constexpr (kBytes % 128 == 0) return GMMA::Layout_MN_SW128_Atom<Element>{};
    else if constexpr (kBytes % 64 == 0) return GMMA::Layout_MN_SW64_Atom<Element>{};
    else return GMMA::Layout_MN_SW32_Atom<Element>{};
  }
}

// Element: q, k, v; ElementOut: o (fp8 inputs write bf16). kHeadDim: q and k; kHeadDimV: v and o (smaller for
// MLA-style heads, 192 / 128: only the P V GEMM, V's tiles and the output change).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, class ElementOut_ = Element_,
          int kHeadDimV_ = kHeadDim_>
struct FwdTraitsSm90 {
  using Element = Element_;
  using ElementOut = ElementOut_;
  // fp8 (e4m3): WGMMA takes 8-bit operands K-major only, so V arrives transposed (V^T, keys contiguous, from
  // a pre-pass) and P V accumulates in two levels (MainloopFwdSm90).
  static constexpr bool kFp8 = sizeof(Element) == 1;
  // O gets its own buffer where it does not fit Q's (a wider output type).
  static constexpr bool kOwnO = sizeof(ElementOut) != sizeof(Element);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static_assert(kHeadDimV <= kHeadDim && kHeadDimV % 16 == 0, "O shares Q's buffer: v's head dim <= q's");
  static_assert(kHeadDimV == kHeadDim || !kFp8, "fp8: one head dim");
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static_assert(kBlockM % 64 == 0 && kHeadDim % 16 == 0 && kBlockN % (kFp8 ? 32 : 16) == 0);

  // One producer warpgroup (one thread of it issues every TMA) + one consumer warpgroup per 64 rows.
  // Two consumer warpgroups (128 rows), or three (192 rows) at small head dims, where a 128-row tile leaves
  // the tensor cores idle between one warpgroup's GEMMs and the next's (FwdBarrier's ping-pong goes round
  // all of them).
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  static_assert(kNumMmaWarpGroups == 2 || kNumMmaWarpGroups == 3, "ping-pong over two or three warpgroups");
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;
  // setmaxnreg budget: 128 * 24 + 256 * 240 = 64512, 128 * 32 + 384 * 160 = 65536 <= 65536 registers per SM.
  static constexpr int kProducerRegs = kNumMmaWarpGroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kNumMmaWarpGroups == 2 ? 240 : 160;

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // S = Q K^T: (M, N, K=D)
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kBlockN>>;  // O = P V:   (M, N=Dv, K=N)
  using AtomLayoutMNK = Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>;

  // S from shared Q and K (both K-major); O from P in registers and V^T in shared memory (16-bit: MN-major,
  // V rows are contiguous along head_dim, so V^T needs no transpose, only an MN-major descriptor; fp8:
  // K-major, the pre-pass's V^T).
  static constexpr GMMA::Major kMajorV = kFp8 ? GMMA::Major::K : GMMA::Major::MN;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      AtomLayoutMNK{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDimV>, Int<kBlockN>>, GMMA::Major::K,
                           kMajorV>(),
      AtomLayoutMNK{}));

  using SmemLayoutQ =
      decltype(tile_to_shape(gmma_smem_atom<Element, kHeadDim, GMMA::Major::K>(),
                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // O aliases Q's buffer (unless kOwnO): a consumer warpgroup writes O rows only over its own Q rows, after
  // its own last Q K^T has completed, so the two warpgroups never race on these bytes.
  using SmemLayoutO = decltype(tile_to_shape(gmma_smem_atom<ElementOut, kHeadDimV, GMMA::Major::K>(),
                                             Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  using SmemLayoutK = decltype(tile_to_shape(gmma_smem_atom<Element, kHeadDim, GMMA::Major::K>(),
                                             Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // Atoms ordered along N first (Step<_2, _1, _3>): for each 64-wide head-dim slab all kBlockN key rows
  // are contiguous, so one TMA box covers (64, kBlockN) instead of (64, 8): 2 copies per V tile at
  // hdim 128 instead of 32.
  // fp8: K-major V^T tiles, (head_dim, kBlockN) with the keys contiguous.
  using SmemLayoutVtMN = decltype(tile_to_shape(gmma_smem_atom<Element, kHeadDimV, GMMA::Major::MN>(),
                                                Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{},
                                                Step<_2, _1, _3>{}));
  using SmemLayoutVtK = decltype(tile_to_shape(gmma_smem_atom<Element, kBlockN, GMMA::Major::K>(),
                                               Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{}));
  using SmemLayoutVt = std::conditional_t<kFp8, SmemLayoutVtK, SmemLayoutVtMN>;

  using PipelineK = cutlass::PipelineTmaAsync<kStages>;
  using PipelineV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineK::PipelineState;

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesV = kBlockN * kHeadDimV * sizeof(Element);

  struct SharedStorageShared {
    // 1024-byte alignment: the period of the 128-byte swizzle pattern, required by TMA and WGMMA.
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutVt>> v;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;
    typename PipelineK::SharedStorage pipeline_k;
    typename PipelineV::SharedStorage pipeline_v;
  };
  struct SharedStorageOwnO : SharedStorageShared {
    alignas(1024) cute::array_aligned<ElementOut, cosize_v<SmemLayoutO>> o;
  };
  using SharedStorage = std::conditional_t<kOwnO, SharedStorageOwnO, SharedStorageShared>;
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

}  // namespace flash4

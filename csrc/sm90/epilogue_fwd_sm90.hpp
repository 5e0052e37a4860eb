// sm90 forward epilogue: O (fp32 registers) -> 16-bit -> shared memory (stmatrix) -> TMA store, and the
// per-row LSE straight from registers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/block_info.hpp"
#include "../common/fragment.hpp"
#include "../params.h"
#include "utils_sm90.hpp"

namespace flash4 {

using namespace cute;

template <class Traits>
struct EpilogueFwdSm90 {
  using Element = typename Traits::ElementOut;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDimV = Traits::kHeadDimV;  // v's and o's
  using TileO = Shape<Int<kBlockM>, Int<kHeadDimV>>;
  using ShapeT = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen_q, head_dim, heads, batch)
  using StrideT = Stride<int64_t, _1, int64_t, int64_t>;
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{},
                                      make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeT{}, StrideT{}),
                                      typename Traits::SmemLayoutO{}, TileO{}, _1{}));

  struct Params {
    TmaO tma_o;
    ShapeT shape_o;
    Element* o;
    int64_t o_row_stride, o_head_stride;
    float* lse;
    int64_t lse_batch_stride, lse_head_stride;
    bool packed;
  };

  static Params to_params(FwdParams const& p) {
    const bool packed = p.cu_seqlens_q != nullptr;
    ShapeT shape_o = make_shape(packed ? p.total_q : p.seqlen_q, int(kHeadDimV), p.nheads_q, packed ? 1 : p.batch);
    Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(p.o)), shape_o,
                            make_stride(p.o_row_stride, _1{}, p.o_head_stride, p.o_batch_stride));
    return {make_tma_copy(SM90_TMA_STORE{}, mO, typename Traits::SmemLayoutO{}, TileO{}, _1{}),
            shape_o,
            static_cast<Element*>(p.o),
            p.o_row_stride,
            p.o_head_stride,
            p.lse,
            p.lse_batch_stride,
            p.lse_head_stride,
            packed};
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_o.get_tma_descriptor());
  }

  // Called by all consumer threads (thread_idx 0..255) with their normalized O fragment and row LSEs.
  // kAsync (persistent kernels): O goes through its own buffer, smem.o, and the TMA store is left running; the
  // next call waits for it before it writes the buffer again, and the kernel's last one before it exits.
  template <bool kAsync = false, class SharedStorage, class FragO, class LSE>
  CUTE_DEVICE void store(Params const& params, SharedStorage& smem, FragO const& tOrO, LSE const& lse,
                         int thread_idx, int m_block, int bidh, SeqInfo const& seq) const {
    typename Traits::TiledMmaPV tiled_mma_pv;
    // Otherwise O reuses Q's buffer (unless the traits give it its own: a wider output than input); each
    // warpgroup overwrites only its own 64 rows of Q, which its own last Q K^T (already complete) was the final
    // reader of.
    Element* o_buffer;
    if constexpr (kAsync || Traits::kOwnO) {
      o_buffer = smem.o.data();
    } else {
      o_buffer = reinterpret_cast<Element*>(smem.q.data());
    }
    Tensor sO = make_tensor(make_smem_ptr(o_buffer), typename Traits::SmemLayoutO{});

    // LSE: the four lanes that share a row hold the same value; the one holding column 0 writes it.
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor tOcO = thr_mma_pv.partition_C(make_identity_tensor(TileO{}));
    Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol_layout(tOcO.layout()));
    if (get<1>(tOcO_rc(_0{}, _0{})) == 0) {
      float* lse_row =
          params.lse + seq.batch * params.lse_batch_stride + bidh * params.lse_head_stride + seq.offset_q;
#pragma unroll
      for (int r = 0; r < size<0>(tOcO_rc); ++r) {
        const int row = m_block * kBlockM + get<0>(tOcO_rc(r, _0{}));
        if (row < seq.seqlen_q) lse_row[row] = lse[r];
      }
    }

    // A packed sequence's last, partial tile: the TMA store would clip only at the end of the packed tensor
    // and overwrite the next sequence's rows, so each thread stores its own rows (pairs of adjacent columns).
    if (params.packed && (m_block + 1) * kBlockM > seq.seqlen_q) {
      Element* o = params.o + (int64_t(seq.offset_q) + m_block * kBlockM) * params.o_row_stride +
                   bidh * params.o_head_stride;
      store_pairs(tOrO, tOcO, o, params.o_row_stride, seq.seqlen_q - m_block * kBlockM, 1.f);
      return;
    }

    Tensor tOrO_out = make_tensor<Element>(tOrO.layout());
    convert_fragment(tOrO, tOrO_out);
    if constexpr (kAsync) {  // the previous tile's O may still be leaving this buffer
      if (thread_idx == 0) tma_store_wait<0>();
      named_barrier_sync(Traits::kNumMmaThreads, int(FwdBarrier::kEpilogue));
    }
    auto smem_tiled_copy_O = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_pv);
    auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(thread_idx);
    copy(smem_tiled_copy_O, smem_thr_copy_O.retile_S(tOrO_out), smem_thr_copy_O.partition_D(sO));

    // Generic-proxy writes (stmatrix) must be made visible to the async proxy (TMA) before the store.
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(Traits::kNumMmaThreads, int(FwdBarrier::kEpilogue));
    if (thread_idx == 0) {
      Tensor mO = domain_offset(make_coord(seq.offset_q, _0{}),
                                params.tma_o.get_tma_tensor(params.shape_o)(_, _, bidh, seq.batch));
      Tensor gO = local_tile(mO, TileO{}, make_coord(m_block, _0{}));
      auto [tOgO, tOsO] = tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
      copy(params.tma_o, tOsO, tOgO);  // rows past seqlen_q are clipped by the TMA unit
      tma_store_arrive();
      // Shared memory must stay valid until the TMA engine has read it.
      if constexpr (!kAsync) tma_store_wait<0>();
    }
  }
};

}  // namespace flash4

// sm80 forward kernel: one CTA per (kBlockM query rows, query head, batch), looping over key blocks from the
// last one down (the causal diagonal blocks, the only masked ones, come first).
//
// Two K / V buffers (Traits::kStages = 2, hdim <= 128), per key block n with K[n] and V[n] issued a block
// earlier:
//   wait for K[n], V[n]; start K[n-1], V[n-1] into the other buffers;  S = Q K[n]^T (ldmatrix + mma.sync);
//   mask (boundary blocks);  online softmax, rescale O;  O += P V[n] (P from registers)
// so each load has a whole block's work to land under, with one barrier a block. One buffer each (hdim > 128):
//   wait for K[n]; start V[n];  S = Q K[n]^T;  mask;  wait for V[n]; start K[n-1];  softmax;  O += P V[n]
// so each load overlaps the other GEMM. Rows past seqlen_q and keys past seqlen_k are zero-filled in shared
// memory (never read from global memory) and masked. The epilogue stages O through Q's shared memory for
// 16-byte stores and writes the natural-log LSE.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include <climits>

#include "../common/block_info.hpp"
#include "../common/block_sparse.hpp"
#include "../common/mask.hpp"
#include "../common/softmax.hpp"
#include "../common/tile_order.hpp"
#include "../params.h"
#include "kernel_traits_fwd_sm80.hpp"

namespace flash4 {

using namespace cute;

// kLocal: sliding window (see BlockMask); kSoftcap: scores capped as softcap * tanh(s * scale / softcap), a
// compile-time switch as in the sm90 forward (the launcher picks the instantiation at run time).
// kEven: seqlen_q and seqlen_k are multiples of the tile and the batch is not packed, so the loads carry no
// row predicates and, without causal/window, the loop no mask code: 1069 -> 897 instructions a step at hdim 64
// (the predicates' address and zero-fill code was live in every step).
// Iter: the block iterator (common/block_sparse.hpp): the loop walks virtual blocks v and loads key block
// walk.block(v): the band itself (DenseBand) or a block mask's lists (SparseList, partial blocks first).
// AccumPV: AccumPVF32 or AccumPVF16 (kernel_traits_fwd_sm80.hpp; float16 inputs only).
template <class Traits_, bool kCausal, bool kLocal = false, bool kSoftcap = false, bool kEven = false,
          class Iter = DenseBand, class AccumPV = AccumPVF32>
struct FwdKernelSm80 {
  using Traits = Traits_;
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNumThreads = Traits::kNumThreads;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kSmemBytes = Traits::kSmemBytes;
  using Params = FwdParams;  // plain pointers and strides: no descriptors to build on the host
  static constexpr bool kSparse = kIsSparse<Iter>;
  using Walk = std::conditional_t<kSparse, SparseWalk<kBlockN>, DenseWalk>;

  static Params to_params(FwdParams const& p) { return p; }
  static dim3 grid(FwdParams const& p) {
    return dim3((p.seqlen_q + kBlockM - 1) / kBlockM, p.nheads_q, p.batch);
  }

  // A tile no row of which sees a key (causal with seqlen_q > seqlen_k, or a window that misses every key):
  // out = 0, lse = empty_lse (-inf, or the head's sink).
  CUTE_DEVICE void write_empty(Params const& p, Element* o, float* lse, int m_block, int seqlen_q,
                               float empty_lse) const {
    constexpr int kVecs = kHeadDim / 8;  // 16-byte vectors per row
    for (int i = threadIdx.x; i < kBlockM * kVecs; i += kNumThreads) {
      const int row = m_block * kBlockM + i / kVecs;
      if (row < seqlen_q) {
        *reinterpret_cast<cute::uint128_t*>(o + row * p.o_row_stride + (i % kVecs) * 8) = cute::uint128_t{0, 0};
      }
    }
    for (int i = threadIdx.x; i < kBlockM; i += kNumThreads) {
      const int row = m_block * kBlockM + i;
      if (row < seqlen_q) lse[row] = empty_lse;
    }
  }

  CUTE_DEVICE void operator()(Params const& p, char* smem_buf) const {
    // Causal and windows: heavy tiles first, heads in groups (tile_order.hpp).
    constexpr bool kMasked = kCausal || kLocal;
    const TileCoord tile = this_tile<kHeadDim, kMasked>();
    const int m_block = kMasked ? int(gridDim.x) - 1 - tile.block : tile.block;
    const int bidh = tile.head, bidb = tile.batch;
    const int bidh_kv = bidh / (p.nheads_q / p.nheads_kv);
    const int tid = threadIdx.x;
    // Packed batches: the grid covers the longest sequence; tiles past this one's end have nothing to do.
    const SeqInfo seq = make_seq_info(p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, bidb, p.seqlen_q,
                                      p.seqlen_k, p.total_q, p.total_k);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    if (m_block * kBlockM >= seqlen_q) return;

    Element* o = static_cast<Element*>(p.o) + seq.batch * p.o_batch_stride + bidh * p.o_head_stride +
                 int64_t(seq.offset_q) * p.o_row_stride;
    float* lse = p.lse + seq.batch * p.lse_batch_stride + bidh * p.lse_head_stride + seq.offset_q;
    const BlockMask<kBlockM, kBlockN, kCausal, kLocal> bm(seqlen_q, seqlen_k, p.window_left, p.window_right);
    // Virtual blocks [n_min, n_max) (the band's are the key blocks themselves).
    const Walk walk = [&] {
      if constexpr (kSparse) {
        return Walk(p.block_sparse, bidb, bidh, m_block, seqlen_k);
      } else {
        return Walk{};
      }
    }();
    int n_min = 0, n_max = 0;
    if constexpr (kSparse) {
      n_max = walk.count();
    } else {
      n_min = bm.n_block_min(m_block), n_max = bm.n_block_max(m_block);
    }
    if (n_max <= n_min) {
      write_empty(p, o, lse, m_block, seqlen_q, p.sinks != nullptr ? p.sinks[bidh] : -INFINITY);
      return;
    }

    auto gtensor = [&](const void* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride, int offset,
                       int rows) {
      auto ptr = static_cast<Element const*>(base) + seq.batch * batch_stride + head_stride + offset * row_stride;
      return make_tensor(make_gmem_ptr(ptr), make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
    };
    Tensor mQ = gtensor(p.q, p.q_batch_stride, bidh * p.q_head_stride, p.q_row_stride, seq.offset_q, seqlen_q);
    Tensor mK = gtensor(p.k, p.k_batch_stride, bidh_kv * p.k_head_stride, p.k_row_stride, seq.offset_k, seqlen_k);
    Tensor mV = gtensor(p.v, p.v_batch_stride, bidh_kv * p.v_head_stride, p.v_row_stride, seq.offset_k, seqlen_k);
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, D, n)
    Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));

    Element* smem = reinterpret_cast<Element*>(smem_buf);
    Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});  // buffer 0 of kStages
    Tensor sV = make_tensor(sK.data() + kStages * Traits::kElemsKV, typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});

    typename Traits::GmemTiledCopy gmem_copy;
    auto gthr = gmem_copy.get_thread_slice(tid);
    Tensor tQgQ = gthr.partition_S(gQ);
    Tensor tQsQ = gthr.partition_D(sQ);
    Tensor tKgK = gthr.partition_S(gK);  // (CPY, CPY_N, CPY_K, n)
    Tensor tKsK = gthr.partition_D(sK);
    Tensor tVgV = gthr.partition_S(gV);
    Tensor tVsV = gthr.partition_D(sV);
    Tensor tQcQ = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tKVcKV = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

    // Buffer s of K (V) is kElemsKV elements past buffer 0: a whole number of swizzle periods, so the
    // partitioned views of buffer 0 shifted by that offset address buffer s.
    auto in_stage = [](auto const& t, int s) {
      return make_tensor(t.data() + (kStages == 2 ? s : 0) * Traits::kElemsKV, t.layout());
    };
    int v = n_max - 1;  // the virtual block; n = walk.block(v) the key block
    int n = walk.block(p.block_sparse, v);
    copy_rows<kEven>(gmem_copy, tQgQ, tQsQ, tQcQ, seqlen_q - m_block * kBlockM);
    copy_rows<kEven>(gmem_copy, tKgK(_, _, _, n), tKsK, tKVcKV, seqlen_k - n * kBlockN);
    if constexpr (kStages == 2) copy_rows<kEven>(gmem_copy, tVgV(_, _, _, n), tVsV, tKVcKV, seqlen_k - n * kBlockN);
    cp_async_fence();

    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tid);
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
    Tensor tSrK = thr_mma.partition_fragment_B(sK);
    Tensor tOrVt = thr_mma.partition_fragment_B(sVt);
    Tensor tOrO = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(tOrO);
    auto copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, tiled_mma);
    Tensor tSsQ = copy_q.get_thread_slice(tid).partition_S(sQ);
    Tensor tSsK = copy_k.get_thread_slice(tid).partition_S(sK);
    Tensor tOsVt = copy_v.get_thread_slice(tid).partition_S(sVt);

    using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;
    Tensor tScS = thr_mma.partition_C(make_identity_tensor(TileS{}));
    Tensor tScS_rc = make_tensor(tScS.data(), sm80_acc_rowcol_layout(tScS.layout()));
    Tensor tOrO_rc = make_tensor(tOrO.data(), sm80_acc_rowcol_layout(tOrO.layout()));
    constexpr int kRows = decltype(size<0>(tOrO_rc))::value;
    // Softcap: the exponent is tanh(s * scale / cap) * cap * log2(e) (params.h, SeqMaskParams).
    OnlineSoftmax<kRows> softmax(p.score_scale_log2());
    const float softcap_scale = p.softcap_scale();

    // Key blocks from mask_from on may hold keys past seqlen_k or right of some row's diagonal; with a
    // window, blocks below mask_below may hold keys left of some row's window. A block mask's full blocks
    // take only the key end: the last key block, from key_mask_from on.
    const int key_mask_from = seqlen_k % kBlockN == 0 ? INT_MAX : (seqlen_k - 1) / kBlockN;
    int mask_from = kSparse ? key_mask_from : seqlen_k % kBlockN == 0 ? n_max : n_max - 1;
    if constexpr (kCausal || kLocal) {
      mask_from = cute::min(mask_from, bm.n_block_right_mask_min(m_block));
    }
    const int mask_below = bm.n_block_left_mask_max(m_block);

#pragma unroll 1
    for (bool first = true, stage = false; v >= n_min; --v, first = false, stage = !stage) {
      n = walk.block(p.block_sparse, v);
      Tensor tSrS = partition_fragment_C(tiled_mma, TileS{});
      clear(tSrS);
      cp_async_wait<0>();
      // Two buffers: K[n], V[n] (and Q) visible to all, every warp done with the other buffers. One: K[n] (and
      // Q) visible to all, every warp done with V[n + 1].
      __syncthreads();
      if constexpr (kStages == 2) {
        if (v > n_min) {
          const int next = walk.block(p.block_sparse, v - 1);
          const int rows = seqlen_k - next * kBlockN;
          copy_rows<kEven>(gmem_copy, tKgK(_, _, _, next), in_stage(tKsK, !stage), tKVcKV, rows);
          copy_rows<kEven>(gmem_copy, tVgV(_, _, _, next), in_stage(tVsV, !stage), tKVcKV, rows);
          cp_async_fence();
        }
      } else {
        copy_rows<kEven>(gmem_copy, tVgV(_, _, _, n), tVsV, tKVcKV, seqlen_k - n * kBlockN);
        cp_async_fence();
      }

      gemm_smem(tiled_mma, tSrQ, tSrK, tSrS, tSsQ, in_stage(tSsK, stage), copy_q, copy_k);
      if constexpr (kSoftcap) apply_softcap(tSrS, softcap_scale);
      Tensor tSrS_rc = make_tensor(tSrS.data(), sm80_acc_rowcol_layout(tSrS.layout()));
      // A block mask's partial blocks take the element mask where the band would, its full ones only the key
      // end (step_block_mask).
      const bool partial = walk.is_partial(v);
      const bool need_mask =
          kSparse ? (!kEven && n >= key_mask_from) ||
                        ((kCausal || kLocal) && partial && (n >= mask_from || (kLocal && n < mask_below)))
                  : (!kEven || kCausal || kLocal) && (n >= mask_from || (kLocal && n < mask_below));
      if (need_mask) {
        // pmevent (a performance-monitor trigger, no effect on the results) keeps this a branch: without it
        // ptxas if-converted the ~150-instruction mask into predicated code that every step issued (ncu,
        // hdim 64 causal: 793 warp instructions a step against the non-causal kernel's 634). An empty asm or
        // a warp vote did not stop it; ptxas does not predicate across this instruction.
        asm volatile("pmevent 0;");
        apply_mask(tSrS_rc, tScS_rc, m_block * kBlockM, n * kBlockN, kSparse ? step_block_mask(bm, partial) : bm);
      }

      if constexpr (kStages == 1) {
        cp_async_wait<0>();
        __syncthreads();  // V[n] visible to all; every warp is done with K[n]
        if (v > n_min) {
          const int next = walk.block(p.block_sparse, v - 1);
          copy_rows<kEven>(gmem_copy, tKgK(_, _, _, next), tKsK, tKVcKV, seqlen_k - next * kBlockN);
          cp_async_fence();
        }
      }

      if (first) {
        softmax.template update<true>(tSrS_rc);
      } else {
        // Rescaling O is kRows x head_dim / 4 multiplies a step (128 at hdim 128, a quarter of the loop's
        // instructions); once the running maxima settle, skipping it leaves the result unchanged
        // (OnlineSoftmax::update_lazy). pmevent keeps the skip a branch instead of predicated multiplies
        // (see the mask above).
        cute::array<float, kRows> o_scale;
        if (softmax.update_lazy(tSrS_rc, o_scale)) {
          asm volatile("pmevent 0;");
          softmax.rescale(tOrO_rc, o_scale);
        }
      }
      Tensor tOrP = make_tensor_like<Element>(tSrS);
      cutlass::NumericArrayConverter<Element, float, decltype(size(tSrS))::value> convert;
      *reinterpret_cast<cutlass::Array<Element, decltype(size(tSrS))::value>*>(tOrP.data()) =
          convert(*reinterpret_cast<cutlass::Array<float, decltype(size(tSrS))::value> const*>(tSrS.data()));
      Tensor tOrP_a = make_tensor(tOrP.data(), sm80_acc_as_a_layout(tOrP.layout()));
      if constexpr (std::is_same_v<AccumPV, AccumPVF16>) {
        static_assert(std::is_same_v<Element, cutlass::half_t>, "fp16 accumulation takes float16 inputs");
        // The same thread-value layouts as tiled_mma (operands and accumulators), so its fragments serve.
        // 16 columns of O (2 n-atoms) at a time: 4 spilled 8 B on sm_120 (hdim 128, non-causal).
        typename Traits::TiledMmaF16 mma_f16;
        gemm_rs_accum_f16<2>(mma_f16, tOrP_a, tOrVt, tOrO, in_stage(tOsVt, stage), copy_v);
      } else {
        gemm_rs(tiled_mma, tOrP_a, tOrVt, tOrO, in_stage(tOsVt, stage), copy_v);
      }
    }

    // Epilogue: normalize, O -> shared memory (Q's buffer; every warp is past its last read of Q) ->
    // global with 16-byte stores, rows past seqlen_q skipped; LSE from the lanes that own column 0.
    cute::array<float, kRows> row_lse;
    const auto inv = softmax.finalize(p.lse_scale(), row_lse);
    softmax.rescale(tOrO_rc, inv);
    if (p.sinks != nullptr) apply_sink(tOrO_rc, row_lse, p.sinks[bidh]);  // FwdParams::sinks
    Tensor tOrO_out = make_tensor_like<Element>(tOrO);
    cutlass::NumericArrayConverter<Element, float, decltype(size(tOrO))::value> convert_o;
    *reinterpret_cast<cutlass::Array<Element, decltype(size(tOrO))::value>*>(tOrO_out.data()) =
        convert_o(*reinterpret_cast<cutlass::Array<float, decltype(size(tOrO))::value> const*>(tOrO.data()));
    __syncthreads();
    auto copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
    auto thr_copy_o = copy_o.get_thread_slice(tid);
    copy(copy_o, thr_copy_o.retile_S(tOrO_out), thr_copy_o.partition_D(sQ));

    Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tOcO_rc = make_tensor(tOcO.data(), sm80_acc_rowcol_layout(tOcO.layout()));
    if (get<1>(tOcO_rc(0, 0)) == 0) {  // one lane of each row's group of four
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = m_block * kBlockM + get<0>(tOcO_rc(r, 0));
        if (row < seqlen_q) lse[row] = row_lse[r];
      }
    }
    __syncthreads();
    Tensor mO = make_tensor(make_gmem_ptr(o), make_shape(seqlen_q, Int<kHeadDim>{}), make_stride(p.o_row_stride, _1{}));
    Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));
    typename Traits::GmemTiledCopyO gmem_copy_o;
    auto gthr_o = gmem_copy_o.get_thread_slice(tid);
    Tensor tOsO = gthr_o.partition_S(sQ);
    Tensor tOgO = gthr_o.partition_D(gO);
    Tensor tOcO_g = gthr_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
#pragma unroll
    for (int m = 0; m < size<1>(tOgO); ++m) {
      if (m_block * kBlockM + get<0>(tOcO_g(0, m, 0)) < seqlen_q) copy(gmem_copy_o, tOsO(_, m, _), tOgO(_, m, _));
    }
  }
};

}  // namespace flash4

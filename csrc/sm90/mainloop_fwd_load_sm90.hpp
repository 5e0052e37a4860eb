// sm90 forward mainloop, producer half and per-tile setup: the kernel's parameters (the TMA descriptors of Q, K
// and V^T), the helpers a CTA asks for each (sequence, head) tile (score modifier, fp8 descales, key walk), the
// K / V pipelines and the producer's loads. MainloopFwdSm90 (mainloop_fwd_sm90.hpp) adds the consumer half.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../common/block_info.hpp"
#include "../common/block_sparse.hpp"
#include "../common/dropout.hpp"
#include "../common/score_bias.hpp"
#include "../params.h"
#include "utils_sm90.hpp"

namespace flash4 {

using namespace cute;

// Iter: the block iterator (common/block_sparse.hpp); Bias: the score modifier (NoBias, Alibi, Dropout).
template <class Traits, class Iter, class Bias>
struct MainloopFwdLoadSm90 {
  using Element = typename Traits::Element;
  static constexpr bool kFp8 = Traits::kFp8;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileK = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileVt = Shape<Int<kHeadDimV>, Int<kBlockN>>;
  static constexpr bool kSparse = kIsSparse<Iter>;
  using Walk = std::conditional_t<kSparse, SparseWalk<kBlockN>, DenseWalk>;

  // Global tensors as (seqlen, head_dim, heads, batch); V is also viewed transposed as
  // (head_dim, seqlen, heads, batch) so its TMA box lands in the MN-major layout the PV GEMM reads (fp8: V^T
  // itself, keys contiguous, from the pre-pass).
  using ShapeT = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideT = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideVt = std::conditional_t<kFp8, StrideT, Stride<_1, int64_t, int64_t, int64_t>>;

  template <class Stride, class SmemLayout, class Tile>
  using TmaLoad = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                         make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                     ShapeT{}, Stride{}),
                                         SmemLayout{}, Tile{}, _1{}));
  using TmaQ = TmaLoad<StrideT, typename Traits::SmemLayoutQ, TileQ>;
  using TmaK = TmaLoad<StrideT, decltype(take<0, 2>(typename Traits::SmemLayoutK{})), TileK>;
  using TmaV = TmaLoad<StrideVt, decltype(take<0, 2>(typename Traits::SmemLayoutVt{})), TileVt>;

  struct Params {
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
    ShapeT shape_q, shape_k, shape_vt;
    int seqlen_q, seqlen_k;  // the longest sequence's, for packed batches
    int head_ratio;          // nheads_q / nheads_kv
    // See SeqMaskParams::score_scale_log2 (params.h).
    float scale_log2;
    float softcap_scale;
    int window_left, window_right;
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    const int* seqused_q;
    const int* seqused_k;
    BlockSparseParams block_sparse;
    const float* q_descale;  // fp8: (batch, nheads_kv) each
    const float* k_descale;
    const float* v_descale;
    int nheads_kv;
    const float* alibi_slopes;  // Alibi only (see SeqMaskParams)
    int64_t alibi_batch_stride;
    float bias_units;  // score units per logit: 1 / softmax_scale
    DropoutParams dropout;  // Dropout only
  };

  static Params to_params(FwdParams const& p) {
    auto ptr = [](const void* x) { return make_gmem_ptr(static_cast<Element const*>(x)); };
    // Packed batches: one batch of all rows; each CTA offsets its coordinates to its sequence's rows.
    const bool packed = p.cu_seqlens_q != nullptr;
    const int rows_q = packed ? p.total_q : p.seqlen_q, rows_k = packed ? p.total_k : p.seqlen_k;
    const int batch = packed ? 1 : p.batch;
    ShapeT shape_q = make_shape(rows_q, p.head_dim, p.nheads_q, batch);
    ShapeT shape_k = make_shape(rows_k, p.head_dim, p.nheads_kv, batch);
    ShapeT shape_vt = make_shape(int(kHeadDimV), rows_k, p.nheads_kv, batch);  // the binding matched v to it
    Tensor mQ = make_tensor(ptr(p.q), shape_q, make_stride(p.q_row_stride, _1{}, p.q_head_stride, p.q_batch_stride));
    Tensor mK = make_tensor(ptr(p.k), shape_k, make_stride(p.k_row_stride, _1{}, p.k_head_stride, p.k_batch_stride));
    Tensor mVt = [&] {
      if constexpr (kFp8) {
        // V^T's keys run to a multiple of 32 (the permutation's period): a key below seqlen_k may sit there.
        shape_vt = make_shape(p.head_dim, (rows_k + 31) / 32 * 32, p.nheads_kv, batch);
        return make_tensor(ptr(p.v), shape_vt, make_stride(p.v_row_stride, _1{}, p.v_head_stride, p.v_batch_stride));
      } else {
        return make_tensor(ptr(p.v), shape_vt, make_stride(_1{}, p.v_row_stride, p.v_head_stride, p.v_batch_stride));
      }
    }();
    return {make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Traits::SmemLayoutQ{}, TileQ{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Traits::SmemLayoutK{}), TileK{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename Traits::SmemLayoutVt{}), TileVt{}, _1{}),
            shape_q,
            shape_k,
            shape_vt,
            p.seqlen_q,
            p.seqlen_k,
            p.nheads_q / p.nheads_kv,
            p.score_scale_log2(),
            p.softcap_scale(),
            p.window_left,
            p.window_right,
            p.cu_seqlens_q,
            p.cu_seqlens_k,
            p.seqused_q,
            p.seqused_k,
            p.block_sparse,
            p.q_descale,
            p.k_descale,
            p.v_descale,
            p.nheads_kv,
            p.alibi_slopes,
            p.alibi_batch_stride,
            1.f / p.softmax_scale,
            p.dropout};
  }

  // The score modifier of a (sequence bidb, head) tile.
  CUTE_DEVICE static Bias bias(Params const& params, SeqInfo const& seq, int bidb, int bidh) {
    if constexpr (Bias::kEnabled) {
      return Bias::make(params.alibi_slopes, params.alibi_batch_stride, bidb, bidh, seq.seqlen_k - seq.seqlen_q,
                        params.bias_units);
    } else if constexpr (Bias::kDrops) {
      return Bias::make(params.dropout, bidb, get<2>(params.shape_q), bidh);
    } else {
      return Bias{};
    }
  }

  // fp8: what the raw scores and the output are multiplied by (q_descale * k_descale, v_descale) for the
  // (batch, head) of a tile; 1 otherwise.
  CUTE_DEVICE static float score_descale(Params const& params, int bidb, int bidh) {
    if constexpr (kFp8) {
      const int i = bidb * params.nheads_kv + bidh / params.head_ratio;
      return params.q_descale[i] * params.k_descale[i];
    } else {
      return 1.f;
    }
  }
  CUTE_DEVICE static float out_descale(Params const& params, int bidb, int bidh) {
    if constexpr (kFp8) {
      return params.v_descale[bidb * params.nheads_kv + bidh / params.head_ratio];
    } else {
      return 1.f;
    }
  }

  CUTE_DEVICE static SeqInfo seq_info(Params const& params, int bidb) {
    return make_seq_info(params.cu_seqlens_q, params.cu_seqlens_k, params.seqused_q, params.seqused_k, bidb,
                         params.seqlen_q, params.seqlen_k, get<0>(params.shape_q), get<0>(params.shape_k));
  }
  // The tile's walk over key blocks; the mainloop visits virtual blocks [0, walk_count) from the top down
  // (the dense band's are the blocks themselves, [n_block_min, n_block_max)).
  CUTE_DEVICE static Walk walk(Params const& params, SeqInfo const& seq, int bidb, int bidh, int m_block) {
    if constexpr (kSparse) {
      return Walk(params.block_sparse, bidb, bidh, m_block, seq.seqlen_k);
    } else {
      return Walk{};
    }
  }

  // The K and V pipelines of a CTA, thread 0 of the producer warpgroup their producer, one release per
  // consumer warpgroup (see `release` in mma). The constructors initialize the barriers (warp 0) and fence the
  // initialization; the caller's __syncthreads follows.
  template <class SharedStorage>
  CUTE_DEVICE static auto make_pipelines(SharedStorage& smem, int warp_group) {
    const auto params_k =
        tma_pipeline_params<typename Traits::PipelineK>(Traits::kTmaBytesK, warp_group, Traits::kNumMmaWarpGroups);
    const auto params_v =
        tma_pipeline_params<typename Traits::PipelineV>(Traits::kTmaBytesV, warp_group, Traits::kNumMmaWarpGroups);
    return cute::make_tuple(typename Traits::PipelineK(smem.pipeline_k, params_k, Shape<_1, _1, _1>{}),
                            typename Traits::PipelineV(smem.pipeline_v, params_v, Shape<_1, _1, _1>{}));
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }

  // TMA views of one (query tile, head) and its sequence: (Q tile, K blocks, V^T blocks) in global memory
  // against their shared-memory stages.
  template <class SharedStorage>
  CUTE_DEVICE static auto tma_views(Params const& params, SharedStorage& smem, int m_block, int bidh,
                                    SeqInfo const& seq) {
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    const int bidh_kv = bidh / params.head_ratio;
    Tensor mQ = domain_offset(make_coord(seq.offset_q, _0{}),
                              params.tma_q.get_tma_tensor(params.shape_q)(_, _, bidh, seq.batch));
    Tensor mK = domain_offset(make_coord(seq.offset_k, _0{}),
                              params.tma_k.get_tma_tensor(params.shape_k)(_, _, bidh_kv, seq.batch));
    Tensor mVt = domain_offset(make_coord(_0{}, seq.offset_k),
                               params.tma_v.get_tma_tensor(params.shape_vt)(_, _, bidh_kv, seq.batch));
    Tensor gQ = local_tile(mQ, TileQ{}, make_coord(m_block, _0{}));  // (M, D)
    Tensor gK = local_tile(mK, TileK{}, make_coord(_, _0{}));        // (N, D, n)
    Tensor gVt = local_tile(mVt, TileVt{}, make_coord(_0{}, _));     // (D, N, n)
    auto tQ = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto tK = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto tV = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sVt), group_modes<0, 2>(gVt));
    return cute::make_tuple(tQ, tK, tV);
  }

  // Into L2: the Q tile and the first K / V block (n_block) of a tile another CTA will start soon.
  template <class SharedStorage>
  CUTE_DEVICE void prefetch(Params const& params, SharedStorage& smem, int m_block, int bidh, SeqInfo const& seq,
                            int n_block) const {
    auto [tQ, tK, tV] = tma_views(params, smem, m_block, bidh, seq);
    cute::prefetch(params.tma_q, get<0>(tQ));
    cute::prefetch(params.tma_k, get<0>(tK)(_, n_block));
    cute::prefetch(params.tma_v, get<0>(tV)(_, n_block));
  }

  // Producer: one thread issues every load. K of block n and V of block n go to the same stage index of
  // their own pipelines; K runs one block ahead of V because the consumers need K[n] before V[n+1].
  // `state` is the K / V pipelines' producer state, left at the next tile's first stage (a persistent CTA
  // carries it from tile to tile); before_q() runs before Q is loaded (a persistent CTA waits there for the
  // consumers to be done with the previous tile's Q), after_first() once Q and the first K are on their way.
  template <class SharedStorage, class BeforeQ, class AfterFirst>
  CUTE_DEVICE void load(Params const& params, typename Traits::PipelineK& pipeline_k,
                        typename Traits::PipelineV& pipeline_v, SharedStorage& smem, int m_block, int bidh,
                        SeqInfo const& seq, int n_block_min, int n_block_max, typename Traits::PipelineState& state,
                        BeforeQ&& before_q, AfterFirst&& after_first, Walk const& walk = Walk()) const {
    auto [tQ, tK, tV] = tma_views(params, smem, m_block, bidh, seq);
    Tensor tQgQ = get<0>(tQ);
    Tensor tQsQ = get<1>(tQ);
    Tensor tKgK = get<0>(tK);  // (TMA, n_block)
    Tensor tKsK = get<1>(tK);  // (TMA, stage)
    Tensor tVgV = get<0>(tV);
    Tensor tVsV = get<1>(tV);

    // n_block: a virtual block (see walk()).
    auto load_k = [&](int n_block) {
      pipeline_k.producer_acquire(state);
      copy(params.tma_k.with(*pipeline_k.producer_get_barrier(state)),
           tKgK(_, walk.block(params.block_sparse, n_block)), tKsK(_, state.index()));
    };
    auto load_v = [&](int n_block, typename Traits::PipelineState const& st) {
      pipeline_v.producer_acquire(st);
      copy(params.tma_v.with(*pipeline_v.producer_get_barrier(st)), tVgV(_, walk.block(params.block_sparse, n_block)),
           tVsV(_, st.index()));
    };

    using BarrierT = cutlass::arch::ClusterTransactionBarrier::ValueType;
    before_q();
    smem.barrier_q.arrive_and_expect_tx(Traits::kTmaBytesQ);
    copy(params.tma_q.with(reinterpret_cast<BarrierT&>(smem.barrier_q)), tQgQ, tQsQ);

    int n_block = n_block_max - 1;
    load_k(n_block);
    after_first();
    for (; n_block > n_block_min; --n_block) {
      auto state_v = state;
      ++state;
      load_k(n_block - 1);
      load_v(n_block, state_v);
    }
    load_v(n_block_min, state);
    ++state;
  }
};

}  // namespace flash4

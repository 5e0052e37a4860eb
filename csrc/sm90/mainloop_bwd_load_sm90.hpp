// sm90 backward mainloop, setup and producer half: the kernel's parameters (TMA descriptors of Q, dO, K, V and
// the per-row lse_log2 / D), the helpers a CTA asks for per (sequence, key tile) (its sequence, score
// modifier, query-block walk and step masks), the Q / dO pipeline and the producer's loads. MainloopBwdSm90
// (mainloop_bwd_sm90.hpp) adds the consumer warpgroups' steps.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../common/block_info.hpp"
#include "../common/block_sparse.hpp"
#include "../common/dropout.hpp"
#include "../common/fragment.hpp"
#include "../common/sync.hpp"
#include "../common/trace.hpp"
#include "../params.h"
#include "kernel_traits_bwd_sm90.hpp"
#include "softmax_bwd_sm90.hpp"  // ScoresBwdSm90
#include "utils_sm90.hpp"

namespace flash4 {

using namespace cute;

// Where a CTA's sequence lives, its masks, and the first scratch row of (sequence, query head 0). Outside the
// mainloop so that the epilogue, which takes it, does not depend on the score bias.
template <class Mask>
struct BwdSeqSm90 {
  SeqInfo info;
  Mask bm;
  int accum_offset;    // the sequence's first scratch row within its (batch, head) slice
  int64_t accum_row0;  // the same row counted from the start of the scratch (+ head * accum_head_stride)
  int bidb;            // the sequence (info.batch is 0 in packed batches)
};

// Iter: the block iterator (common/block_sparse.hpp); Bias: the score modifier (see MainloopBwdSm90).
template <class Traits_, bool kCausal, bool kLocal, class Iter = DenseBand, class Bias = NoBias>
struct MainloopBwdLoadSm90 {
  using Traits = Traits_;
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;  // v's and dO's (MLA: below kHeadDim)
  using SharedStorage = typename Traits::SharedStorage;
  using Mask = BlockMask<kBlockM, kBlockN, kCausal, kLocal>;
  using Scores = ScoresBwdSm90<kBlockM, kBlockN>;
  static constexpr bool kSparse = kIsSparse<Iter>;
  using Walk = std::conditional_t<kSparse, SparseWalk<kBlockM>, DenseWalkBwd>;
  static_assert(!kSparse || kMaskBlock % kBlockN == 0, "a key tile must lie inside one mask block");

  using ShapeT = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen, head_dim, heads, batch)
  using StrideT = Stride<int64_t, _1, int64_t, int64_t>;
  using ShapeRow = Shape<int32_t, int32_t, int32_t>;  // (scratch rows, heads, batch)
  using StrideRow = Stride<_1, int64_t, int64_t>;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileK = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileDO = Shape<Int<kBlockM>, Int<kHeadDimV>>;
  using TileV = Shape<Int<kBlockN>, Int<kHeadDimV>>;
  using TileRow = Shape<Int<kBlockM>>;

  template <class Stride, class Shape_, class SmemLayout, class Tile, class T = Element>
  using TmaLoad = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                         make_tensor(make_gmem_ptr(static_cast<T const*>(nullptr)), Shape_{},
                                                     Stride{}),
                                         SmemLayout{}, Tile{}, _1{}));
  using TmaQ = TmaLoad<StrideT, ShapeT, decltype(take<0, 2>(typename Traits::SmemLayoutQ{})), TileQ>;
  using TmaDO = TmaLoad<StrideT, ShapeT, decltype(take<0, 2>(typename Traits::SmemLayoutdO{})), TileDO>;
  using TmaK = TmaLoad<StrideT, ShapeT, typename Traits::SmemLayoutK, TileK>;
  using TmaV = TmaLoad<StrideT, ShapeT, typename Traits::SmemLayoutV, TileV>;
  using TmaRow = TmaLoad<StrideRow, ShapeRow, Layout<TileRow>, TileRow, float>;

  struct Params {
    TmaQ tma_q;
    TmaDO tma_do;  // TmaQ's type unless MLA
    TmaK tma_k;
    TmaV tma_v;
    TmaRow tma_lse, tma_dpsum;
    ShapeT shape_q, shape_k;
    ShapeRow shape_row;
    int64_t accum_batch_stride;  // scratch rows (see BwdParams)
    int seqlen_q, seqlen_k, head_ratio;
    // P = exp2(s * scale_log2 - lse_log2); with softcap s is tanh(s * softcap_scale) and scale_log2 =
    // softcap * log2(e) (softcap_scale = 0: none).
    float scale_log2, softcap_scale;
    int window_left, window_right;
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    const int* seqused_q;
    const int* seqused_k;
    BlockSparseParams block_sparse;  // the transposed lists (key blocks listing query blocks), SparseList only
    const float* alibi_slopes;       // Alibi only (see SeqMaskParams)
    int64_t alibi_batch_stride;
    float bias_units;  // score units per logit: 1 / softmax_scale
    DropoutParams dropout;  // Dropout only
  };

  // Key blocks of a (head, batch): the grid's x extent, and the launch order's block extent.
  static int num_n_blocks(BwdParams const& p) { return (p.seqlen_k + kBlockN - 1) / kBlockN; }

  // Sliding windows: the key blocks whose window the sequence end cuts are seen by fewer query blocks than the
  // rest; they go last (tile_order.hpp). A window wider than half the sequence grows like causal: the grouped
  // order stays (see the forward's).
  static int tail_blocks(BwdParams const& p) {
    if (!kLocal) return 0;
    const int num_blocks = num_n_blocks(p);
    const int tail = (p.window_left + 1) / kBlockN + 2;  // the last keys, whose window ends past the last query
    return 2 * tail <= num_blocks ? tail : 0;
  }

  // dO's and V's global shapes: q's and k's with v's head dim (the binding matched v to the instantiation).
  CUTE_HOST_DEVICE static ShapeT v_shape(ShapeT const& s) {
    if constexpr (kHeadDimV == kHeadDim) {
      return s;
    } else {
      return make_shape(get<0>(s), int(kHeadDimV), get<2>(s), get<3>(s));
    }
  }

  static Params to_params(BwdParams const& p) {
    auto ptr = [](const void* x) { return make_gmem_ptr(static_cast<Element const*>(x)); };
    // Packed batches: one batch of all rows, coordinates offset per sequence (see the forward mainloop).
    const bool packed = p.cu_seqlens_q != nullptr;
    const int batch = packed ? 1 : p.batch;
    ShapeT shape_q = make_shape(packed ? p.total_q : p.seqlen_q, p.head_dim, p.nheads_q, batch);
    ShapeT shape_k = make_shape(packed ? p.total_k : p.seqlen_k, p.head_dim, p.nheads_kv, batch);
    ShapeRow shape_row = make_shape(int(p.accum_head_stride), p.nheads_q, batch);
    auto row_stride = make_stride(_1{}, p.accum_head_stride, p.accum_batch_stride);
    Tensor mQ = make_tensor(ptr(p.q), shape_q, make_stride(p.q_row_stride, _1{}, p.q_head_stride, p.q_batch_stride));
    Tensor mdO = make_tensor(ptr(p.dout), v_shape(shape_q),
                             make_stride(p.dout_row_stride, _1{}, p.dout_head_stride, p.dout_batch_stride));
    Tensor mK = make_tensor(ptr(p.k), shape_k, make_stride(p.k_row_stride, _1{}, p.k_head_stride, p.k_batch_stride));
    Tensor mV = make_tensor(ptr(p.v), v_shape(shape_k),
                            make_stride(p.v_row_stride, _1{}, p.v_head_stride, p.v_batch_stride));
    Tensor mLse = make_tensor(make_gmem_ptr(static_cast<float const*>(p.lse_log2)), shape_row, row_stride);
    Tensor mDpsum = make_tensor(make_gmem_ptr(static_cast<float const*>(p.dpsum)), shape_row, row_stride);
    auto sQ = take<0, 2>(typename Traits::SmemLayoutQ{});
    return {make_tma_copy(SM90_TMA_LOAD{}, mQ, sQ, TileQ{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mdO, take<0, 2>(typename Traits::SmemLayoutdO{}), TileDO{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mK, typename Traits::SmemLayoutK{}, TileK{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mV, typename Traits::SmemLayoutV{}, TileV{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mLse, Layout<TileRow>{}, TileRow{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mDpsum, Layout<TileRow>{}, TileRow{}, _1{}),
            shape_q,
            shape_k,
            shape_row,
            p.accum_batch_stride,
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
            p.alibi_slopes,
            p.alibi_batch_stride,
            1.f / p.softmax_scale,
            p.dropout};
  }

  using Seq = BwdSeqSm90<Mask>;
  CUTE_DEVICE static Seq seq_of(Params const& params, int bidb) {
    const SeqInfo info =
        make_seq_info(params.cu_seqlens_q, params.cu_seqlens_k, params.seqused_q, params.seqused_k, bidb,
                      params.seqlen_q, params.seqlen_k, get<0>(params.shape_q), get<0>(params.shape_k));
    const int64_t offset = params.cu_seqlens_q ? padded_row_offset(info.offset_q, bidb) : 0;
    return {info, Mask(info.seqlen_q, info.seqlen_k, params.window_left, params.window_right), int(offset),
            info.batch * params.accum_batch_stride + offset, bidb};
  }

  // The score bias of query head bidh in the sequence.
  CUTE_DEVICE static Bias bias(Params const& params, Seq const& seq, int bidh) {
    if constexpr (Bias::kEnabled) {
      return Bias::make(params.alibi_slopes, params.alibi_batch_stride, seq.bidb, bidh,
                        seq.info.seqlen_k - seq.info.seqlen_q, params.bias_units);
    } else if constexpr (Bias::kDrops) {
      return Bias::make(params.dropout, seq.bidb, get<2>(params.shape_q), bidh);
    } else {
      return Bias{};
    }
  }

  // Query blocks [m_min, m_max) that see at least one key of key block n_block (empty: m_max <= m_min).
  CUTE_DEVICE static void m_block_range(Seq const& seq, int n_block, int& m_min, int& m_max) {
    m_min = seq.bm.m_block_min(n_block);
    m_max = seq.bm.m_block_max(n_block);
  }

  // The query blocks that key tile n_block visits for query head bidh, as virtual steps [0, count()).
  CUTE_DEVICE static Walk walk(BlockSparseParams const& lists, Seq const& seq, int bidh, int n_block) {
    if constexpr (kSparse) {
      return Walk(lists, seq.info.batch, bidh, n_block * kBlockN / kMaskBlock, seq.info.seqlen_q);
    } else {
      int m_min, m_max;
      m_block_range(seq, n_block, m_min, m_max);
      return Walk{m_min, cute::max(0, m_max - m_min)};
    }
  }
  // Steps of a key tile over all query heads of its GQA group.
  CUTE_DEVICE static int total_steps(BlockSparseParams const& lists, Seq const& seq, int bidh_kv, int head_ratio,
                                     int n_block) {
    if constexpr (kSparse) {
      int total = 0;
      for (int i = 0; i < head_ratio; ++i) total += walk(lists, seq, bidh_kv * head_ratio + i, n_block).count();
      return total;
    } else {
      return walk(lists, seq, 0, n_block).count() * head_ratio;
    }
  }
  // The mask of step v: the call's (dense band), or per block (StepMask: partial or full).
  CUTE_DEVICE static auto step_mask(Seq const& seq, Walk const& w, int v) {
    if constexpr (kSparse) {
      return StepMask<Mask>{seq.bm, w.is_partial(v)};
    } else {
      return seq.bm;
    }
  }

  // `state` carries across the tiles of a persistent CTA; before_kv(prefetch_kv) runs before K and V are loaded
  // over the previous tile's (the persistent kernel prefetches them into L2 there, then waits until its
  // consumers are done with the previous ones).
  template <class BeforeKV>
  CUTE_DEVICE void load(Params const& params, typename Traits::PipelineQdO& pipeline, SharedStorage& smem,
                        int n_block, int bidh_kv, Seq const& seq, typename Traits::PipelineState& state,
                        BeforeKV&& before_kv, TraceRow const& trace) const {
    const SeqInfo& si = seq.info;
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutdO{});
    Tensor sLse = make_tensor(make_smem_ptr(smem.lse_log2.data()), typename Traits::SmemLayoutRow{});
    Tensor sDpsum = make_tensor(make_smem_ptr(smem.dpsum.data()), typename Traits::SmemLayoutRow{});

    using BarrierT = cutlass::arch::ClusterTransactionBarrier::ValueType;
    auto rows_k = [&](auto const& t) { return domain_offset(make_coord(si.offset_k, _0{}), t); };
    auto rows_q = [&](auto const& t) { return domain_offset(make_coord(si.offset_q, _0{}), t); };
    // The TMA views are already sliced by (head, batch): only the sequence's own offset is added.
    auto rows_acc = [&](auto const& t) { return domain_offset(make_coord(seq.accum_offset), t); };
    Tensor gK = local_tile(rows_k(params.tma_k.get_tma_tensor(params.shape_k)(_, _, bidh_kv, si.batch)), TileK{},
                           make_coord(n_block, _0{}));
    Tensor gV = local_tile(rows_k(params.tma_v.get_tma_tensor(v_shape(params.shape_k))(_, _, bidh_kv, si.batch)),
                           TileV{}, make_coord(n_block, _0{}));
    auto tK = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto tV = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    before_kv([&] {
      cute::prefetch(params.tma_k, get<0>(tK));
      cute::prefetch(params.tma_v, get<0>(tV));
    });
    smem.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
    copy(params.tma_k.with(reinterpret_cast<BarrierT&>(smem.barrier_kv)), get<0>(tK), get<1>(tK));
    copy(params.tma_v.with(reinterpret_cast<BarrierT&>(smem.barrier_kv)), get<0>(tV), get<1>(tV));
    trace.stamp(TraceSlot::kProducerIssued);

    // Not unrolled: the producer warpgroup runs on 24 registers, and unrolled copies of this loop spill.
#pragma unroll 1
    for (int i = 0; i < params.head_ratio; ++i) {
      const int bidh = bidh_kv * params.head_ratio + i;
      const Walk w = walk(params.block_sparse, seq, bidh, n_block);
      Tensor gQ = local_tile(rows_q(params.tma_q.get_tma_tensor(params.shape_q)(_, _, bidh, si.batch)), TileQ{},
                             make_coord(_, _0{}));  // (M, D, m)
      Tensor gdO = local_tile(rows_q(params.tma_do.get_tma_tensor(v_shape(params.shape_q))(_, _, bidh, si.batch)),
                              TileDO{}, make_coord(_, _0{}));
      Tensor gLse = local_tile(rows_acc(params.tma_lse.get_tma_tensor(params.shape_row)(_, bidh, si.batch)),
                               TileRow{}, make_coord(_));  // (M, m)
      Tensor gDpsum = local_tile(rows_acc(params.tma_dpsum.get_tma_tensor(params.shape_row)(_, bidh, si.batch)),
                                 TileRow{}, make_coord(_));
      auto tQ = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto tdO = tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      auto tLse = tma_partition(params.tma_lse, _0{}, Layout<_1>{}, group_modes<0, 1>(sLse), group_modes<0, 1>(gLse));
      auto tDpsum =
          tma_partition(params.tma_dpsum, _0{}, Layout<_1>{}, group_modes<0, 1>(sDpsum), group_modes<0, 1>(gDpsum));
#pragma unroll 1
      for (int v = 0; v < w.count(); ++v) {
        const int m_block = w.block(params.block_sparse, v);
        pipeline.producer_acquire(state);
        BarrierT* bar = pipeline.producer_get_barrier(state);
        const int s = state.index();
        copy(params.tma_q.with(*bar), get<0>(tQ)(_, m_block), get<1>(tQ)(_, s));
        copy(params.tma_do.with(*bar), get<0>(tdO)(_, m_block), get<1>(tdO)(_, s));
        copy(params.tma_lse.with(*bar), get<0>(tLse)(_, m_block), get<1>(tLse)(_, s));
        copy(params.tma_dpsum.with(*bar), get<0>(tDpsum)(_, m_block), get<1>(tDpsum)(_, s));
        ++state;
      }
    }
  }

  CUTE_DEVICE static typename Traits::PipelineState stage_state(int stage) {
    return typename Traits::PipelineState(stage, 0u, 0u);
  }

  // The Q / dO pipeline: warpgroup 0 produces, each consumer warpgroup releases once per stage.
  CUTE_DEVICE static typename Traits::PipelineQdO make_pipeline(SharedStorage& smem, int warp_group) {
    return typename Traits::PipelineQdO(
        smem.pipeline_qdo,
        tma_pipeline_params<typename Traits::PipelineQdO>(Traits::kTmaBytesQdO, warp_group, Traits::kNumMmaWarpGroups),
        Shape<_1, _1, _1>{});
  }
};

}  // namespace flash4

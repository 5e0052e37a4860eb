// sm90 backward mainloop, consumer half (see kernel_traits_bwd_sm90.hpp for the math and the tiling): the
// consumer warpgroups' steps (S^T, dP^T, P^T, dS^T, dV, dK and dQ on WGMMA). dK and dV stay in the caller's
// registers; dQ of every step is handed to the epilogue (epilogue_bwd_sm90.hpp). The parameters, the
// producer's TMA loads (K and V of the CTA's key block once, then Q, dO, lse_log2 and D per query block into a
// two-stage pipeline) and the per-tile helpers are MainloopBwdLoadSm90's (mainloop_bwd_load_sm90.hpp).
//
// Two step bodies: mma() for head dims <= 128 (BwdTraitsSm90: the warpgroups split the keys) and mma_wide()
// for 192 / 256 (BwdWideTraitsSm90: they split head_dim). docs/design.md, "sm90 backward".
#pragma once

#include <cute/tensor.hpp>

#include "../common/dropout.hpp"
#include "../common/fragment.hpp"
#include "../common/sync.hpp"
#include "../common/trace.hpp"
#include "mainloop_bwd_load_sm90.hpp"
#include "softmax_bwd_sm90.hpp"
#include "utils_sm90.hpp"

namespace flash4 {

using namespace cute;

// Iter: the block iterator (common/block_sparse.hpp): DenseBand visits the query blocks the causal / window
// mask leaves a key tile, SparseList those a block mask's transposed lists name. Bias: the score modifier,
// NoBias, Alibi (common/score_bias.hpp, without softcap) or Dropout (common/dropout.hpp): with the keep mask M,
// dV takes P o M / (1 - p) and dS = P o (dP o M / (1 - p) - D), D = rowsum(dO o O) as without dropout.
template <class Traits_, bool kCausal, bool kLocal, class Iter = DenseBand, class Bias = NoBias>
struct MainloopBwdSm90 : MainloopBwdLoadSm90<Traits_, kCausal, kLocal, Iter, Bias> {
  using Base = MainloopBwdLoadSm90<Traits_, kCausal, kLocal, Iter, Bias>;
  using Traits = typename Base::Traits;
  using Element = typename Base::Element;
  using SharedStorage = typename Base::SharedStorage;
  using Params = typename Base::Params;
  using Seq = typename Base::Seq;
  using Walk = typename Base::Walk;
  using Scores = typename Base::Scores;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim;
  using Base::bias, Base::stage_state, Base::step_mask, Base::total_steps, Base::walk;

  // dS^T from dP^T (Scores::ds_from_dp), or with dropout (keep mask M; no softcap, the binding checks), in one
  // pass with the keep bits: dS^T = P^T o (dP^T o M / (1 - p) - D) and P^T o M / (1 - p) for dV.
  // With dropout P^T goes to tPrP (16-bit, the dV GEMM's operand) here too, converted as each element is done, so
  // neither keep bits nor a dropped fp32 P^T are held; without, the caller converts it.
  template <class TS, class TP, class TC, class TC0>
  CUTE_DEVICE static void ds_from_dp(Params const& params, Bias const& b, TS& tSrdP_rc, TS& tSrS_rc, TP& tPrP,
                                     TC const& tScS_rc, TC0 const& tScS0_rc, const float* dpsum_s,
                                     const float* lse_s, int n_block, int m_block) {
    if constexpr (Bias::kDrops) {
      Tensor tPrP_rc = make_tensor(tPrP.data(), acc_rowcol_layout(tPrP.layout()));
      const float scale = params.dropout.inv_keep;
      b.with_stream(params.dropout)
          .template for_each_keep</*kRowsAreQueries=*/false>(
              tScS_rc, tScS0_rc, n_block * kBlockN, m_block * kBlockM, params.dropout.threshold,
              [&](int r, int c, bool kept) {
                const float p = tSrS_rc(r, c);
                const float dp = kept ? tSrdP_rc(r, c) * scale : 0.f;
                tSrdP_rc(r, c) = p * (dp - dpsum_s[get<1>(tScS0_rc(r, c))]);
                tPrP_rc(r, c) = Element(kept ? p * scale : 0.f);
              });
    } else {
      Scores::ds_from_dp(params, tSrdP_rc, tSrS_rc, tScS0_rc, dpsum_s, lse_s);
    }
  }

  // dQ of every step goes to the epilogue's hand-off to the dQ writer warp (EpilogueBwdSm90::stage_dq).
  template <class Epilogue, class FragKV, class AfterGemms>
  CUTE_DEVICE void mma(Params const& params, typename Traits::PipelineQdO& pipeline, SharedStorage& smem,
                       Epilogue const& epilogue, FragKV& tdKrdK, FragKV& tdVrdV, int thread_idx, int n_block,
                       int bidh_kv, Seq const& seq, typename Traits::PipelineState& read, int kv_phase,
                       AfterGemms&& after_gemms, TraceRow const& trace) const {
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(thread_idx);
    auto thr_dkv = mma_dkv.get_thread_slice(thread_idx);
    auto thr_dq = mma_dq.get_thread_slice(thread_idx);
    const int warp_group = thread_idx / 128, wg_thread = thread_idx % 128;

    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutdO{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutdOt{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutdS{});
    Tensor sLse = make_tensor(make_smem_ptr(smem.lse_log2.data()), typename Traits::SmemLayoutRow{});
    Tensor sDpsum = make_tensor(make_smem_ptr(smem.dpsum.data()), typename Traits::SmemLayoutRow{});

    // S^T = K Q^T and dP^T = V dO^T: A = this warpgroup's 64 keys, B = the stage's queries.
    Tensor tSrK = thr_sdp.partition_fragment_A(sK);
    Tensor tSrV = thr_sdp.partition_fragment_A(sV);
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);    // (MMA, N, K, stage)
    Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);  // (MMA, N, K, stage)
    // dV += P^T dO, dK += dS^T Q: B = dO^T / Q^T.
    Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, N, K, stage)
    Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
    // dQ = dS K; this warpgroup computes head_dim columns [w * D/2, (w + 1) * D/2).
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, M, K, buffer)
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);

    using TileS = Shape<Int<kBlockN>, Int<kBlockM>>;
    Tensor tSrS = partition_fragment_C(mma_sdp, TileS{});
    Tensor tSrdP = partition_fragment_C(mma_sdp, TileS{});
    Tensor tSrS_rc = make_tensor(tSrS.data(), acc_rowcol_layout(tSrS.layout()));
    Tensor tSrdP_rc = make_tensor(tSrdP.data(), acc_rowcol_layout(tSrdP.layout()));
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(TileS{}));  // (key, query) in the tile
    Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
    // A thread's query columns are its first one plus offsets that are the same for every thread: taken from
    // thread 0's slice they fold to immediates, so lse_log2 and D are read off one base pointer per stage
    // (per-column addresses cost registers and spilled).
    Tensor tScS0 = mma_sdp.get_thread_slice(0).partition_C(make_identity_tensor(TileS{}));
    Tensor tScS0_rc = make_tensor(tScS0.data(), acc_rowcol_layout(tScS0.layout()));
    const int query_thr = get<1>(tScS_rc(0, 0));
    Tensor tPrP_acc = make_tensor<Element>(tSrS.layout());
    Tensor tPrP = make_tensor(tPrP_acc.data(), acc_as_a_operand_layout(tSrS.layout()));
    Tensor tdSrdS_acc = make_tensor<Element>(tSrS.layout());
    Tensor tdSrdS = make_tensor(tdSrdS_acc.data(), acc_as_a_operand_layout(tSrS.layout()));
    // The dS buffer seen as (keys, queries, buffer), the accumulator's orientation, for stmatrix.
    Tensor sdSt = make_tensor(sdS.data(), select<1, 0, 2>(sdS.layout()));
    auto smem_copy_dS = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto smem_thr_copy_dS = smem_copy_dS.get_thread_slice(thread_idx);
    Tensor tdSsdS = smem_thr_copy_dS.partition_D(sdSt);
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    static_assert(decltype(size(tdQrdQ))::value * 128 == Traits::kdQChunk);

    clear(tdKrdK);
    clear(tdVrdV);
    if (total_steps(params.block_sparse, seq, bidh_kv, params.head_ratio, n_block) > 0) {
      epilogue.start_dq(warp_group, wg_thread);
    }
    smem.barrier_kv.wait(kv_phase);
    if (thread_idx == 0) trace.stamp(TraceSlot::kFirstKV);

    // The stage of this tile's previous step (-1: none yet), released once the next step's S^T has retired.
    // Only its index is kept (consumer_release reads nothing else): registers are at their limit here.
    int prev_stage = -1;
    for (int i = 0; i < params.head_ratio; ++i) {
      const Walk w = walk(params.block_sparse, seq, bidh_kv * params.head_ratio + i, n_block);
      for (int v = 0; v < w.count(); ++v) {
        const int m_block = w.block(params.block_sparse, v);
        // Read every step: held across the loop, the bias's two registers made the causal step spill.
        const Bias b = bias(params, seq, bidh_kv * params.head_ratio + i);
        const int s = read.index();
        pipeline.consumer_wait(read);
        // K's and V's descriptors are the same every step, but made here from an opaque base: precomputed
        // for every k-step before the loop they took 32 registers, and the persistent kernel spilled them.
        warpgroup_gemm</*zero_init=*/true, -1>(mma_sdp, opaque_descriptors(tSrK), tSrQ(_, _, _, s), tSrS);
        warpgroup_gemm<true, -1>(mma_sdp, opaque_descriptors(tSrV), tSrdO(_, _, _, s), tSrdP);
        // S^T has retired, and with it the previous step's dK GEMM, the last reader of that step's stage.
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        if (prev_stage >= 0 && wg_thread == 0) pipeline.consumer_release(stage_state(prev_stage));

        const float* lse_s = &sLse(query_thr, s);
        const float* dpsum_s = &sDpsum(query_thr, s);
        Scores::probabilities(params, step_mask(seq, w, v), b, tSrS_rc, tScS_rc, tScS0_rc, lse_s, n_block, m_block);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrdP);
        ds_from_dp(params, b, tSrdP_rc, tSrS_rc, tPrP_acc, tScS_rc, tScS0_rc, dpsum_s, lse_s, n_block, m_block);
        if constexpr (!Bias::kDrops) convert_fragment(tSrS, tPrP_acc);
        convert_fragment(tSrdP, tdSrdS_acc);

        // dS (queries x keys) to shared memory for the dQ GEMM. Buffer = step parity (the stage index, with
        // an even number of stages): the other warpgroup may still be reading the previous step's buffer,
        // but it passed this step's barrier only after its dQ GEMM of two steps ago retired, so this buffer
        // is free. Queries are contiguous in the buffer, as
        // in the accumulator's 8x8 blocks, so stmatrix stores four blocks per instruction (per-element
        // swizzled addresses cost registers and spilled).
        static_assert(Traits::kStages % 2 == 0, "dS buffer parity follows the stage index");
        const int buf = s & 1;
        copy(smem_copy_dS, smem_thr_copy_dS.retile_S(tdSrdS_acc), tdSsdS(_, _, _, buf));
        warpgroup_gemm<false, -1>(mma_dkv, tPrP, tdVrdOt(_, _, _, s), tdVrdV);
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kdS));
        warpgroup_gemm<true, 1>(mma_dq, tdQrdS(_, _, _, buf), opaque_descriptors(tdQrKt), tdQrdQ);  // dV retired
        warpgroup_fence_operand(tdVrdV);
        // 128 queries a step (hdim 64): dK retires here, so the next step's S^T and dP^T (128 registers) do
        // not share the register file with this step's dS^T operand.
        warpgroup_gemm<false, kBlockM == 128 ? 0 : 1>(mma_dkv, tdSrdS, tdKrQt(_, _, _, s), tdKrdK);  // dQ retired
        warpgroup_fence_operand(tdQrdQ);

        epilogue.stage_dq(smem, tdQrdQ, warp_group, wg_thread);
        if (thread_idx == 0 && prev_stage < 0) trace.stamp(TraceSlot::kFirstStep);
        prev_stage = s;
        ++read;
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdKrdK);
    after_gemms();
    if (thread_idx == 0) trace.stamp(TraceSlot::kLoopDone);
    if (prev_stage >= 0 && wg_thread == 0) pipeline.consumer_release(stage_state(prev_stage));
  }

  // Head dims 192 / 256 (BwdWideTraitsSm90): the warpgroups split queries for S^T and dP^T and head_dim
  // for dV, dK and dQ; P^T and dS^T meet in shared memory. dQ goes straight to dq_accum with 16-byte
  // reductions (EpilogueBwdSm90::add_dq).
  template <class Epilogue, class FragK, class FragV>
  CUTE_DEVICE void mma_wide(Params const& params, typename Traits::PipelineQdO& pipeline, SharedStorage& smem,
                            Epilogue const& epilogue, typename Epilogue::Params const& epilogue_params,
                            FragK& tdKrdK, FragV& tdVrdV, int thread_idx, int n_block, int bidh_kv,
                            Seq const& seq) const {
    typename Traits::TiledMmaSdP mma_sdp;  // S^T over head_dim, dP^T over v's
    typename Traits::TiledMmadKV mma_dkv;  // dK
    typename Traits::TiledMmadV mma_dv;    // dV: mma_dkv's type unless MLA
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(thread_idx);
    auto thr_dkv = mma_dkv.get_thread_slice(thread_idx);
    auto thr_dv = mma_dv.get_thread_slice(thread_idx);
    auto thr_dq = mma_dq.get_thread_slice(thread_idx);
    const int warp_group = thread_idx / 128, wg_thread = thread_idx % 128;

    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutdO{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutdOt{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutdSt{});
    Tensor sPt = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutdSt{});
    Tensor sLse = make_tensor(make_smem_ptr(smem.lse_log2.data()), typename Traits::SmemLayoutRow{});
    Tensor sDpsum = make_tensor(make_smem_ptr(smem.dpsum.data()), typename Traits::SmemLayoutRow{});

    Tensor tSrK = thr_sdp.partition_fragment_A(sK);
    Tensor tSrV = thr_sdp.partition_fragment_A(sV);
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);    // (MMA, N, K, stage): this warpgroup's queries
    Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
    Tensor tdVrPt = thr_dv.partition_fragment_A(sPt);    // (MMA, M, K, buffer)
    Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdSt);
    Tensor tdVrdOt = thr_dv.partition_fragment_B(sdOt);  // (MMA, N, K, stage): this warpgroup's head_dim half
    Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);

    using TileS = Shape<Int<kBlockN>, Int<kBlockM>>;
    Tensor tSrS = partition_fragment_C(mma_sdp, TileS{});
    Tensor tSrdP = partition_fragment_C(mma_sdp, TileS{});
    Tensor tSrS_rc = make_tensor(tSrS.data(), acc_rowcol_layout(tSrS.layout()));
    Tensor tSrdP_rc = make_tensor(tSrdP.data(), acc_rowcol_layout(tSrdP.layout()));
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(TileS{}));
    Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
    Tensor tScS0 = mma_sdp.get_thread_slice(0).partition_C(make_identity_tensor(TileS{}));  // see mma()
    Tensor tScS0_rc = make_tensor(tScS0.data(), acc_rowcol_layout(tScS0.layout()));
    const int query_thr = get<1>(tScS_rc(0, 0));
    Tensor tPrP = make_tensor<Element>(tSrS.layout());
    Tensor tdSrdS = make_tensor<Element>(tSrS.layout());
    auto smem_copy_PdS = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto smem_thr_copy_PdS = smem_copy_PdS.get_thread_slice(thread_idx);
    Tensor tPsPt = smem_thr_copy_PdS.partition_D(sPt);
    Tensor tdSsdSt = smem_thr_copy_PdS.partition_D(sdSt);
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    static_assert(decltype(size(tdQrdQ))::value * 128 == Traits::kdQChunk);

    clear(tdKrdK);
    clear(tdVrdV);
    smem.barrier_kv.wait(0);

    typename Traits::PipelineState read;
#pragma unroll 1
    for (int i = 0; i < params.head_ratio; ++i) {
      const auto dq = epilogue.dq_rows(epilogue_params, seq, bidh_kv * params.head_ratio + i, warp_group);
      const Walk w = walk(params.block_sparse, seq, bidh_kv * params.head_ratio + i, n_block);
      const Bias b = bias(params, seq, bidh_kv * params.head_ratio + i);
#pragma unroll 1
      for (int v = 0; v < w.count(); ++v) {
        const int m_block = w.block(params.block_sparse, v);
        const int s = read.index();
        pipeline.consumer_wait(read);
        warpgroup_gemm</*zero_init=*/true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, s), tSrS);
        warpgroup_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, s), tSrdP);
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        const float* lse_s = &sLse(query_thr, s);
        const float* dpsum_s = &sDpsum(query_thr, s);
        Scores::probabilities(params, step_mask(seq, w, v), b, tSrS_rc, tScS_rc, tScS0_rc, lse_s, n_block, m_block);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrdP);
        ds_from_dp(params, b, tSrdP_rc, tSrS_rc, tPrP, tScS_rc, tScS0_rc, dpsum_s, lse_s, n_block, m_block);
        if constexpr (!Bias::kDrops) convert_fragment(tSrS, tPrP);
        convert_fragment(tSrdP, tdSrdS);
        // Buffer = step parity (the stage index): the other warpgroup passed this step's barrier only after
        // its GEMMs of two steps ago, the last readers of this buffer, retired.
        static_assert(Traits::kStages % 2 == 0, "P/dS buffer parity follows the stage index");
        const int buf = s & 1;
        copy(smem_copy_PdS, smem_thr_copy_PdS.retile_S(tPrP), tPsPt(_, _, _, buf));
        copy(smem_copy_PdS, smem_thr_copy_PdS.retile_S(tdSrdS), tdSsdSt(_, _, _, buf));
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kdS));
        // dQ first, so its reductions below run while the dV and dK GEMMs still occupy the tensor cores.
        warpgroup_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, buf), tdQrKt, tdQrdQ);
        warpgroup_gemm<false, -1>(mma_dv, tdVrPt(_, _, _, buf), tdVrdOt(_, _, _, s), tdVrdV);
        warpgroup_gemm<false, -1>(mma_dkv, tdKrdSt(_, _, _, buf), tdKrQt(_, _, _, s), tdKrdK);
        warpgroup_wait<2>();
        warpgroup_fence_operand(tdQrdQ);

        epilogue.add_dq(dq, tdQrdQ, seq.bm, n_block, m_block, thread_idx);
        warpgroup_wait<0>();  // dV and dK, the last readers of this Q/dO stage
        warpgroup_fence_operand(tdVrdV);
        warpgroup_fence_operand(tdKrdK);
        if (wg_thread == 0) pipeline.consumer_release(read);
        ++read;
      }
    }
  }
};

}  // namespace flash4

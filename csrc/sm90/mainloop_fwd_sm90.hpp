// sm90 forward mainloop: the producer side (TMA loads of Q, K, V into mbarrier pipelines) and the
// consumer side (S = Q K^T and O += P V on WGMMA, online softmax on the CUDA cores).
//
// Schedule of one consumer warpgroup over key blocks n = n_max-1 ... 0 (descending, so the blocks that
// need masking come first and the steady state runs mask-free):
//   prologue:  S = Q K[n_max-1]^T, wait, mask, softmax -> P
//   step(n):   issue S = Q K[n]^T ; issue O += P V[n+1] ; wait S ; mask?, softmax(S) -> P ; wait O
//   tail:      issue O += P V[0] ; finalize row sums while it runs ; wait ; normalize
// The softmax of block n runs on the CUDA cores while the tensor cores do P V of block n+1, and the consumer
// warpgroups (two, or three at hdim 64) take turns issuing their GEMMs (named barriers), so one's softmax
// hides under the others' GEMMs.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../common/mask.hpp"
#include "../common/softmax.hpp"
#include "../common/trace.hpp"
#include "fp8_sm90.hpp"
#include "mainloop_fwd_load_sm90.hpp"

namespace flash4 {

using namespace cute;

// fp8 (Traits::kFp8): P goes to e4m3 for the P V GEMM (pack_p_fp8, V^T from the pre-pass), and P V accumulates
// in two levels: each key block's P V into a zeroed fp32 fragment, added into O once it retires. An fp8 WGMMA
// adds into its accumulator with fewer bits than fp32 (DeepSeek-V3 measured about 14 on H800); here the MMA
// sums 4 k-steps at a time and fp32 adds the blocks (at 32k keys: the same speed, a slightly lower error on
// the longest rows; docs/design.md, "FP8 forward"). Softmax: the lazy rescale, with probabilities shifted up
// by 2^7 (OnlineSoftmax's kExpShift), below e4m3's 448.
//
// kSoftcap: a compile-time switch (the launcher picks the instantiation at run time) because a uniform
// run-time branch in the loop cost the plain kernels 4-5% (H200, hdim 64-256).
// Iter: the block iterator (common/block_sparse.hpp), DenseBand or SparseList. Bias: the score modifier,
// NoBias, Alibi (common/score_bias.hpp) or Dropout (common/dropout.hpp: it zeroes dropped probabilities after
// the row sums took them, and the output's normalization carries the 1 / (1 - p)).
template <class Traits, bool kCausal, bool kLocal, bool kSoftcap, class Iter = DenseBand, class Bias = NoBias>
struct MainloopFwdSm90 : MainloopFwdLoadSm90<Traits, Iter, Bias> {
  using Base = MainloopFwdLoadSm90<Traits, Iter, Bias>;
  using Element = typename Base::Element;
  using Params = typename Base::Params;
  using Walk = typename Base::Walk;
  using Base::kBlockM, Base::kBlockN, Base::kFp8, Base::kHeadDim, Base::kHeadDimV, Base::kSparse;
  static_assert(!kFp8 || (!kSoftcap && !kIsSparse<Iter> && !Bias::kEnabled && !Bias::kDrops),
                "fp8: no softcap, dense, no bias or dropout");
  static_assert(!(kSoftcap && Bias::kEnabled), "a score bias is added to uncapped scores only");
  // Above head dim 128, O takes 128 registers and a second 128 for the block's P V does not fit: P V goes
  // straight into O there (at head dim 128 the two forms measured the same error at 32k keys).
  static constexpr bool kTwoLevel = kFp8 && Traits::kHeadDim <= 128;
  template <int kRows>
  using Softmax = OnlineSoftmax<kRows, 4, kFp8 ? 7 : 0>;
  // For large output head dims the O rescale is issued right after the Q K^T GEMM (hidden under it) rather
  // than after the softmax: O holds 128 registers there and the softmax tail is already long.
  static constexpr bool kRescaleBeforeGemm = kHeadDimV > 128;
  using Mask = BlockMask<kBlockM, kBlockN, kCausal, kLocal>;

  CUTE_DEVICE static Mask block_mask(Params const& params, SeqInfo const& seq) {
    return Mask(seq.seqlen_q, seq.seqlen_k, params.window_left, params.window_right);
  }

  // Consumer: runs the schedule above for this thread's warpgroup (64 query rows) and leaves the
  // normalized output in tOrO and the row LSEs in `lse`. thread_idx counts consumer threads (0..255).
  // Requires n_block_max > n_block_min. `read` is the K / V pipelines' consumer state, left at the next tile's
  // first stage; q_phase the phase of barrier_q this tile's Q completes. first_mma: the CTA's first call (a
  // persistent CTA's later calls find the ping-pong barrier already armed, see below). q_done() runs once every
  // Q K^T of this warpgroup has retired, before the last P V (a persistent CTA frees Q for the next tile there).
  template <class SharedStorage, class FragO, class Softmax, class LSE, class QDone>
  CUTE_DEVICE void mma(Params const& params, typename Traits::PipelineK& pipeline_k,
                       typename Traits::PipelineV& pipeline_v, SharedStorage& smem, FragO& tOrO, Softmax& softmax,
                       LSE& lse, float lse_scale, int thread_idx, int m_block, Mask const& bm, int n_block_min,
                       int n_block_max, typename Traits::PipelineState& read, int q_phase, bool first_mma,
                       TraceRow const& trace, QDone&& q_done, Walk const& walk = Walk(),
                       Bias const& bias = Bias()) const {
    typename Traits::TiledMmaQK tiled_mma_qk;
    typename Traits::TiledMmaPV tiled_mma_pv;
    auto thr_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    Tensor tSrQ = thr_mma_qk.partition_fragment_A(sQ);   // descriptors
    Tensor tSrK = thr_mma_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = thr_mma_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)

    Tensor tSrS = partition_fragment_C(tiled_mma_qk, select<0, 1>(typename Traits::TileShapeQK{}));
    Tensor tSrS_rc = make_tensor(tSrS.data(), acc_rowcol_layout(tSrS.layout()));
    Tensor tOrO_rc = make_tensor(tOrO.data(), acc_rowcol_layout(tOrO.layout()));
    // P in 16-bit, written in S's register order and read as the RS GEMM's A operand; fp8: the GEMM's own A
    // fragment, filled by pack_p_fp8.
    Tensor tOrP_acc = make_tensor<Element>(tSrS.layout());
    Tensor tOrP = [&] {
      if constexpr (kFp8) {
        return thr_mma_pv.partition_fragment_A(
            make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), Shape<Int<kBlockM>, Int<kBlockN>>{}));
      } else {
        return make_tensor(tOrP_acc.data(), acc_as_a_operand_layout(tSrS.layout()));
      }
    }();
    auto convert_p = [&] {
      if constexpr (kFp8) {
        pack_p_fp8(tSrS, tOrP);
      } else {
        convert_fragment(tSrS, tOrP_acc);
      }
    };
    // fp8: one key block's P V (the lower level of the two-level accumulation).
    Tensor tOrOp = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
    // O += P V of the block whose P is in tOrP, from V stage `stage`: straight into O, or (fp8) into tOrOp.
    auto gemm_pv = [&](int stage) {
      if constexpr (kTwoLevel) {
        warpgroup_gemm</*zero_init=*/true, -1>(tiled_mma_pv, tOrP, tOrV(_, _, _, stage), tOrOp);
      } else {
        warpgroup_gemm<false, -1>(tiled_mma_pv, tOrP, tOrV(_, _, _, stage), tOrO);
      }
    };
    // fp8, once that GEMM retired: O += tOrOp.
    auto add_block = [&] {
#pragma unroll
      for (int i = 0; i < size(tOrO); ++i) tOrO(i) += tOrOp(i);
    };
    // (row, col) of each score inside the tile, for masking.
    Tensor tScS = thr_mma_qk.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapeQK{})));
    Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
    // Thread 0's coordinates: the bias's per-element offsets from them fold to immediates (score_bias.hpp).
    Tensor tScS0 = tiled_mma_qk.get_thread_slice(0).partition_C(
        make_identity_tensor(select<0, 1>(typename Traits::TileShapeQK{})));
    Tensor tScS0_rc = make_tensor(tScS0.data(), acc_rowcol_layout(tScS0.layout()));

    const int warp_group = thread_idx / 128;
    // One arrival per warpgroup frees a stage (the empty barriers count warpgroups, not threads): the
    // warpgroup's WGMMAs that read the stage have retired once any of its threads passed the wait.
    auto release = [&](auto& pipeline, auto const& state) {
      if (thread_idx % 128 == 0) pipeline.consumer_release(state);
    };
    const int row0 = m_block * kBlockM;
    // v: a virtual block. A sparse walk's full blocks take only the key-length mask (step_block_mask).
    auto mask = [&](int v) {
      if constexpr (kSparse) {
        const int col0 = walk.block(params.block_sparse, v) * kBlockN;
        apply_mask(tSrS_rc, tScS_rc, row0, col0, step_block_mask(bm, walk.is_partial(v)));
      } else {
        apply_mask(tSrS_rc, tScS_rc, row0, v * kBlockN, bm);
      }
    };
    // Softcap, or the score bias of virtual block v (never both). A tile on one side of the diagonal (all of
    // them when causal) takes the bias's split form: an FFMA an element and per-row offsets that the softmax
    // adds to the rows' maxima; one that crosses it, the full form (Alibi::apply_split / apply).
    constexpr int kRowsS = decltype(size<0>(tSrS_rc))::value;
    using RowOffset = std::conditional_t<Bias::kEnabled, cute::array<float, kRowsS>, NoRowOffset>;
    RowOffset row_off{};
    auto modify = [&](int v) {
      if constexpr (kSoftcap) apply_softcap(tSrS, params.softcap_scale);
      if constexpr (Bias::kEnabled) {
        const int col0 = (kSparse ? walk.block(params.block_sparse, v) : v) * kBlockN;
        const int diag_lo = row0 + bias.offset;  // the tile's first and last query positions
        if (kCausal || col0 + kBlockN - 1 <= diag_lo) {
          bias.apply_split(tSrS_rc, tScS_rc, tScS0_rc, row0, col0, 1.f, row_off);
        } else if (col0 >= diag_lo + kBlockM - 1) {
          bias.apply_split(tSrS_rc, tScS_rc, tScS0_rc, row0, col0, -1.f, row_off);
        } else {
          bias.template apply</*kRowsAreQueries=*/true>(tSrS_rc, tScS_rc, tScS0_rc, row0, col0);
#pragma unroll
          for (int r = 0; r < kRowsS; ++r) row_off[r] = 0.f;
        }
      }
    };

    // Dropout, once the softmax has summed block v's probabilities: the dropped ones leave P (the 1 / (1 - p)
    // is in the final normalization).
    auto drop = [&](int v) {
      if constexpr (Bias::kDrops) {
        const int col0 = (kSparse ? walk.block(params.block_sparse, v) : v) * kBlockN;
        bias.with_stream(params.dropout)
            .template drop</*kRowsAreQueries=*/true>(tSrS_rc, tScS_rc, tScS0_rc, row0, col0,
                                                     params.dropout.threshold);
      }
    };

    clear(tOrO);
    decltype(softmax.template update<true>(tSrS_rc)) o_scale;
    // Lazy rescale (OnlineSoftmax::update_lazy) where O is rescaled after the softmax: O is rescaled only in
    // steps where some row of the warp's running max grew, so the head_dim / 2 multiplies a thread does per
    // step (64 at hdim 128) drop out once the maxima settle; it also changed ptxas's allocation so that a
    // masked step's mask and max run before the P V wait (docs/design.md, "sm90 forward").
    // pmevent keeps the skip a branch (ptxas if-converted such branches on sm80). Head dims > 128 rescale
    // before the GEMM and keep the eager form (the lazy one spilled 24 B at hdim 256).
    [[maybe_unused]] bool rescale_o = false;
    // Ping-pong: warpgroup 0 issues first, then 1 (then 2), round and round: each step's issue waits for the
    // previous warpgroup's arrival. Warpgroup 0's own arrival plus its own first sync complete barrier 0. Every
    // call leaves barrier 0 with one warpgroup's arrival pending (the last warpgroup's after its last GEMM
    // issue, or this one when there was no step), which stands in for this arrival in the next call.
    const int next_warp_group = warp_group + 1 == Traits::kNumMmaWarpGroups ? 0 : warp_group + 1;
    if (warp_group == 0 && first_mma) named_barrier_arrive(2 * 128, int(FwdBarrier::kWarpGroup0));

    smem.barrier_q.wait(q_phase);
    if (thread_idx == 0) trace.stamp(TraceSlot::kQReady);
    if (thread_idx == 128) trace.stamp(TraceSlot::kWg1QReady);
    // K and V of one block share a stage index.
    int n_block = n_block_max - 1;

    // Prologue: the last key block always takes the key-length mask (and the causal one).
    pipeline_k.consumer_wait(read);
    if (thread_idx == 0) trace.stamp(TraceSlot::kFirstKV);
    if (thread_idx == 128) trace.stamp(TraceSlot::kWg1FirstKV);
    warpgroup_gemm</*zero_init=*/true, /*wait=*/0>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
    release(pipeline_k, read);
    modify(n_block);
    mask(n_block);
    o_scale = softmax.template update</*first=*/true>(tSrS_rc, row_off);
    drop(n_block);
    convert_p();
    if (thread_idx == 0) trace.stamp(TraceSlot::kFirstStep);
    if (thread_idx == 128) trace.stamp(TraceSlot::kWg1FirstStep);

    auto step = [&](int n, auto masked) {
      auto read_v = read;  // V of block n + 1
      ++read;              // K of block n
      pipeline_k.consumer_wait(read);
      named_barrier_sync(2 * 128, int(FwdBarrier::kWarpGroup0) + warp_group);
      warpgroup_gemm<true, -1>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
      if constexpr (kRescaleBeforeGemm) softmax.rescale(tOrO_rc, o_scale);
      pipeline_v.consumer_wait(read_v);
      gemm_pv(read_v.index());
      named_barrier_arrive(2 * 128, int(FwdBarrier::kWarpGroup0) + next_warp_group);
      warpgroup_wait<1>();  // batches retire in order: S is ready, P V may still run
      warpgroup_fence_operand(tSrS);
      release(pipeline_k, read);
      modify(n);
      if constexpr (decltype(masked)::value) mask(n);
      if constexpr (kRescaleBeforeGemm) {
        o_scale = softmax.template update</*first=*/false>(tSrS_rc, row_off);
      } else {
        rescale_o = softmax.update_lazy(tSrS_rc, o_scale, row_off);
      }
      warpgroup_wait<0>();  // P V done: tOrP may be overwritten, V's stage released
      warpgroup_fence_operand(tOrO);
      if constexpr (kTwoLevel) warpgroup_fence_operand(tOrOp);
      release(pipeline_v, read_v);
      // After the wait: ahead of it, the P V GEMM's operand (32 registers) is live beside the pass.
      drop(n);
      convert_p();
      if constexpr (kTwoLevel) add_block();
      if constexpr (!kRescaleBeforeGemm) {
        if (rescale_o) {
          asm volatile("pmevent 0;");
          softmax.rescale(tOrO_rc, o_scale);
        }
      }
    };

    // Descending. Causal: the blocks crossing the diagonal (masked), then the rest without a mask. Windows:
    // one loop whose (uniform) branch picks the masked or the mask-free copy of step(): each copy keeps a
    // single call site, since a third one makes nvcc outline step() and the GEMM registers spill around it.
    --n_block;
    if constexpr (kSparse) {
      // Partial blocks (on top) take the element mask; a full block only where it holds the key end.
      for (; n_block >= 0; --n_block) {
        if (walk.is_partial(n_block) || (walk.block(params.block_sparse, n_block) + 1) * kBlockN > bm.seqlen_k) {
          step(n_block, cute::true_type{});
        } else {
          step(n_block, cute::false_type{});
        }
      }
    } else if constexpr (kLocal) {
      const int right_mask_min = bm.n_block_right_mask_min(m_block);
      const int left_mask_max = bm.n_block_left_mask_max(m_block);
      for (; n_block >= n_block_min; --n_block) {
        if (n_block >= right_mask_min || n_block < left_mask_max) {
          if (thread_idx == 0 && n_block < left_mask_max) trace.stamp(TraceSlot::kEdgeStepStart);
          step(n_block, cute::true_type{});
          if (thread_idx == 0 && n_block < left_mask_max) trace.stamp(TraceSlot::kEdgeStepEnd);
        } else {
          step(n_block, cute::false_type{});
        }
        if (thread_idx == 0 && n_block == n_block_max - 2) trace.stamp(TraceSlot::kFirstLoopStep);
      }
    } else {
      if constexpr (kCausal) {
        const int n_masked_min = bm.n_block_right_mask_min(m_block);
        for (; n_block >= 0 && n_block >= n_masked_min; --n_block) step(n_block, cute::true_type{});
      }
      for (; n_block >= 0; --n_block) {
        step(n_block, cute::false_type{});
        if (thread_idx == 0 && n_block == n_block_max - 2) trace.stamp(TraceSlot::kFirstLoopStep);
      }
    }

    // Tail: the last P V, with the row-sum reduction overlapped.
    if (thread_idx == 0) trace.stamp(TraceSlot::kLoopDone);
    if (thread_idx == 128) trace.stamp(TraceSlot::kWg1LoopDone);
    q_done();
    if constexpr (kRescaleBeforeGemm) softmax.rescale(tOrO_rc, o_scale);
    pipeline_v.consumer_wait(read);
    gemm_pv(read.index());
    auto inv_sum = softmax.finalize(lse_scale, lse);
    if constexpr (Bias::kDrops) {
#pragma unroll
      for (int r = 0; r < int(inv_sum.size()); ++r) inv_sum[r] *= params.dropout.inv_keep;
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    if constexpr (kTwoLevel) warpgroup_fence_operand(tOrOp);
    release(pipeline_v, read);
    ++read;
    if constexpr (kTwoLevel) add_block();
    softmax.rescale(tOrO_rc, inv_sum);
  }
};

}  // namespace flash4

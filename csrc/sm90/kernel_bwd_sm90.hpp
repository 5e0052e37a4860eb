// sm90 backward kernel: one CTA per (key block, kv head, batch); warp roles and the CTA's life. The loads and
// steps are the mainloop's (mainloop_bwd_sm90.hpp), the dQ / dK / dV stores the epilogue's
// (epilogue_bwd_sm90.hpp); the tiling and the math are in kernel_traits_bwd_sm90.hpp.
//
// Warp roles as in the forward: warpgroup 0 produces (one thread issues TMA: K and V of the CTA's key block
// once, then Q, dO, lse_log2 and D per query block into a two-stage pipeline), warpgroups 1 and 2 consume, 64
// keys each; warp 1 of warpgroup 0 writes dQ (head dims <= 128). dK and dV stay in registers for the CTA's
// whole life (summed over the query heads of the GQA group, so no cross-CTA reduction is needed for them).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/tile_order.hpp"
#include "../common/trace.hpp"
#include "../params.h"
#include "epilogue_bwd_sm90.hpp"
#include "kernel_traits_bwd_sm90.hpp"
#include "mainloop_bwd_sm90.hpp"
#include "utils_sm90.hpp"

namespace flash4 {

using namespace cute;

// Iter: the block iterator (common/block_sparse.hpp); SparseList walks a block mask's transposed lists.
// Bias: the score bias (common/score_bias.hpp).
template <class Traits_, bool kCausal, bool kLocal, class Iter = DenseBand, class Bias = NoBias>
struct BwdKernelSm90 {
  using Traits = Traits_;
  using Mainloop = MainloopBwdSm90<Traits, kCausal, kLocal, Iter, Bias>;
  using Epilogue = EpilogueBwdSm90<Traits, kCausal, kLocal, Iter>;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNumThreads = Traits::kNumThreads;
  static_assert(setmaxnreg_fits(kNumThreads, Traits::kProducerRegs, Traits::kConsumerRegs));
  static constexpr int kSmemBytes = Traits::kSmemBytes;
  static constexpr bool kMasked = kCausal || kLocal;

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    TileOrder order;  // launch order of masked grids (tile_order.hpp)
    unsigned long long* trace;
  };

  static Params to_params(BwdParams const& p) {
    const dim3 g = grid(p);
    const int gqa = p.nheads_q / p.nheads_kv;
    const TileOrder order =
        kMasked ? TileOrder::make_bwd<kHeadDim>(int(g.x), int(g.y), int(g.z), Mainloop::tail_blocks(p), gqa)
                : TileOrder{};
    return {Mainloop::to_params(p), Epilogue::to_params(p), order, p.trace};
  }

  static dim3 grid(BwdParams const& p) { return dim3(Mainloop::num_n_blocks(p), p.nheads_kv, p.batch); }

  CUTE_DEVICE void operator()(Params const& params, char* smem_buf) const {
    using namespace cutlass;
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_buf);
    Mainloop mainloop;
    Epilogue epilogue;
    const int warp_group = canonical_warp_group_idx();
    const int warp_idx = canonical_warp_idx_sync();
    if (warp_idx == 0 && cute::elect_one_sync()) {
      smem.barrier_kv.init(/*arrive_count=*/1);
    }
    typename Traits::PipelineQdO pipeline = Mainloop::make_pipeline(smem, warp_group);
    __syncthreads();

    // Masked launches take heads in groups (tile_order.hpp); within a head the key blocks go in the order
    // Epilogue::n_block_of gives (descending for deterministic causal dQ).
    const int linear = linear_cta();
    const TraceRow trace{params.trace, linear};
    if (threadIdx.x == 0) trace.stamp(TraceSlot::kStart);
    const TileCoord tile = this_tile<kMasked>(params.order);
    const int n_block = Epilogue::n_block_of(params.epilogue, tile.block, int(gridDim.x));
    const int bidh_kv = tile.head, bidb = tile.batch;
    const typename Mainloop::Seq seq = Mainloop::seq_of(params.mainloop, bidb);
    // Packed batches: the grid covers the longest sequence; blocks past this one's keys have nothing to do.
    if (n_block * kBlockN >= seq.info.seqlen_k) return;
    if (threadIdx.x == 0 && params.trace != nullptr) {
      trace_info(params.trace, linear,
                 uint32_t(Mainloop::total_steps(params.mainloop.block_sparse, seq, bidh_kv, params.mainloop.head_ratio,
                                                n_block) /
                          params.mainloop.head_ratio));
    }
    if (warp_group == 0) {
      arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      const int warp = warp_idx % 4;
      if (warp == 0 && threadIdx.x == 0) {
        trace.stamp(TraceSlot::kProducerStart);
        auto state = cutlass::make_producer_start_state<typename Traits::PipelineQdO>();
        mainloop.load(params.mainloop, pipeline, smem, n_block, bidh_kv, seq, state, [](auto&&) {}, trace);
      }
      if constexpr (!Traits::kWide) {
        if (warp == 1) {
          epilogue.store_dq(params.epilogue, smem, n_block, bidh_kv, params.mainloop.head_ratio, seq);
          bulk_wait_all();  // async groups are per thread: the lane that issued them waits, the others pass
          if (cute::elect_one_sync()) trace.stamp(TraceSlot::kEpilogueDone);
        }
      }
    } else {
      arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
      const int thread_idx = int(threadIdx.x) - 128;
      if (thread_idx == 0) trace.stamp(TraceSlot::kConsumerRegs);
      typename Traits::TiledMmadKV mma_dkv;
      typename Traits::TiledMmadV mma_dv;  // mma_dkv's type unless MLA (v's head dim below q / k's)
      Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
      Tensor tdVrdV = partition_fragment_C(mma_dv, Shape<Int<kBlockN>, Int<Traits::kHeadDimV>>{});
      if constexpr (Traits::kWide) {
        mainloop.mma_wide(params.mainloop, pipeline, smem, epilogue, params.epilogue, tdKrdK, tdVrdV, thread_idx,
                          n_block, bidh_kv, seq);
      } else {
        typename Traits::PipelineState read;
        mainloop.mma(params.mainloop, pipeline, smem, epilogue, tdKrdK, tdVrdV, thread_idx, n_block, bidh_kv, seq,
                     read, /*kv_phase=*/0, [] {}, trace);
      }
      epilogue.store(params.epilogue, smem, tdKrdK, tdVrdV, thread_idx, n_block, bidh_kv, seq);
      if (thread_idx == 0) trace.stamp(TraceSlot::kMmaDone);
      if (thread_idx == 128) trace.stamp(TraceSlot::kWg1MmaDone);
    }
  }
};

}  // namespace flash4

// sm90 forward kernel: one CTA per (query tile, head, batch). Warp roles:
//   warpgroup 0        producer: one thread issues TMA loads (Q once, then K/V blocks two stages ahead);
//                      the warpgroup gives its registers away with setmaxnreg.
//   warpgroups 1, 2 (3) consumers: 64 query rows each (three at hdim 64: 192-row tiles); WGMMA for both GEMMs,
//                      softmax on the CUDA cores, then the epilogue.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../common/block_info.hpp"
#include "../common/softmax.hpp"
#include "../common/tile_order.hpp"
#include "../common/trace.hpp"
#include "epilogue_fwd_sm90.hpp"
#include "mainloop_fwd_sm90.hpp"

namespace flash4 {

using namespace cute;

// Iter: the block iterator (common/block_sparse.hpp); SparseList walks a block mask's lists. Bias: the score
// bias (common/score_bias.hpp).
template <class Traits_, bool kCausal, bool kLocal, bool kSoftcap, class Iter = DenseBand, class Bias = NoBias>
struct FwdKernelSm90 {
  using Traits = Traits_;
  using Mainloop = MainloopFwdSm90<Traits, kCausal, kLocal, kSoftcap, Iter, Bias>;
  static constexpr bool kSparse = Mainloop::kSparse;
  using Epilogue = EpilogueFwdSm90<Traits>;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kNumThreads = Traits::kNumThreads;
  static_assert(setmaxnreg_fits(kNumThreads, Traits::kProducerRegs, Traits::kConsumerRegs));
  static constexpr int kSmemBytes = Traits::kSmemBytes;

  static constexpr bool kMasked = kCausal || kLocal;
  static constexpr int kBlockM = Traits::kBlockM;

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    float lse_scale;     // turns the running max of the scores back into natural-log units
    TileOrder order;     // launch order of masked grids (tile_order.hpp)
    int prefetch_ahead;  // see FwdParams::num_sms; 0 = off
    unsigned long long* trace;
    const float* sinks;  // (nheads_q,) or null (FwdParams::sinks)
  };

  // Sliding windows: the query tiles whose window the sequence start cuts see fewer keys than the rest; they
  // go last (tile_order.hpp; the persistent kernel takes the same order). A window wider than half the
  // sequence grows like causal: the grouped order stays (the tail takes every head at once, and a tail of
  // causal-like tiles would stream all heads' K / V).
  static int tail_blocks(FwdParams const& p) {
    if (!kLocal) return 0;
    const int num_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
    const int rows_cut = p.window_left - (p.seqlen_k - p.seqlen_q);  // query rows whose window starts before key 0
    const int tail = rows_cut <= 0 ? 1 : rows_cut / kBlockM + 2;
    return 2 * tail <= num_blocks ? tail : 0;
  }

  static Params to_params(FwdParams const& p) {
    const dim3 g = grid(p);
    const TileOrder order =
        kMasked ? TileOrder::make<Traits::kHeadDim>(int(g.x), int(g.y), int(g.z), tail_blocks(p)) : TileOrder{};
    return {Mainloop::to_params(p), Epilogue::to_params(p), p.lse_scale(), order,
            p.num_sms, p.trace, p.sinks};
  }

  static dim3 grid(FwdParams const& p) {
    return dim3((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.nheads_q, p.batch);
  }

  CUTE_DEVICE void operator()(Params const& params, char* smem_buf) const {
    using namespace cutlass;
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_buf);
    Mainloop mainloop;
    Epilogue epilogue;

    const int warp_group = canonical_warp_group_idx();
    const int warp_idx = canonical_warp_idx_sync();

    if (warp_idx == 0 && cute::elect_one_sync()) {
      Mainloop::prefetch_descriptors(params.mainloop);
      Epilogue::prefetch_descriptors(params.epilogue);
      smem.barrier_q.init(/*arrive_count=*/1);
    }
    auto [pipeline_k, pipeline_v] = Mainloop::make_pipelines(smem, warp_group);
    __syncthreads();

    // Masked launches: heads in groups, the heaviest tiles of a group first (tile_order.hpp). Causal and
    // window tiles near the bottom see the most keys.
    const int linear = linear_cta();
    const TraceRow trace{params.trace, linear};
    if (threadIdx.x == 0) trace.stamp(TraceSlot::kStart);
    const TileCoord tile = this_tile<kMasked>(params.order);
    const int m_block = kMasked ? int(gridDim.x) - 1 - tile.block : tile.block;
    const int bidh = tile.head;
    const int bidb = tile.batch;
    const SeqInfo seq = Mainloop::seq_info(params.mainloop, bidb);
    // Packed batches: the grid covers the longest sequence; tiles past this one's end have nothing to do.
    if (m_block * kBlockM >= seq.seqlen_q) return;
    const auto bm = Mainloop::block_mask(params.mainloop, seq);
    const auto walk = Mainloop::walk(params.mainloop, seq, bidb, bidh, m_block);
    int n_block_min = 0, n_block_max = 0;  // virtual blocks (Mainloop::walk)
    if constexpr (kSparse) {
      n_block_max = walk.count();
    } else {
      n_block_min = bm.n_block_min(m_block), n_block_max = bm.n_block_max(m_block);
    }
    const bool any_key = n_block_max > n_block_min;
    if (threadIdx.x == 0) trace_info(params.trace, linear, uint32_t(n_block_max - n_block_min));

    if (warp_group == 0) {
      arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      if (threadIdx.x == 0) {
        trace.stamp(TraceSlot::kProducerStart);
        auto prefetch_next = [&] {
          trace.stamp(TraceSlot::kProducerIssued);
          // Head dims > 128 leave it out: there it spilled 8 B in the 24-register producer, and their tiles,
          // longer in time, hide less of a tile's start (not measured).
          // A sparse tile's first block is a list lookup away: not prefetched.
          if constexpr (Traits::kHeadDim <= 128 && !kSparse) {
            if (params.prefetch_ahead > 0) prefetch_tile(params, mainloop, smem, linear + params.prefetch_ahead);
          }
        };
        if (any_key) {
          auto state = cutlass::make_producer_start_state<typename Traits::PipelineK>();
          mainloop.load(params.mainloop, pipeline_k, pipeline_v, smem, m_block, bidh, seq, n_block_min, n_block_max,
                        state, [] {}, prefetch_next, walk);
        } else {
          prefetch_next();
        }
      }
    } else {
      arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
      const int thread_idx = int(threadIdx.x) - 128;
      if (thread_idx == 0) trace.stamp(TraceSlot::kConsumerRegs);
      typename Traits::TiledMmaPV tiled_mma_pv;
      Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
      constexpr int kRows = decltype(size<0, 1>(tOrO))::value * decltype(size<1>(tOrO))::value;
      // fp8: the descales of this (batch, head) scale the raw scores (and the LSE) and the output.
      const float descale = Mainloop::score_descale(params.mainloop, bidb, bidh);
      typename Mainloop::template Softmax<kRows> softmax(params.mainloop.scale_log2 * descale);
      cute::array<float, kRows> lse;
      if (any_key) {
        typename Traits::PipelineState read;
        mainloop.mma(params.mainloop, pipeline_k, pipeline_v, smem, tOrO, softmax, lse, params.lse_scale * descale,
                     thread_idx, m_block, bm, n_block_min, n_block_max, read, /*q_phase=*/0, /*first_mma=*/true,
                     trace, [] {}, walk, Mainloop::bias(params.mainloop, seq, bidb, bidh));
        if constexpr (Traits::kFp8) {
          const float v_descale = Mainloop::out_descale(params.mainloop, bidb, bidh);
#pragma unroll
          for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= v_descale;
        }
      } else {
        clear(tOrO);  // no key visible to any row of this tile: out = 0, lse = -inf
        softmax.finalize(params.lse_scale, lse);
      }
      if (params.sinks != nullptr) {
        Tensor tOrO_rc = make_tensor(tOrO.data(), acc_rowcol_layout(tOrO.layout()));
        apply_sink(tOrO_rc, lse, params.sinks[bidh]);
      }
      if (thread_idx == 0) trace.stamp(TraceSlot::kMmaDone);
      if (thread_idx == 128) trace.stamp(TraceSlot::kWg1MmaDone);
      epilogue.store(params.epilogue, smem, tOrO, lse, thread_idx, m_block, bidh, seq);
      if (thread_idx == 0) trace.stamp(TraceSlot::kEpilogueDone);
      if (thread_idx == 128) trace.stamp(TraceSlot::kWg1EpilogueDone);
    }
  }

  // The tile of launch index `linear` (another CTA's, if the grid has it) into L2: its Q and first K / V block.
  template <class SharedStorage>
  CUTE_DEVICE static void prefetch_tile(Params const& params, Mainloop const& mainloop, SharedStorage& smem,
                                        int linear) {
    if (linear >= int(gridDim.x * gridDim.y * gridDim.z)) return;
    const TileCoord tile = tile_at<kMasked>(params.order, linear);
    const int m_block = kMasked ? int(gridDim.x) - 1 - tile.block : tile.block;
    const SeqInfo seq = Mainloop::seq_info(params.mainloop, tile.batch);
    if (m_block * kBlockM >= seq.seqlen_q) return;
    const auto bm = Mainloop::block_mask(params.mainloop, seq);
    const int n_block_max = bm.n_block_max(m_block);
    if (n_block_max <= bm.n_block_min(m_block)) return;
    mainloop.prefetch(params.mainloop, smem, m_block, tile.head, seq, n_block_max - 1);
  }
};

}  // namespace flash4

// sm90 forward kernel: one CTA per (query tile, head, batch). Warp roles:
//   warpgroup 0        producer: one thread issues TMA loads (Q once, then K/V blocks two stages ahead);
//                      the warpgroup gives its registers away with setmaxnreg.
//   warpgroups 1 and 2 consumers: 64 query rows each; WGMMA for both GEMMs, softmax on the CUDA cores,
//                      then the epilogue.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../common/block_info.hpp"
#include "../common/softmax.hpp"
#include "../common/tile_order.hpp"
#include "epilogue_fwd_sm90.hpp"
#include "mainloop_fwd_sm90.hpp"

namespace flash4 {

using namespace cute;

template <class Traits_, bool kCausal, bool kLocal, bool kSoftcap>
struct FwdKernelSm90 {
  using Traits = Traits_;
  using Mainloop = MainloopFwdSm90<Traits, kCausal, kLocal, kSoftcap>;
  using Epilogue = EpilogueFwdSm90<Traits>;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kNumThreads = Traits::kNumThreads;
  static constexpr int kSmemBytes = Traits::kSmemBytes;

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    float lse_scale;  // turns the running max of the scores back into natural-log units
  };

  static Params to_params(FwdParams const& p) {
    return {Mainloop::to_params(p), Epilogue::to_params(p), p.lse_scale()};
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
    typename Traits::PipelineK::Params pipe_params;
    pipe_params.transaction_bytes = Traits::kTmaBytesKV;
    pipe_params.role = warp_group == 0 ? Traits::PipelineK::ThreadCategory::Producer
                                       : Traits::PipelineK::ThreadCategory::Consumer;
    pipe_params.is_leader = threadIdx.x == 0;  // the producer thread below
    pipe_params.num_consumers = Traits::kNumMmaWarpGroups;  // see `release` in the mainloop
    // The constructors initialize the barriers (warp 0) and fence the initialization.
    typename Traits::PipelineK pipeline_k(smem.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
    typename Traits::PipelineV pipeline_v(smem.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
    __syncthreads();

    // Masked launches: heads in groups, the heaviest tiles of a group first (tile_order.hpp). Causal and
    // window tiles near the bottom see the most keys.
    const TileCoord tile = this_tile<Traits::kHeadDim, kCausal || kLocal>();
    const int m_block = (kCausal || kLocal) ? int(gridDim.x) - 1 - tile.block : tile.block;
    const int bidh = tile.head;
    const int bidb = tile.batch;
    const SeqInfo seq = Mainloop::seq_info(params.mainloop, bidb);
    // Packed batches: the grid covers the longest sequence; tiles past this one's end have nothing to do.
    if (m_block * Traits::kBlockM >= seq.seqlen_q) return;
    const auto bm = Mainloop::block_mask(params.mainloop, seq);
    const int n_block_min = bm.n_block_min(m_block), n_block_max = bm.n_block_max(m_block);
    const bool any_key = n_block_max > n_block_min;

    if (warp_group == 0) {
      arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      if (threadIdx.x == 0 && any_key) {
        mainloop.load(params.mainloop, pipeline_k, pipeline_v, smem, m_block, bidh, seq, n_block_min, n_block_max);
      }
    } else {
      arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
      const int thread_idx = int(threadIdx.x) - 128;
      typename Traits::TiledMmaPV tiled_mma_pv;
      Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
      constexpr int kRows = decltype(size<0, 1>(tOrO))::value * decltype(size<1>(tOrO))::value;
      OnlineSoftmax<kRows> softmax(params.mainloop.scale_log2);
      cute::array<float, kRows> lse;
      if (any_key) {
        mainloop.mma(params.mainloop, pipeline_k, pipeline_v, smem, tOrO, softmax, lse, params.lse_scale,
                     thread_idx, m_block, bm, n_block_min, n_block_max);
      } else {
        clear(tOrO);  // no key visible to any row of this tile: out = 0, lse = -inf
        softmax.finalize(params.lse_scale, lse);
      }
      epilogue.store(params.epilogue, smem, tOrO, lse, thread_idx, m_block, bidh, seq);
    }
  }
};

}  // namespace flash4

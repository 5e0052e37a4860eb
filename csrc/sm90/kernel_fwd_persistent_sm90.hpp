// sm90 forward, persistent: one CTA per SM walks the tiles of the launch order (tile_order.hpp), so that the
// work between two tiles overlaps instead of running alone. Used for sliding windows, whose tiles are short:
// traces of the one-CTA-per-tile kernel (tools/trace_tiles.py) put ~5k of a
// 4096-window tile's ~84k cycles between tiles (CTA start and launch order, Q's load, the gap to the next CTA)
// and ~1k in the wait for O's TMA store.
//
// What carries from tile to tile:
//   * the K / V pipelines' states (producer and consumers), so loads of the next tile start while the
//     consumers finish the current one;
//   * Q: one buffer; the producer loads the next tile's Q once both consumer warpgroups signal q_empty at the
//     end of their main loop, so the load runs under the last P V and the epilogue;
//   * O: a buffer of its own (not Q's), left to its TMA store while the next tile runs;
//   * the ping-pong barrier (see MainloopFwdSm90::mma, first_mma);
//   * the tiles themselves: the producer works each one out and hands it to the consumers (tile_ring_sm90.hpp).
// Tiles go to CTAs in a static snake order (snake_tile, tile_order.hpp).
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
#include "kernel_fwd_sm90.hpp"  // tail_blocks
#include "mainloop_fwd_sm90.hpp"
#include "tile_ring_sm90.hpp"

namespace flash4 {

using namespace cute;

template <class Traits_, bool kCausal, bool kLocal, bool kSoftcap>
struct FwdPersistentKernelSm90 {
  using Traits = Traits_;
  using Element = typename Traits::Element;
  using Mainloop = MainloopFwdSm90<Traits, kCausal, kLocal, kSoftcap>;
  using Epilogue = EpilogueFwdSm90<Traits>;
  static constexpr int kNumThreads = Traits::kNumThreads;
  static constexpr int kBlockM = Traits::kBlockM;
  // The launch order (tile_order.hpp) is what it walks; only the window kernels take it (launch_fwd_sm90.hpp).
  static_assert(kLocal, "the persistent forward walks the masked launch order of a sliding window");

  // A tile as the producer publishes it to the consumers (launch index -1: no tile left).
  struct PublishedTile {
    int linear, m_block, bidh, batch, n_block_min, n_block_max;
  };

  struct SharedStorage : Traits::SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<typename Traits::SmemLayoutO>> o;
    alignas(16) cutlass::arch::ClusterBarrier q_empty;  // both consumer warpgroups are done with Q
    TileRing<PublishedTile, Traits::kNumMmaThreads / 32> tile_ring;  // tiles with their sequence and key range
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "the persistent tile does not fit in shared memory");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    float lse_scale;
    TileOrder order;
    int num_m_blocks;  // query tiles per (head, batch): the launch order's block extent
    int num_tiles;
    unsigned long long* trace;
    const float* sinks;  // (nheads_q,) or null (FwdParams::sinks)
  };

  static int num_m_blocks(FwdParams const& p) { return (p.seqlen_q + kBlockM - 1) / kBlockM; }
  static int num_tiles(FwdParams const& p) { return num_m_blocks(p) * p.nheads_q * p.batch; }

  static Params to_params(FwdParams const& p) {
    // The same launch order as the one-CTA-per-tile kernel's (window tails last).
    const int tail = FwdKernelSm90<Traits, kCausal, kLocal, kSoftcap>::tail_blocks(p);
    const TileOrder order = TileOrder::make<Traits::kHeadDim>(num_m_blocks(p), p.nheads_q, p.batch, tail);
    return {Mainloop::to_params(p), Epilogue::to_params(p), p.lse_scale(), order, num_m_blocks(p),
            num_tiles(p), p.trace, p.sinks};
  }

  static dim3 grid(FwdParams const& p) { return dim3(unsigned(persistent_ctas(num_tiles(p), p.num_sms)), 1, 1); }

  // Launch index of this CTA's tile in round r (snake order, tile_order.hpp), or -1 past the last tile.
  CUTE_DEVICE static int tile_of_round(Params const& params, int r) { return snake_tile(r, params.num_tiles); }

  struct Tile {
    int m_block, bidh;
    SeqInfo seq;
    int n_block_min, n_block_max;
  };
  CUTE_DEVICE static Tile tile_at_linear(Params const& params, int linear) {
    const TileCoord t = params.order(linear);
    Tile tile;
    tile.m_block = params.num_m_blocks - 1 - t.block;  // heaviest first
    tile.bidh = t.head;
    tile.seq = Mainloop::seq_info(params.mainloop, t.batch);
    // Packed batches: the grid covers the longest sequence; tiles past this one's end have nothing to do.
    if (tile.m_block * kBlockM >= tile.seq.seqlen_q) {
      tile.n_block_min = tile.n_block_max = -1;
      return tile;
    }
    const auto bm = Mainloop::block_mask(params.mainloop, tile.seq);
    tile.n_block_min = bm.n_block_min(tile.m_block);
    tile.n_block_max = bm.n_block_max(tile.m_block);
    return tile;
  }
  CUTE_DEVICE static bool in_sequence(Tile const& t) { return t.n_block_max >= 0; }
  CUTE_DEVICE static bool any_key(Tile const& t) { return t.n_block_max > t.n_block_min; }

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
      smem.q_empty.init(/*arrive_count=*/Traits::kNumMmaWarpGroups);
      smem.tile_ring.init();
    }
    auto [pipeline_k, pipeline_v] = Mainloop::make_pipelines(smem, warp_group);
    __syncthreads();

    if (warp_group == 0) {
      arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      if (threadIdx.x != 0) return;
      auto state = cutlass::make_producer_start_state<typename Traits::PipelineK>();
      int q_loads = 0;  // Q loads issued so far: the consumers' q_empty phases to wait for
      for (int r = 0;; ++r) {
        const int linear = tile_of_round(params, r);
        // The tile is worked out only once the slot is free (before it, the 24-register producer spilled 108 B).
        PublishedTile& slot = smem.tile_ring.slot(r);
        if (linear < 0) {
          slot.linear = -1;
          smem.tile_ring.commit(r);
          break;
        }
        const Tile t = tile_at_linear(params, linear);
        slot = {linear, t.m_block, t.bidh, t.seq.batch, t.n_block_min, t.n_block_max};
        smem.tile_ring.commit(r);
        if (!in_sequence(t) || !any_key(t)) continue;
        const int done = q_loads;
        auto before_q = [&] {
          if (done > 0) smem.q_empty.wait((done - 1) & 1);
        };
        mainloop.load(params.mainloop, pipeline_k, pipeline_v, smem, t.m_block, t.bidh, t.seq, t.n_block_min,
                      t.n_block_max, state, before_q, [] {});
        ++q_loads;
      }
      return;
    }

    arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread_idx = int(threadIdx.x) - 128;
    typename Traits::TiledMmaPV tiled_mma_pv;
    typename Traits::PipelineState read;
    int q_loads = 0;
    for (int r = 0;; ++r) {
      const PublishedTile pub = smem.tile_ring.take(r, thread_idx);
      const int linear = pub.linear;
      if (linear < 0) break;
      const Tile t{pub.m_block, pub.bidh, Mainloop::seq_info(params.mainloop, pub.batch), pub.n_block_min,
                   pub.n_block_max};
      if (!in_sequence(t)) continue;
      // Trace builds: one row per tile (slot 1 its start, 5 / 7 the warpgroups' main loops done, 6 / 18 their
      // epilogues done; the rest in MainloopFwdSm90::mma).
      const TraceRow trace{params.trace, linear};
      if (thread_idx == 0) {
        trace_info(params.trace, linear, uint32_t(cute::max(0, t.n_block_max - t.n_block_min)));
        trace.stamp(TraceSlot::kStart);
      }
      Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
      constexpr int kRows = decltype(size<0, 1>(tOrO))::value * decltype(size<1>(tOrO))::value;
      OnlineSoftmax<kRows> softmax(params.mainloop.scale_log2);
      cute::array<float, kRows> lse;
      if (any_key(t)) {
        const auto bm = Mainloop::block_mask(params.mainloop, t.seq);
        // Once every Q K^T of this warpgroup has retired, the producer may load the next tile's Q, which then
        // loads under this tile's last P V and epilogue instead of after them (~0.4k cycles a window tile,
        // tools/trace_tiles.py).
        mainloop.mma(params.mainloop, pipeline_k, pipeline_v, smem, tOrO, softmax, lse, params.lse_scale,
                     thread_idx, t.m_block, bm, t.n_block_min, t.n_block_max, read, q_loads & 1, q_loads == 0,
                     trace, [&] {
                       if (thread_idx % 128 == 0) smem.q_empty.arrive();
                     });
        ++q_loads;
      } else {
        clear(tOrO);  // no key visible to any row of this tile: out = 0, lse = -inf
        softmax.finalize(params.lse_scale, lse);
      }
      if (params.sinks != nullptr) {
        Tensor tOrO_rc = make_tensor(tOrO.data(), acc_rowcol_layout(tOrO.layout()));
        apply_sink(tOrO_rc, lse, params.sinks[t.bidh]);
      }
      if (thread_idx == 0) trace.stamp(TraceSlot::kMmaDone);
      if (thread_idx == 128) trace.stamp(TraceSlot::kWg1MmaDone);
      epilogue.template store</*kAsync=*/true>(params.epilogue, smem, tOrO, lse, thread_idx, t.m_block, t.bidh,
                                               t.seq);
      if (thread_idx == 0) trace.stamp(TraceSlot::kEpilogueDone);
      if (thread_idx == 128) trace.stamp(TraceSlot::kWg1EpilogueDone);
    }
    if (thread_idx == 0) tma_store_wait<0>();  // O's last store must have read shared memory
  }
};

}  // namespace flash4

// sm90 backward, persistent (head dims <= 128, the tiling whose dQ writer warp it uses; see launch_bwd_sm90.hpp): one
// CTA per SM walks key tiles of the launch order (tile_order.hpp), so the work between two tiles overlaps instead
// of running alone. Two schedules:
//   * static snake order (the forward's, kernel_fwd_persistent_sm90.hpp) for sliding windows, whose tiles nearly
//     all cost the same;
//   * dynamic (causal and unmasked): the producer takes the next launch index from a global counter once it has
//     issued the current tile's loads, so causal's unequal tiles balance as the hardware's own CTA order
//     balances them. A list-scheduling model (steps + per-tile overhead, 132 SMs, the launch order's grouped
//     heaviest-first tiles) puts the static snake 7-24% over the hardware's order for causal from 2k tokens,
//     the dynamic one within 1% of the ideal makespan.
// Traces of the one-CTA-per-tile kernel (tools/trace_tiles.py) put ~10.2k cycles of a 4096-window tile outside
// its steps: start to K / V ready 4.6k, a slower first step 0.9k, the dK / dV store
// 3.4k and 1.2k between one CTA's end and the next one's start; this kernel's tiles spend ~5.6k there. With
// tiles of few steps (short or causal sequences) those cycles are a large share of the work.
//
// It composes the one-CTA kernel's pieces (MainloopBwdSm90's loads and steps, EpilogueBwdSm90's dQ writer) with
// its own dK / dV store (DkvTmaStoreSm90). What carries from tile to tile:
//   * the Q / dO pipeline states, so the next tile's first query blocks load under the current tile's last
//     steps and its store;
//   * the tiles themselves: the producer works each one out and hands it to the consumers and the dQ writer
//     (tile_ring_sm90.hpp);
//   * K / V: one buffer, loaded again (barrier_kv phase = tile parity) once both consumer warpgroups signal
//     kv_empty after their last GEMM of the tile, from L2 (prefetched a few steps earlier, when the producer
//     has issued the tile's last query blocks), so the load runs under the dK / dV store;
//   * dK and dV leave by TMA store, left running while the next tile starts (DkvTmaStoreSm90); the next tile
//     waits for both stores to have read shared memory before it writes dS or dQ.
// Deterministic mode stays deadlock-free under either schedule: a CTA takes launch indices in increasing order
// and a tile waits for turns of tiles launched before it only (EpilogueBwdSm90::n_block_of), which were taken
// earlier by CTAs that finish their earlier tiles first.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/fragment.hpp"
#include "../common/tile_order.hpp"
#include "../common/trace.hpp"
#include "epilogue_bwd_sm90.hpp"
#include "kernel_traits_bwd_sm90.hpp"
#include "mainloop_bwd_sm90.hpp"
#include "tile_ring_sm90.hpp"
#include "utils_sm90.hpp"

namespace flash4 {

using namespace cute;

template <class Traits_, bool kCausal, bool kLocal>
struct BwdPersistentKernelSm90 {
  using Traits = Traits_;
  using Mainloop = MainloopBwdSm90<Traits, kCausal, kLocal>;
  using Epilogue = EpilogueBwdSm90<Traits, kCausal, kLocal>;
  using DkvStore = DkvTmaStoreSm90<Traits>;
  using Element = typename Traits::Element;
  static constexpr int kNumThreads = Traits::kNumThreads;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static_assert(!Traits::kWide, "the persistent backward uses the dQ writer warp of the head dims <= 128 kernel");

  // A tile as the producer publishes it to the consumers (launch index -1: no tile left).
  struct PublishedTile {
    int linear, n_block, bidh_kv, batch;
  };

  struct SharedStorage : Traits::SharedStorage {
    alignas(16) cutlass::arch::ClusterBarrier kv_empty;  // both consumer warpgroups are done with K and V
    TileRing<PublishedTile, Traits::kNumMmaThreads / 32 + 1> tile_ring;  // the consumer warps and the dQ writer
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "the persistent tile does not fit in shared memory");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename DkvStore::Params store;
    TileOrder order;   // the one-CTA kernel's launch order (tile_order.hpp)
    int num_n_blocks;  // key tiles per (head, batch): the launch order's block extent
    int num_tiles;
    int* tile_counter;  // the dynamic schedule's launch indices taken after the first grid's (zeroed)
    unsigned long long* trace;
  };

  static int num_tiles(BwdParams const& p) { return Mainloop::num_n_blocks(p) * p.nheads_kv * p.batch; }

  static Params to_params(BwdParams const& p) {
    const int n_blocks = Mainloop::num_n_blocks(p);
    const TileOrder order = TileOrder::make_bwd<Traits::kHeadDim>(n_blocks, p.nheads_kv, p.batch,
                                                                 Mainloop::tail_blocks(p), p.nheads_q / p.nheads_kv);
    return {Mainloop::to_params(p), Epilogue::to_params(p), DkvStore::to_params(p), order, n_blocks, num_tiles(p),
            p.tile_counter, p.trace};
  }

  static dim3 grid(BwdParams const& p) { return dim3(unsigned(persistent_ctas(num_tiles(p), p.num_sms)), 1, 1); }

  struct Tile {
    int n_block, bidh_kv;
    typename Mainloop::Seq seq;
  };
  // As BwdKernelSm90::operator() maps its CTA; every tile lies inside its sequence (fixed-length batches only).
  // Unmasked attention keeps the one-CTA kernel's grid order (key block fastest): the key tiles of a head run
  // side by side and share its Q / dO reads and dq_accum lines in L2 (in the masked launch order, heads of a
  // group fastest, head dims 64 / 128 at 1k tokens ran 26-36% slower).
  CUTE_DEVICE static Tile tile_at_linear(Params const& params, int linear) {
    TileCoord t;
    if constexpr (kCausal || kLocal) {
      t = params.order(linear);
    } else {
      const int nb = params.num_n_blocks, heads = params.order.num_heads;
      t = {linear % nb, (linear / nb) % heads, linear / (nb * heads)};
    }
    return {Epilogue::n_block_of(params.epilogue, t.block, params.num_n_blocks), t.head,
            Mainloop::seq_of(params.mainloop, t.batch)};
  }
  // Launch index of this CTA's tile in round r, or -1 past the last tile (producer thread only, once a round, in
  // order): windows the snake order's, the others the counter's next (round 0: the CTA's own index, as the
  // hardware hands out).
  CUTE_DEVICE static int next_linear(Params const& params, int r) {
    if constexpr (kLocal) return snake_tile(r, params.num_tiles);
    const int linear = r == 0 ? int(blockIdx.x) : int(gridDim.x) + atomicAdd(params.tile_counter, 1);
    return linear < params.num_tiles ? linear : -1;
  }

  CUTE_DEVICE void operator()(Params const& params, char* smem_buf) const {
    using namespace cutlass;
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_buf);
    Mainloop mainloop;
    Epilogue epilogue;
    const int warp_group = canonical_warp_group_idx();
    const int warp_idx = canonical_warp_idx_sync();
    if (warp_idx == 0 && cute::elect_one_sync()) {
      smem.barrier_kv.init(/*arrive_count=*/1);
      smem.kv_empty.init(/*arrive_count=*/Traits::kNumMmaWarpGroups);
      smem.tile_ring.init();
    }
    typename Traits::PipelineQdO pipeline = Mainloop::make_pipeline(smem, warp_group);
    __syncthreads();

    if (warp_group == 0) {
      arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      const int warp = warp_idx % 4;
      if (warp == 0 && threadIdx.x == 0) {
        auto state = cutlass::make_producer_start_state<typename Traits::PipelineQdO>();
        auto publish = [&](int r, PublishedTile const& tile) {
          smem.tile_ring.slot(r) = tile;
          smem.tile_ring.commit(r);
        };
        int linear = next_linear(params, 0);
#pragma unroll 1
        for (int r = 0;; ++r) {
          if (linear < 0) {
            publish(r, {-1, 0, 0, 0});
            break;
          }
          // The next index is taken a tile ahead, so the atomic's latency runs under this tile's loads.
          const int next = next_linear(params, r + 1);
          const Tile t = tile_at_linear(params, linear);
          publish(r, {linear, t.n_block, t.bidh_kv, t.seq.info.batch});
          const TraceRow trace{params.trace, linear};
          trace.stamp(TraceSlot::kProducerStart);
          // K and V of the previous tile stay until both consumer warpgroups' last GEMMs of it have retired. The
          // producer gets here once it has issued the previous tile's last query blocks, a few steps before
          // that: this tile's K and V are fetched into L2 meanwhile, so that their load under the store hits.
          auto before_kv = [&](auto&& prefetch_kv) {
            if (r > 0) {
              prefetch_kv();
              smem.kv_empty.wait((r - 1) & 1);
            }
          };
          mainloop.load(params.mainloop, pipeline, smem, t.n_block, t.bidh_kv, t.seq, state, before_kv, trace);
          linear = next;
        }
      } else if (warp == 1) {
#pragma unroll 1
        for (int r = 0;; ++r) {
          const PublishedTile pub = smem.tile_ring.take(r, int(threadIdx.x));
          if (pub.linear < 0) break;
          epilogue.template store_dq</*kReleaseLast=*/true>(params.epilogue, smem, pub.n_block, pub.bidh_kv,
                                                                 params.mainloop.head_ratio,
                                                                 Mainloop::seq_of(params.mainloop, pub.batch));
          if (cute::elect_one_sync()) trace_stamp(params.trace, pub.linear, TraceSlot::kEpilogueDone);
        }
        bulk_wait_all();  // the lane that issued the reductions waits for them; the others pass
      }
      return;
    }

    arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread_idx = int(threadIdx.x) - 128;
    typename Traits::PipelineState read;
    // The steps (MainloopBwdSm90::mma) use all 240 registers. Everything derived from the thread index (fragment
    // coordinates, shared-memory addresses of mma() and the store) is the same in every tile, and hoisted out of
    // the tile loop it would stay live through the steps and spill into them: the index is made opaque per tile,
    // so it is derived again inside each.
#pragma unroll 1
    for (int r = 0;; ++r) {
      const PublishedTile pub = smem.tile_ring.take(r, thread_idx);
      const int linear = pub.linear;
      if (linear < 0) break;
      const int tidx = opaque_int(thread_idx);
      const Tile t{pub.n_block, pub.bidh_kv, Mainloop::seq_of(params.mainloop, pub.batch)};
      const TraceRow trace{params.trace, linear};
      int m_min, m_max;
      Mainloop::m_block_range(t.seq, t.n_block, m_min, m_max);
      if (tidx == 0) {
        trace_info(params.trace, linear, uint32_t(cute::max(0, m_max - m_min)));
        trace.stamp(TraceSlot::kStart);   // the tile's start: the previous tile's store is issued
        trace.stamp(TraceSlot::kConsumerRegs);  // (the one-CTA kernel's "registers allocated": nothing between here)
      }
      if (r > 0) DkvStore::wait_store_read(tidx);
      typename Traits::TiledMmadKV mma_dkv;
      Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Traits::kHeadDim>>{});
      Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Traits::kHeadDim>>{});
      auto after_gemms = [&] {
        if (tidx % 128 == 0) smem.kv_empty.arrive();
      };
      mainloop.mma(params.mainloop, pipeline, smem, epilogue, tdKrdK, tdVrdV, tidx, t.n_block, t.bidh_kv, t.seq, read,
                   r & 1, after_gemms, trace);
      DkvStore::store_async(params.store, smem, tdKrdK, tdVrdV, params.epilogue.softmax_scale, tidx, t.n_block,
                            t.bidh_kv, t.seq.info.batch, m_min < m_max);
      if (tidx == 0) trace.stamp(TraceSlot::kMmaDone);
      if (tidx == 128) trace.stamp(TraceSlot::kWg1MmaDone);
    }
    DkvStore::wait_store_read(thread_idx);  // shared memory stays valid until the last stores have read it
  }
};

}  // namespace flash4

// sm90 backward, persistent (head dims <= 128): one CTA per SM walks the key tiles of the launch order
// (tile_order.hpp) in the forward's static snake order (kernel_fwd_persistent_sm90.hpp), so the work between
// two tiles overlaps instead of running alone. Used for sliding windows, whose tiles nearly all cost the same.
// Traces of the one-CTA-per-tile kernel (docs/perf_notes.md, sessions 9 and 11) put ~10.2k cycles of a
// 4096-window tile outside its steps: start to K / V ready 4.6k, a slower first step 0.9k, the dK / dV store
// 3.4k and 1.2k between one CTA's end and the next one's start. Both the window and causal rows pay them on
// the same 4096 CTAs at 32k x 16 heads, which is what keeps the window's backward under 4x causal's speed.
//
// What carries from tile to tile (the steps themselves are BwdKernelSm90's):
//   * the Q / dO pipeline states, so the next tile's first query blocks load under the current tile's last
//     steps and its store;
//   * K / V: one buffer, loaded again (barrier_kv phase = tile parity) once both consumer warpgroups signal
//     kv_empty after their last GEMM of the tile, so the load runs under the dK / dV store;
//   * the dK / dV store stages through the dS buffers (whose last readers, the tile's dQ GEMMs, are done by
//     then), not Q / dO's, which may hold the next tile's query blocks, nor dQ's, which the writer warp may
//     still be reading: unpadded, 16-byte pieces swizzled, where the padded tile does not fit (head dim 128);
//   * the dQ buffer's empty barrier: the writer hands the buffer back after every block, so each tile's first
//     step takes the release of the previous tile's last block, and only the first tile needs the consumers'
//     stand-in (the release after the last tile is taken once the tile loop ends).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/tile_order.hpp"
#include "../common/trace.hpp"
#include "kernel_bwd_sm90.hpp"
#include "utils_sm90.hpp"

namespace flash4 {

using namespace cute;

template <class Traits_, bool kCausal, bool kLocal>
struct BwdPersistentKernelSm90 {
  using Base = BwdKernelSm90<Traits_, kCausal, kLocal>;
  using Traits = Traits_;
  using Element = typename Traits::Element;
  static constexpr int kNumThreads = Traits::kNumThreads;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static_assert(!Traits::kWide, "the persistent backward uses the dQ writer warp of the head dims <= 128 kernel");
  static_assert(kLocal, "the persistent backward walks the masked launch order of a sliding window");

  struct SharedStorage : Traits::SharedStorage {
    alignas(16) cutlass::arch::ClusterBarrier kv_empty;  // both consumer warpgroups are done with K and V
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "the persistent tile does not fit in shared memory");

  struct Params {
    typename Base::Params base;
    int num_n_blocks;  // key tiles per (head, batch): the launch order's block extent
    int num_tiles;
  };

  static int num_tiles(BwdParams const& p) {
    const dim3 g = Base::grid(p);
    return int(g.x * g.y * g.z);
  }

  static Params to_params(BwdParams const& p) {
    return {Base::to_params(p), int(Base::grid(p).x), num_tiles(p)};
  }

  static dim3 grid(BwdParams const& p) {
    const int sms = p.num_sms > 0 ? p.num_sms : 132;
    return dim3(unsigned(num_tiles(p) < sms ? num_tiles(p) : sms), 1, 1);
  }

  // Launch index of this CTA's tile in round r (snake order), or -1 past the last tile.
  CUTE_DEVICE static int tile_of_round(Params const& params, int r) {
    const int g = int(gridDim.x), k = int(blockIdx.x);
    const int linear = r * g + ((r & 1) ? g - 1 - k : k);
    return linear < params.num_tiles ? linear : -1;
  }

  struct Tile {
    int n_block, bidh_kv;
    typename Base::Seq seq;
  };
  // As BwdKernelSm90::operator() maps its CTA (deterministic causal dQ reverses the key blocks).
  CUTE_DEVICE static Tile tile_at_linear(Params const& params, int linear) {
    const TileCoord t = params.base.order(linear);
    const bool reversed = kCausal && params.base.dq_semaphore != nullptr;
    return {reversed ? params.num_n_blocks - 1 - t.block : t.block, t.head, Base::seq_of(params.base, t.batch)};
  }
  // Every role walks the same tiles in the same order; body(tile, linear, r), r counting the tiles before it.
  // Every tile lies inside its sequence: the launcher takes this kernel for fixed-length batches only.
  template <class Body>
  CUTE_DEVICE static void for_each_tile(Params const& params, Body&& body) {
#pragma unroll 1
    for (int r = 0;; ++r) {
      const int linear = tile_of_round(params, r);
      if (linear < 0) break;
      body(tile_at_linear(params, linear), linear, r);
    }
  }

  CUTE_DEVICE void operator()(Params const& params, char* smem_buf) const {
    using namespace cutlass;
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_buf);
    Base base;
    const int warp_group = canonical_warp_group_idx();
    const int warp_idx = canonical_warp_idx_sync();
    if (warp_idx == 0 && cute::elect_one_sync()) {
      smem.barrier_kv.init(/*arrive_count=*/1);
      smem.kv_empty.init(/*arrive_count=*/Traits::kNumMmaWarpGroups);
    }
    typename Traits::PipelineQdO pipeline = Base::make_pipeline(smem, warp_group);
    __syncthreads();

    if (warp_group == 0) {
      arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      const int warp = warp_idx % 4;
      if (warp == 0 && threadIdx.x == 0) {
        auto state = cutlass::make_producer_start_state<typename Traits::PipelineQdO>();
        for_each_tile(params, [&](Tile const& t, int linear, int r) {
          const TraceRow trace{params.base.trace, linear};
          trace.stamp(8);
          // K and V of the previous tile stay until both consumer warpgroups' last GEMMs of it have retired.
          auto before_kv = [&] {
            if (r > 0) smem.kv_empty.wait((r - 1) & 1);
          };
          base.load(params.base, pipeline, smem, t.n_block, t.bidh_kv, t.seq, state, before_kv, trace);
        });
      } else if (warp == 1) {
        for_each_tile(params, [&](Tile const& t, int linear, int) {
          base.template store_dq</*kReleaseLast=*/true>(params.base, smem, t.n_block, t.bidh_kv, t.seq);
          if (cute::elect_one_sync()) trace_stamp(params.base.trace, linear, 6);
        });
        bulk_wait_all();  // the lane that issued the reductions waits for them; the others pass
      }
      return;
    }

    arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread_idx = int(threadIdx.x) - 128;
    typename Traits::PipelineState read;
    bool stood_in = false;  // the dQ buffer's first release (BwdKernelSm90::mma's stand_in) has been given
    // The steps (BwdKernelSm90::mma) use all 240 registers. Everything derived from the thread index (fragment
    // coordinates, shared-memory addresses of mma() and store()) is the same in every tile, and hoisted out of
    // the tile loop it would stay live through the steps and spill into them: the index is made opaque per tile,
    // so it is derived again inside each.
#pragma unroll 1
    for (int r = 0;; ++r) {
      const int linear = tile_of_round(params, r);
      if (linear < 0) break;
      const int tidx = opaque_int(thread_idx);
      const Tile t = tile_at_linear(params, linear);
      const TraceRow trace{params.base.trace, linear};
      int m_min, m_max;
      Base::m_block_range(t.seq, t.n_block, m_min, m_max);
      if (tidx == 0) {
        trace_info(params.base.trace, linear, uint32_t(cute::max(0, m_max - m_min)));
        trace.stamp(1);   // the tile's start: the previous tile's store is done
        trace.stamp(10);  // (the one-CTA kernel's "registers allocated": nothing between here)
      }
      typename Traits::TiledMmadKV mma_dkv;
      Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Traits::kHeadDim>>{});
      Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Traits::kHeadDim>>{});
      auto after_gemms = [&] {
        if (tidx % 128 == 0) smem.kv_empty.arrive();
      };
      base.mma(params.base, pipeline, smem, tdKrdK, tdVrdV, tidx, t.n_block, t.seq, read, r & 1, !stood_in,
               after_gemms, trace);
      stood_in = stood_in || m_min < m_max;
      base.template store<kSwizzledStore>(params.base, smem.ds.data(), tdKrdK, tdVrdV, tidx, t.n_block,
                                          t.bidh_kv, t.seq);
      // Every thread has read the staging tile before the next tile writes dS over it.
      named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kEpilogue));
      if (tidx == 0) trace.stamp(5);
      if (tidx == 128) trace.stamp(7);
    }
    // The writer's release after the last block: taken, so that no barrier phase is left open at exit.
    if (stood_in) named_barrier_sync(128 + 32, int(BwdBarrier::kdQEmpty0) + thread_idx / 128);
  }

  // The dK / dV staging tile in the dS buffers: padded rows where they fit, else swizzled (exactly 128 x hdim).
  static constexpr int kDsBytes = int(sizeof(Traits::SharedStorage::ds));
  static constexpr bool kSwizzledStore = Base::kStoreTileBytes > kDsBytes;
  static_assert(kBlockN * Traits::kHeadDim * int(sizeof(Element)) <= kDsBytes,
                "the dK / dV staging tile must fit in the dS buffers");
};

}  // namespace flash4

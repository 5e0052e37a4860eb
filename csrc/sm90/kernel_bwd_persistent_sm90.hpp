// sm90 backward, persistent (head dims <= 128, the tiling whose dQ writer warp it uses; see launch_bwd_sm90.hpp): one
// CTA per SM walks the key tiles of the launch order (tile_order.hpp) in the forward's static snake order
// (kernel_fwd_persistent_sm90.hpp), so the work between two tiles overlaps instead of running alone. Used for
// sliding windows, whose tiles nearly all cost the same.
// Traces of the one-CTA-per-tile kernel (docs/perf_notes.md, sessions 9 and 11) put ~10.2k cycles of a
// 4096-window tile outside its steps: start to K / V ready 4.6k, a slower first step 0.9k, the dK / dV store
// 3.4k and 1.2k between one CTA's end and the next one's start. Both the window and causal rows pay them on
// the same 4096 CTAs at 32k x 16 heads, which is what keeps the window's backward under 4x causal's speed.
//
// What carries from tile to tile (the steps themselves are BwdKernelSm90's):
//   * the Q / dO pipeline states, so the next tile's first query blocks load under the current tile's last
//     steps and its store;
//   * the tiles themselves: the producer works each one out and hands it to the consumers (tile_ring_sm90.hpp);
//   * K / V: one buffer, loaded again (barrier_kv phase = tile parity) once both consumer warpgroups signal
//     kv_empty after their last GEMM of the tile, from L2 (prefetched a few steps earlier, when the producer
//     has issued the tile's last query blocks), so the load runs under the dK / dV store;
//   * dK and dV leave by TMA store, left running while the next tile starts: dK from a swizzled tile over the
//     dS buffers (whose last readers, the tile's dQ GEMMs, are done by then), dV from one over the dQ buffer
//     (once the writer warp has read the tile's last block out of it; it hands the buffer back after every
//     block here). Not through the Q / dO buffers, which may hold the next tile's query blocks. The next tile
//     waits for both stores to have read shared memory before it writes dS or dQ. (Staged through shared
//     memory and 16-byte stores as the one-CTA kernel does, the store took 4.6k cycles a tile here, against
//     3.4k there: docs/perf_notes.md, session 12.)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/fragment.hpp"
#include "../common/tile_order.hpp"
#include "../common/trace.hpp"
#include "kernel_bwd_sm90.hpp"
#include "tile_ring_sm90.hpp"
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

  // A tile as the producer publishes it to the consumers (launch index -1: no tile left).
  struct PublishedTile {
    int linear, n_block, bidh_kv, batch;
  };

  struct SharedStorage : Traits::SharedStorage {
    alignas(16) cutlass::arch::ClusterBarrier kv_empty;  // both consumer warpgroups are done with K and V
    TileRing<PublishedTile, Traits::kNumMmaThreads / 32> tile_ring;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "the persistent tile does not fit in shared memory");

  using TileKV = Shape<Int<kBlockN>, Int<Traits::kHeadDim>>;
  using SmemLayoutdKV = decltype(tile_to_shape(gmma_smem_atom<Element, Traits::kHeadDim, GMMA::Major::K>(), TileKV{}));
  using TmaStoreKV = decltype(make_tma_copy(
      SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), typename Base::ShapeT{}, typename Base::StrideT{}),
      SmemLayoutdKV{}, TileKV{}, _1{}));

  struct Params {
    typename Base::Params base;
    TmaStoreKV tma_dk, tma_dv;
    typename Base::ShapeT shape_kv;
    int num_n_blocks;  // key tiles per (head, batch): the launch order's block extent
    int num_tiles;
  };

  static int num_tiles(BwdParams const& p) {
    const dim3 g = Base::grid(p);
    return int(g.x * g.y * g.z);
  }

  static Params to_params(BwdParams const& p) {
    // Fixed-length batches only (see the launcher), so rows past seqlen_k are clipped by the TMA unit.
    const typename Base::ShapeT shape_kv = make_shape(p.seqlen_k, p.head_dim, p.nheads_kv, p.batch);
    auto tma = [&](void* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
      Tensor m = make_tensor(make_gmem_ptr(static_cast<Element*>(base)), shape_kv,
                             make_stride(row_stride, _1{}, head_stride, batch_stride));
      return make_tma_copy(SM90_TMA_STORE{}, m, SmemLayoutdKV{}, TileKV{}, _1{});
    };
    return {Base::to_params(p),
            tma(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride),
            tma(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride),
            shape_kv,
            int(Base::grid(p).x),
            num_tiles(p)};
  }

  static dim3 grid(BwdParams const& p) { return dim3(unsigned(persistent_ctas(num_tiles(p), p.num_sms)), 1, 1); }

  // Launch index of this CTA's tile in round r (snake order, tile_order.hpp), or -1 past the last tile.
  CUTE_DEVICE static int tile_of_round(Params const& params, int r) { return snake_tile(r, params.num_tiles); }

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

  // dK (times softmax_scale) and dV of tile t: 16-bit, stmatrix into their swizzled tiles (dK over the dS
  // buffers, dV over the dQ buffer once the writer is done with it), then TMA stores left running (see the top).
  template <class FragKV>
  CUTE_DEVICE static void store_async(Params const& params, SharedStorage& smem, FragKV& tdKrdK, FragKV& tdVrdV,
                                      int tidx, Tile const& t, bool had_steps) {
    typename Traits::TiledMmadKV mma_dkv;
    Tensor sdK = make_tensor(make_smem_ptr(smem.ds.data()), SmemLayoutdKV{});
    Tensor sdV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem.dq.data())), SmemLayoutdKV{});
    auto copy_dkv = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
    auto thr_copy = copy_dkv.get_thread_slice(tidx);
    Tensor out = make_tensor<Element>(tdKrdK.layout());
#pragma unroll
    for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= params.base.softmax_scale;
    convert_fragment(tdKrdK, out);
    // Both warpgroups' GEMMs of the tile (each one's dQ GEMM reads the other's dS) are done past this barrier.
    named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kEpilogue));
    copy(copy_dkv, thr_copy.retile_S(out), thr_copy.partition_D(sdK));
    convert_fragment(tdVrdV, out);
    // The dQ buffer: the writer's release of this warpgroup's half after the tile's last block, then of both
    // (each warpgroup's rows of the swizzled dV tile span both halves).
    if (had_steps) named_barrier_sync(128 + 32, int(BwdBarrier::kdQEmpty0) + tidx / 128);
    named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kEpilogue));
    copy(copy_dkv, thr_copy.retile_S(out), thr_copy.partition_D(sdV));
    cutlass::arch::fence_view_async_shared();  // stmatrix writes visible to the TMA unit (async proxy)
    named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kEpilogue));
    if (tidx == 0) {
      auto issue = [&](auto const& tma, auto const& s) {
        Tensor g = local_tile(tma.get_tma_tensor(params.shape_kv)(_, _, t.bidh_kv, t.seq.info.batch), TileKV{},
                              make_coord(t.n_block, _0{}));
        auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
        copy(tma, ts, tg);
      };
      issue(params.tma_dk, sdK);
      issue(params.tma_dv, sdV);
      tma_store_arrive();
    }
  }

  // Before a tile writes dS or dQ (and before exit): the previous tile's dK / dV stores have read them.
  CUTE_DEVICE static void wait_store_read(int tidx) {
    if (tidx == 0) tma_store_wait<0>();
    named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kEpilogue));
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
      smem.tile_ring.init();
    }
    typename Traits::PipelineQdO pipeline = Base::make_pipeline(smem, warp_group);
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
        int rounds = 0;
        for_each_tile(params, [&](Tile const& t, int linear, int r) {
          publish(r, {linear, t.n_block, t.bidh_kv, t.seq.info.batch});
          rounds = r + 1;
          const TraceRow trace{params.base.trace, linear};
          trace.stamp(8);
          // K and V of the previous tile stay until both consumer warpgroups' last GEMMs of it have retired. The
          // producer gets here once it has issued the previous tile's last query blocks, a few steps before
          // that: this tile's K and V are fetched into L2 meanwhile, so that their load under the store hits.
          auto before_kv = [&](auto&& prefetch_kv) {
            if (r > 0) {
              prefetch_kv();
              smem.kv_empty.wait((r - 1) & 1);
            }
          };
          base.load(params.base, pipeline, smem, t.n_block, t.bidh_kv, t.seq, state, before_kv, trace);
        });
        publish(rounds, {-1, 0, 0, 0});
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
    // The steps (BwdKernelSm90::mma) use all 240 registers. Everything derived from the thread index (fragment
    // coordinates, shared-memory addresses of mma() and the store) is the same in every tile, and hoisted out of
    // the tile loop it would stay live through the steps and spill into them: the index is made opaque per tile,
    // so it is derived again inside each.
#pragma unroll 1
    for (int r = 0;; ++r) {
      const PublishedTile pub = smem.tile_ring.take(r, thread_idx);
      const int linear = pub.linear;
      if (linear < 0) break;
      const int tidx = opaque_int(thread_idx);
      const Tile t{pub.n_block, pub.bidh_kv, Base::seq_of(params.base, pub.batch)};
      const TraceRow trace{params.base.trace, linear};
      int m_min, m_max;
      Base::m_block_range(t.seq, t.n_block, m_min, m_max);
      if (tidx == 0) {
        trace_info(params.base.trace, linear, uint32_t(cute::max(0, m_max - m_min)));
        trace.stamp(1);   // the tile's start: the previous tile's store is issued
        trace.stamp(10);  // (the one-CTA kernel's "registers allocated": nothing between here)
      }
      if (r > 0) wait_store_read(tidx);
      typename Traits::TiledMmadKV mma_dkv;
      Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Traits::kHeadDim>>{});
      Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Traits::kHeadDim>>{});
      auto after_gemms = [&] {
        if (tidx % 128 == 0) smem.kv_empty.arrive();
      };
      base.mma(params.base, pipeline, smem, tdKrdK, tdVrdV, tidx, t.n_block, t.seq, read, r & 1, after_gemms, trace);
      store_async(params, smem, tdKrdK, tdVrdV, tidx, t, m_min < m_max);
      if (tidx == 0) trace.stamp(5);
      if (tidx == 128) trace.stamp(7);
    }
    wait_store_read(thread_idx);  // shared memory stays valid until the last stores have read it
  }

  static_assert(cosize_v<SmemLayoutdKV> * sizeof(Element) <= sizeof(Traits::SharedStorage::ds) &&
                    cosize_v<SmemLayoutdKV> * sizeof(Element) <= sizeof(Traits::SharedStorage::dq),
                "the dK and dV tiles must fit in the dS and the dQ buffers");
};

}  // namespace flash4

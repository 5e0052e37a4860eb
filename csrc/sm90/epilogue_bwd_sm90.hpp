// sm90 backward epilogue: where dQ, dK and dV leave the consumer warpgroups.
//   dQ, head dims <= 128: every step, each consumer warpgroup hands its half to shared memory (stage_dq) and
//     warp 1 of the producer warpgroup reduce-adds it into the fp32 dq_accum with one bulk copy (store_dq),
//     off the MMA warps' critical path. Two named barriers per half (kdQEmpty / kdQFull) pass the buffer.
//   dQ, head dims 192 / 256: straight from the accumulators with 16-byte reductions (add_dq); the staging
//     buffer would not fit beside two Q / dO stages.
//   Deterministic mode: the key blocks of one (batch, head) add into a query block in a fixed order (turn()),
//     taking turns through a counter per query block, so the fp32 sums are formed the same way every run.
//   dK and dV, once per CTA: staged through the Q / dO buffers as 16-byte rows (store), or, in the persistent
//     kernel, by TMA stores left running under the next tile (DkvTmaStoreSm90).
// dq_accum keeps each 64-row block in the dQ accumulator's register order (float4 i of thread t of warpgroup
// w at w * kdQChunk + 4 * (i * 128 + t)); the post-pass (bwd_postprocess_sm90.hpp) undoes it.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/bwd_prepost.cuh"  // store_staged
#include "../common/fragment.hpp"
#include "../common/sync.hpp"
#include "../params.h"
#include "kernel_traits_bwd_sm90.hpp"
#include "mainloop_bwd_sm90.hpp"  // Seq, m_block_range
#include "utils_sm90.hpp"

namespace flash4 {

using namespace cute;

template <class Traits_, bool kCausal, bool kLocal, class Iter = DenseBand>
struct EpilogueBwdSm90 {
  using Traits = Traits_;
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using SharedStorage = typename Traits::SharedStorage;
  using Mainloop = MainloopBwdSm90<Traits, kCausal, kLocal, Iter>;
  // Block-sparse kernels have no deterministic mode (the host sends those calls elsewhere): turn() follows
  // the dense band's geometry.
  static constexpr bool kTurns = !Mainloop::kSparse;
  using Seq = typename Mainloop::Seq;
  using Mask = typename Mainloop::Mask;

  struct Params {
    float* dq_accum;
    int* dq_semaphore;  // deterministic mode's turn counters, or null
    void* dk;
    void* dv;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    int64_t accum_head_stride;  // scratch rows per (batch, head) slice (see BwdParams)
    float softmax_scale;
    BlockSparseParams block_sparse;  // the dQ writer walks the mainloop's query blocks
  };

  static Params to_params(BwdParams const& p) {
    return {p.dq_accum,
            p.dq_semaphore,
            p.dk,
            p.dv,
            p.dk_batch_stride,
            p.dk_row_stride,
            p.dk_head_stride,
            p.dv_batch_stride,
            p.dv_row_stride,
            p.dv_head_stride,
            p.accum_head_stride,
            p.softmax_scale,
            p.block_sparse};
  }

  // The key block of launch index `block` (of num_blocks). Deterministic causal dQ goes from the last key block
  // down (turn()), so key block n waits for n + 1: launching the key blocks in that order means every CTA
  // waits only for CTAs launched before it. In ascending order a sequence with more key blocks than resident
  // CTAs would have every resident CTA waiting for one that cannot start (a hang). Otherwise ascending: the
  // heavy causal blocks go first.
  CUTE_DEVICE static int n_block_of(Params const& params, int block, int num_blocks) {
    const bool reversed = kCausal && params.dq_semaphore != nullptr;
    return reversed ? num_blocks - 1 - block : block;
  }

  // Deterministic mode: the position of key block n_block among those that add into query block m_block.
  // Non-causal: increasing n. Causal: decreasing n, the order in which they reach m_block anyway (key block
  // n starts at the diagonal query block, two 64-row blocks below n - 1's), so none waits for a slower one.
  // Sliding windows: increasing n from the first key block that sees m_block. The key blocks that see
  // m_block are exactly [n_block_min(m_block), n_block_max(m_block)) of the forward's geometry.
  CUTE_DEVICE static int turn(Mask const& bm, int n_block, int m_block) {
    if constexpr (kCausal) {
      return bm.n_block_max(m_block) - 1 - n_block;
    } else {
      return n_block - bm.n_block_min(m_block);
    }
  }

  // Consumer side of the dQ hand-off (head dims <= 128). Before the first step: this warpgroup's dQ buffer
  // starts empty, and warp 0 stands in for the writer warp's first release (the writer skips its last one, or,
  // in the persistent kernel, the dK / dV store takes it, so every barrier phase started is completed).
  CUTE_DEVICE static void start_dq(int warp_group, int wg_thread) {
    if (wg_thread < 32) named_barrier_arrive(128 + 32, int(BwdBarrier::kdQEmpty0) + warp_group);
  }

  // Every step: dQ to this warpgroup's shared-memory chunk, once the writer warp has read the previous one, in
  // the accumulator's register order (float4 i of thread t at i * 128 + t: 16-byte stores, no bank conflicts).
  template <class FragdQ>
  CUTE_DEVICE static void stage_dq(SharedStorage& smem, FragdQ const& tdQrdQ, int warp_group, int wg_thread) {
    float4* sdQ = reinterpret_cast<float4*>(smem.dq.data() + warp_group * Traits::kdQChunk);
    named_barrier_sync(128 + 32, int(BwdBarrier::kdQEmpty0) + warp_group);
#pragma unroll
    for (int e = 0; e < size(tdQrdQ); e += 4) {
      sdQ[(e / 4) * 128 + wg_thread] = make_float4(tdQrdQ(e), tdQrdQ(e + 1), tdQrdQ(e + 2), tdQrdQ(e + 3));
    }
    cutlass::arch::fence_view_async_shared();  // visible to the bulk copy (async proxy)
    named_barrier_arrive(128 + 32, int(BwdBarrier::kdQFull0) + warp_group);
  }

  // Warp 1 of the producer warpgroup: per query block, waits for each consumer warpgroup's dQ half in
  // shared memory, reduce-adds it into dq_accum with one bulk copy, and hands the buffer back once read.
  // The last block's buffer is handed back only with kReleaseLast (the persistent kernel, whose consumers take
  // that release before they reuse the buffer); otherwise its barrier phase would stay open at exit.
  // Deterministic mode: key blocks of one (batch, head) add to a query block in a fixed order (turn()),
  // taking turns through a counter, so the fp32 sums are formed in the same order every run.
  template <bool kReleaseLast = false>
  CUTE_DEVICE void store_dq(Params const& params, SharedStorage& smem, int n_block, int bidh_kv, int head_ratio,
                            Seq const& seq) const {
    constexpr int kChunk = Traits::kdQChunk;
    const bool leader = cute::elect_one_sync();
    // The last query head with a step: its last step hands no buffer back (see above).
    int last_head = head_ratio - 1;
    if constexpr (Mainloop::kSparse) {
      for (int i = 0; i < head_ratio; ++i) {
        if (Mainloop::walk(params.block_sparse, seq, bidh_kv * head_ratio + i, n_block).count() > 0) last_head = i;
      }
    }
#pragma unroll 1  // 24 registers, as in load()
    for (int i = 0; i < head_ratio; ++i) {
      const int64_t row0 = seq.accum_row0 + (bidh_kv * head_ratio + i) * params.accum_head_stride;
      float* dq_accum = params.dq_accum + row0 * kHeadDim;
      int* semaphore = kTurns && params.dq_semaphore ? params.dq_semaphore + row0 / kBlockM : nullptr;
      const auto w = Mainloop::walk(params.block_sparse, seq, bidh_kv * head_ratio + i, n_block);
#pragma unroll 1
      for (int v = 0; v < w.count(); ++v) {
        const int m_block = w.block(params.block_sparse, v);
        const bool last = !kReleaseLast && i == last_head && v == w.count() - 1;
        if (semaphore != nullptr && leader) {
          while (load_acquire_gpu(semaphore + m_block) != turn(seq.bm, n_block, m_block)) {
          }
          fence_proxy_async_global();
        }
        __syncwarp();
#pragma unroll
        for (int w = 0; w < Traits::kNumMmaWarpGroups; ++w) {
          named_barrier_sync(128 + 32, int(BwdBarrier::kdQFull0) + w);
          if (leader) {
            bulk_reduce_add_f32(dq_accum + int64_t(m_block) * kBlockM * kHeadDim + w * kChunk,
                                smem.dq.data() + w * kChunk, kChunk * int(sizeof(float)));
            bulk_commit_group();
          }
        }
        if (leader) bulk_wait_group_read<1>();
        __syncwarp();
        if (!last) named_barrier_arrive(128 + 32, int(BwdBarrier::kdQEmpty0));
        if (leader) bulk_wait_group_read<0>();
        __syncwarp();
        if (!last) named_barrier_arrive(128 + 32, int(BwdBarrier::kdQEmpty0) + 1);
        if (semaphore != nullptr && leader) {
          bulk_wait_all();
          fence_proxy_async_global();
          release_increment_gpu(semaphore + m_block);
        }
      }
    }
  }

  // Head dims 192 / 256: this warpgroup's dQ rows of query head bidh in dq_accum, and their turn counters.
  struct DqRows {
    float* accum;
    int* semaphore;
  };
  CUTE_DEVICE static DqRows dq_rows(Params const& params, Seq const& seq, int bidh, int warp_group) {
    const int64_t row0 = seq.accum_row0 + bidh * params.accum_head_stride;
    return {params.dq_accum + row0 * kHeadDim + warp_group * Traits::kdQChunk,
            kTurns && params.dq_semaphore ? params.dq_semaphore + row0 / kBlockM : nullptr};
  }

  // Head dims 192 / 256: adds this step's dQ into dq_accum with 16-byte reductions, in the post-pass's order.
  template <class FragdQ>
  CUTE_DEVICE static void add_dq(DqRows const& dq, FragdQ const& tdQrdQ, Mask const& bm, int n_block, int m_block,
                                 int thread_idx) {
    const int wg_thread = thread_idx % 128;
    // dQ: deterministic mode takes turns as the narrow kernel's writer warp does (one poller, then
    // a barrier of both consumer warpgroups; release after every thread's reductions are visible).
    if (dq.semaphore != nullptr) {
      if (thread_idx == 0) {
        while (load_acquire_gpu(dq.semaphore + m_block) != turn(bm, n_block, m_block)) {
        }
      }
      named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kdQFull0));
    }
    float4* dst = reinterpret_cast<float4*>(dq.accum + int64_t(m_block) * kBlockM * kHeadDim);
#pragma unroll
    for (int e = 0; e < size(tdQrdQ); e += 4) {
      red_add_f32x4(dst + (e / 4) * 128 + wg_thread,
                    make_float4(tdQrdQ(e), tdQrdQ(e + 1), tdQrdQ(e + 2), tdQrdQ(e + 3)));
    }
    if (dq.semaphore != nullptr) {
      __threadfence();
      named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kdQFull0));
      if (thread_idx == 0) release_increment_gpu(dq.semaphore + m_block);
    }
  }

  // dK (scaled by softmax_scale: S = scale * Q K^T) and dV to global memory, rows past seqlen_k skipped, as
  // 16-byte row pieces through a staging tile over the Q and dO buffers (store_staged). Straight from the
  // accumulators (4-byte pairs, 8 rows a warp instruction) they took ~9.2k cycles a CTA on the H200, 7% of a
  // 4096-window CTA at hdim 128 (tools/trace_tiles.py). The persistent kernel stores by TMA instead
  // (DkvTmaStoreSm90 below).
  // MLA (v's head dim below q / k's): dV has its own accumulator shape (TiledMmadV, kHeadDimV columns).
  template <class FragK, class FragV>
  CUTE_DEVICE void store(Params const& params, SharedStorage& smem, FragK const& tdKrdK, FragV const& tdVrdV,
                         int thread_idx, int n_block, int bidh_kv, Seq const& seq) const {
    constexpr int kHeadDimV = Traits::kHeadDimV;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadV mma_dv;
    Tensor tdKcdK = mma_dkv.get_thread_slice(thread_idx).partition_C(
        make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    Tensor tdVcdV = mma_dv.get_thread_slice(thread_idx).partition_C(
        make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
    // The tile spans smem.q and smem.dout, adjacent members (1024-aligned, sizes multiples of 1024).
    constexpr int kTileBytes = kBlockN * staged_pitch<kHeadDim> * int(sizeof(Element));
    static_assert(sizeof(smem.q) % 1024 == 0 && kTileBytes <= int(sizeof(smem.q) + sizeof(smem.dout)),
                  "the dK / dV staging tile must fit in the Q and dO buffers");
    Element* tile = smem.q.data();
    auto sync = [] { named_barrier_sync(Traits::kNumMmaThreads, int(BwdBarrier::kEpilogue)); };
    // Both warpgroups' GEMMs (each one's dQ GEMM reads the other's dS, its dK GEMM the last Q stage) are done
    // past this barrier, and the producer has no load left in flight.
    sync();
    const int rows = seq.info.seqlen_k - n_block * kBlockN;
    auto write = [&](auto cols, auto const& coords, auto const& acc, void* base, int64_t batch_stride,
                     int64_t row_stride, int64_t head_stride, float scale) {
      Element* out = static_cast<Element*>(base) + seq.info.batch * batch_stride + bidh_kv * head_stride +
                     (int64_t(seq.info.offset_k) + n_block * kBlockN) * row_stride;
      store_staged<Element, kBlockN, decltype(cols)::value, Traits::kNumMmaThreads>(
          coords, [&](int e) { return acc(e); }, scale, out, row_stride, rows, tile, 0, thread_idx, sync);
    };
    write(Int<kHeadDim>{}, tdKcdK, tdKrdK, params.dk, params.dk_batch_stride, params.dk_row_stride,
          params.dk_head_stride, params.softmax_scale);
    sync();  // every thread has read dK's rows out of the tile
    write(Int<kHeadDimV>{}, tdVcdV, tdVrdV, params.dv, params.dv_batch_stride, params.dv_row_stride,
          params.dv_head_stride, 1.f);
  }

};

// The persistent backward's dK / dV: TMA stores from swizzled tiles, left running while the next tile starts.
// dK goes from a tile over the dS buffers (whose last readers, the tile's dQ GEMMs, are done by then), dV from
// one over the dQ buffer (once the writer warp has read the tile's last block out of it). Not through the Q / dO
// buffers, which may hold the next tile's query blocks. Staged through shared memory and 16-byte stores as the
// one-CTA kernel does, the store took 4.6k cycles a tile there, against 3.4k in the one-CTA kernel.
template <class Traits>
struct DkvTmaStoreSm90 {
  using Element = typename Traits::Element;
  using ShapeT = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen_k, head_dim, heads, batch)
  using StrideT = Stride<int64_t, _1, int64_t, int64_t>;
  using TileKV = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;
  using SmemLayoutdKV = decltype(tile_to_shape(gmma_smem_atom<Element, Traits::kHeadDim, GMMA::Major::K>(), TileKV{}));
  using TmaStoreKV = decltype(make_tma_copy(SM90_TMA_STORE{},
                                            make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeT{},
                                                        StrideT{}),
                                            SmemLayoutdKV{}, TileKV{}, _1{}));
  static_assert(cosize_v<SmemLayoutdKV> * sizeof(Element) <= sizeof(Traits::SharedStorage::ds) &&
                    cosize_v<SmemLayoutdKV> * sizeof(Element) <= sizeof(Traits::SharedStorage::dq),
                "the dK and dV tiles must fit in the dS and the dQ buffers");

  struct Params {
    TmaStoreKV tma_dk, tma_dv;
    ShapeT shape_kv;
  };

  static Params to_params(BwdParams const& p) {
    // Fixed-length batches only (see the launcher), so rows past seqlen_k are clipped by the TMA unit.
    const ShapeT shape_kv = make_shape(p.seqlen_k, p.head_dim, p.nheads_kv, p.batch);
    auto tma = [&](void* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
      Tensor m = make_tensor(make_gmem_ptr(static_cast<Element*>(base)), shape_kv,
                             make_stride(row_stride, _1{}, head_stride, batch_stride));
      return make_tma_copy(SM90_TMA_STORE{}, m, SmemLayoutdKV{}, TileKV{}, _1{});
    };
    return {tma(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride),
            tma(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride), shape_kv};
  }

  // dK (times softmax_scale) and dV of tile t: 16-bit, stmatrix into their swizzled tiles (dK over the dS
  // buffers, dV over the dQ buffer once the writer is done with it), then TMA stores left running
  // (kernel_bwd_persistent_sm90.hpp has the schedule around them).
  template <class SharedStorage, class FragKV>
  CUTE_DEVICE static void store_async(Params const& params, SharedStorage& smem, FragKV& tdKrdK, FragKV& tdVrdV,
                                      float softmax_scale, int tidx, int n_block, int bidh_kv, int batch,
                                      bool had_steps) {
    typename Traits::TiledMmadKV mma_dkv;
    Tensor sdK = make_tensor(make_smem_ptr(smem.ds.data()), SmemLayoutdKV{});
    Tensor sdV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem.dq.data())), SmemLayoutdKV{});
    auto copy_dkv = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
    auto thr_copy = copy_dkv.get_thread_slice(tidx);
    Tensor out = make_tensor<Element>(tdKrdK.layout());
#pragma unroll
    for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= softmax_scale;
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
        Tensor g = local_tile(tma.get_tma_tensor(params.shape_kv)(_, _, bidh_kv, batch), TileKV{},
                              make_coord(n_block, _0{}));
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

};

}  // namespace flash4

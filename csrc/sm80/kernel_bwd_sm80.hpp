// sm80 backward kernel (see kernel_traits_bwd_sm80.hpp for the math and the tiling): one CTA per (key
// block, kv head, batch). Per query block, with Q, dO, lse_log2 and D of this block already in shared memory:
//   wait;  S^T = K Q^T (masked scores -> -inf, only in the blocks that need it);  dP^T = V dO^T;  prefetch
//   the next block's Q, dO, lse_log2 and D (all cp.async) into the other buffer (one buffer, on cards with
//   99 KB a CTA: after the step's last read of Q and dO, see load_next);  P^T, dS^T in registers;
//   dV += P^T dO;  dS^T -> shared memory;
//   dQ = dS K, reduce-added into dq_accum;  dK += dS^T Q (its MMAs run while the reductions drain).
// dq_accum holds each 64-row block in the dQ accumulator's register order (element e of thread t at
// e * kNumThreads + t), so one warp-wide reduction covers one 128-byte line; the post-pass
// (bwd_postprocess_sm80.hpp) reads it back with the same partition. The pre-pass (common/bwd_prepost.cuh)
// and that post-pass bracket the kernel.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "../common/block_info.hpp"
#include "../common/block_sparse.hpp"
#include "../common/bwd_prepost.cuh"
#include "../common/fragment.hpp"
#include "../common/fast_math.hpp"
#include "../common/sync.hpp"
#include "../common/tile_order.hpp"
#include "../params.h"
#include "kernel_traits_bwd_sm80.hpp"
#include "utils_sm80.hpp"

namespace flash4 {

using namespace cute;

// kLocal: sliding window (BlockMask). kSoftcap: a kernel of its own, as in the sm80 forward: a softcap pass in
// the middle of the step, even when jumped over, splits the basic block that ptxas schedules the exp2/dS work in.
// kEven: seqlen_q and seqlen_k are multiples of the tile and the batch is not packed: loads without row
// predicates and, without causal/window, no mask code in the loop (as the sm80 forward's kEven).
// Iter: the block iterator (common/block_sparse.hpp): the query blocks of the band (DenseBand) or those a
// block mask's transposed lists name (SparseList; each step's mask from step_block_mask).
template <class Traits_, bool kCausal, bool kLocal = false, bool kSoftcap = false, bool kEven = false,
          class Iter = DenseBand>
struct BwdKernelSm80 {
  using Traits = Traits_;
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNumThreads = Traits::kNumThreads;
  // SparseList: the step cursor and the next steps' (head, query block, partial) in shared memory past the
  // traits' buffers (see operator()).
  static constexpr int kStepBytes = kIsSparse<Iter> ? 64 : 0;
  static constexpr int kSmemBytes = Traits::kSmemBytes + kStepBytes;
  using Params = BwdParams;  // plain pointers and strides
  using Mask = BlockMask<kBlockM, kBlockN, kCausal, kLocal>;
  static constexpr bool kSparse = kIsSparse<Iter>;
  using Walk = SparseWalk<kBlockM>;  // SparseList only

  static Params to_params(BwdParams const& p) { return p; }
  // dK and dV leave through shared memory as 16-byte row pieces (store_staged, from a function of its own)
  // instead of 4-byte pairs straight from the accumulators: a per-CTA cost, so it pays where CTAs are short.
  // Measured in one build, H200, forced sm80 path:
  // hdim 128 causal +1.5-3% (234 -> 239, 264 -> 272, 283 -> 291 TFLOP/s at 2k / 4k / 8k), hdim 128 non-causal
  // -0.3 to -1.3%, hdim 64 -2 to -5% (the function call changes the loop's register allocation), so only
  // hdim 128 causal takes it.
  static constexpr bool kStagedDKV = kCausal && !kLocal && kHeadDim == 128 && Traits::kSplit == 1;
  static dim3 grid(BwdParams const& p) { return dim3((p.seqlen_k + kBlockN - 1) / kBlockN, p.nheads_kv, p.batch); }

  // Deterministic mode: the position of key block n among those adding into query block m, as in the sm90
  // kernel (causal: the last key block first; the grid is then launched in that order, see operator()).
  CUTE_DEVICE static int turn(Mask const& bm, int n_block, int m_block) {
    if constexpr (kCausal) {
      return bm.n_block_max(m_block) - 1 - n_block;
    } else {
      return n_block - bm.n_block_min(m_block);
    }
  }

  // kStagedDKV's epilogue: this thread's dK and dV elements (scaled by scale_k and 1) into the rows x head_dim
  // tiles at out_k / out_v, through `smem` (two staging tiles).
  using TileKVShape = Shape<Int<kBlockN>, Int<Traits::kHeadDimKV>>;
  __device__ __noinline__ static void store_kv_staged(const float* dk, const float* dv, Element* out_k,
                                                        Element* out_v, int64_t k_stride, int64_t v_stride, int rows,
                                                        float scale_k, int col0, int tid_k, Element* smem) {
    typename Traits::TiledMmaKey mma;
    Tensor c = mma.get_thread_slice(tid_k).partition_C(make_identity_tensor(TileKVShape{}));
    constexpr int kStagedElems = kBlockN * staged_pitch<kHeadDim>;
    store_staged<Element, kBlockN, kHeadDim, kNumThreads>(c, [&](int e) { return dk[e]; }, scale_k, out_k, k_stride,
                                                          rows, smem, col0);
    store_staged<Element, kBlockN, kHeadDim, kNumThreads>(c, [&](int e) { return dv[e]; }, 1.f, out_v, v_stride,
                                                          rows, smem + kStagedElems, col0);
  }

  CUTE_DEVICE void operator()(Params const& p, char* smem_buf) const {
    // Causal + deterministic: key blocks start from the last, so that each CTA waits only for earlier ones.
    // Causal and window launches take heads in groups (tile_order.hpp); within a head the order above (and
    // windows' ascending one, whose turn() has key block n wait for n - 1) still holds.
    const TileCoord tile = this_tile<kHeadDim, kCausal || kLocal>();
    const bool reversed = kCausal && p.dq_semaphore != nullptr;
    const int n_block = reversed ? int(gridDim.x) - 1 - tile.block : tile.block;
    const int bidh_kv = tile.head, bidb = tile.batch;
    const int tid = threadIdx.x;
    // kSplit = 2 (head dims > 128): warp half `half` owns dK / dV columns [half * kHeadDimKV, ...); its threads
    // take part in the key-row GEMMs as threads tid_k of a 4-warp TiledMma (kernel_traits_bwd_sm80.hpp).
    constexpr int kSplit = Traits::kSplit, kHeadDimKV = Traits::kHeadDimKV;
    const int half = kSplit == 1 ? 0 : tid / Traits::kKeyThreads;
    const int tid_k = kSplit == 1 ? tid : tid % Traits::kKeyThreads;
    const int head_ratio = p.nheads_q / p.nheads_kv;
    // This sequence and its scratch rows, as the pre- and post-pass find them (prepost_row). Packed batches:
    // the grid covers the longest sequence; key blocks past this one's end have nothing to do.
    const PrePostRow head0 = prepost_row(p, 0, bidb);
    const SeqInfo seq = head0.seq;
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    if (n_block * kBlockN >= seqlen_k) return;
    auto accum_row = [&](int h) { return head0.accum_row0 + h * p.accum_head_stride; };
    const Mask bm(seqlen_q, seqlen_k, p.window_left, p.window_right);
    // Softcap: P = exp2(tanh(s * softcap_scale) * scale_log2 - lse_log2) (params.h, SeqMaskParams).
    const float scale_log2 = p.score_scale_log2(), softcap_scale = p.softcap_scale();
    const int m_min = bm.m_block_min(n_block), m_max = bm.m_block_max(n_block);
    const int num_m = cute::max(0, m_max - m_min);
    int steps = num_m * head_ratio;
    // SparseList: the steps walk (query head i, virtual block v of head i's walk w); advance() moves to the
    // next step, skipping heads whose lists are empty for this key block. The cursor runs one step ahead in
    // shared memory (thread 0 moves it at the end of each step, publishing step t + 2's (head, query block,
    // partial) in the slot step t read), so that registers carry a step's (head, query block) as the band's
    // loop does: a cursor in registers through the step spilled 56-80 bytes.
    auto head_walk = [&](int i) {
      return Walk(p.block_sparse, seq.batch, bidh_kv * head_ratio + i, n_block * kBlockN / kMaskBlock, seqlen_q);
    };
    struct Cursor {
      int i, v;
      Walk w;
    };
    struct Step {
      int bidh, m_block, partial;
    };
    auto advance = [&](Cursor& c) {
      if (++c.v < c.w.count()) return;
      c.v = 0;
      while (++c.i < head_ratio) {
        c.w = head_walk(c.i);
        if (c.w.count() > 0) return;
      }
    };
    auto step_of = [&](Cursor const& c) {
      return Step{bidh_kv * head_ratio + c.i, c.w.block(p.block_sparse, c.v), c.w.is_partial(c.v)};
    };

    // Shared memory: K, V, kStages x (Q, dO), dS^T, kStages x (lse_log2, D). (Local copies of the sizes: a
    // static data member named in device code must not be odr-used.)
    constexpr int kElemsKV = Traits::kElemsKV, kElemsQ = Traits::kElemsQ, kElemsdS = Traits::kElemsdS;
    constexpr int kStages = Traits::kStages;
    Element* smem = reinterpret_cast<Element*>(smem_buf);
    Tensor sK = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem + kElemsKV), typename Traits::SmemLayoutKV{});
    constexpr bool kdSInQ = Traits::kdSInQ;
    Element* q_base = smem + 2 * kElemsKV;
    Element* ds_base = kdSInQ ? q_base : q_base + 2 * kStages * kElemsQ;
    float* row_base = reinterpret_cast<float*>(q_base + 2 * kStages * kElemsQ + (kdSInQ ? 0 : kElemsdS));
    Step* step_slots = reinterpret_cast<Step*>(row_base + kStages * 2 * kBlockM);  // SparseList: [2]
    Cursor* cursor = reinterpret_cast<Cursor*>(step_slots + 2);
    static_assert(2 * sizeof(Step) + sizeof(Cursor) <= kStepBytes || !kSparse, "the step slots fit");
    Step first{};
    if constexpr (kSparse) {
      steps = 0;
      for (int i = 0; i < head_ratio; ++i) steps += head_walk(i).count();
      if (steps > 0) {
        Cursor c{0, -1, head_walk(0)};
        advance(c);
        first = step_of(c);
        if (tid == 0) {
          step_slots[0] = first;
          if (steps > 1) advance(c), step_slots[1] = step_of(c);
          *cursor = c;
        }
      }
    }
    auto stage_ptr = [&](int s, int which) { return q_base + (2 * s + which) * kElemsQ; };  // 0 Q, 1 dO
    Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
    Tensor sdSt = make_tensor(make_smem_ptr(ds_base), typename Traits::SmemLayoutdSt{});
    Tensor sdS = make_tensor(make_smem_ptr(ds_base), typename Traits::SmemLayoutdS{});

    auto gtensor = [&](const void* base, int64_t batch_stride, int64_t head_off, int64_t row_stride, int offset,
                       int rows) {
      auto ptr = static_cast<Element const*>(base) + seq.batch * batch_stride + head_off + offset * row_stride;
      return make_tensor(make_gmem_ptr(ptr), make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
    };
    typename Traits::GmemTiledCopy gmem_copy;
    auto gthr = gmem_copy.get_thread_slice(tid);

    // K and V of this CTA (keys past seqlen_k zeroed, never read).
    {
      Tensor mK = gtensor(p.k, p.k_batch_stride, bidh_kv * p.k_head_stride, p.k_row_stride, seq.offset_k, seqlen_k);
      Tensor mV = gtensor(p.v, p.v_batch_stride, bidh_kv * p.v_head_stride, p.v_row_stride, seq.offset_k, seqlen_k);
      Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
      Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
      Tensor cKV = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
      Tensor tKsK = gthr.partition_D(sK);
      Tensor tVsV = gthr.partition_D(sV);
      copy_rows<kEven>(gmem_copy, gthr.partition_S(gK), tKsK, cKV, seqlen_k - n_block * kBlockN);
      copy_rows<kEven>(gmem_copy, gthr.partition_S(gV), tVsV, cKV, seqlen_k - n_block * kBlockN);
    }

    // Step t covers query head bidh_kv * head_ratio + t / num_m, query block m_min + t % num_m; the loop
    // below walks (bidh, m_block) incrementally instead of dividing every step.
    auto load_step = [&](int bidh, int m_block, int s) {
      Tensor mQ = gtensor(p.q, p.q_batch_stride, bidh * p.q_head_stride, p.q_row_stride, seq.offset_q, seqlen_q);
      Tensor mdO =
          gtensor(p.dout, p.dout_batch_stride, bidh * p.dout_head_stride, p.dout_row_stride, seq.offset_q, seqlen_q);
      Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));
      Tensor gdO = local_tile(mdO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));
      Tensor sQ = make_tensor(make_smem_ptr(stage_ptr(s, 0)), typename Traits::SmemLayoutQ{});
      Tensor sdO = make_tensor(make_smem_ptr(stage_ptr(s, 1)), typename Traits::SmemLayoutQ{});
      Tensor cQ = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
      Tensor tQsQ = gthr.partition_D(sQ);
      Tensor tdOsdO = gthr.partition_D(sdO);
      copy_rows<kEven>(gmem_copy, gthr.partition_S(gQ), tQsQ, cQ, seqlen_q - m_block * kBlockM);
      copy_rows<kEven>(gmem_copy, gthr.partition_S(gdO), tdOsdO, cQ, seqlen_q - m_block * kBlockM);
      // lse_log2 and D: rows up to the 128-row padding exist in the scratch (+inf and 0 past seqlen_q). In the
      // same cp.async group as Q and dO: a plain load here stalled the issuing warps on global latency.
      if (tid < kBlockM) {
        const int64_t row = accum_row(bidh) + m_block * kBlockM + tid;
        float* rows = row_base + s * 2 * kBlockM + tid;
        SM80_CP_ASYNC_CACHEALWAYS<float>::copy(p.lse_log2[row], rows[0]);
        SM80_CP_ASYNC_CACHEALWAYS<float>::copy(p.dpsum[row], rows[kBlockM]);
      }
    };
    int bidh = bidh_kv * head_ratio, m_block = m_min;
    if constexpr (kSparse) bidh = first.bidh, m_block = first.m_block;
    if (steps > 0) load_step(bidh, m_block, 0);
    cp_async_fence();

    typename Traits::TiledMmaKey mma;
    auto thr = mma.get_thread_slice(tid_k);
    using TileS = Shape<Int<kBlockN>, Int<kBlockM>>;
    using TileKV = Shape<Int<kBlockN>, Int<kHeadDimKV>>;
    // This half's columns of a transposed (head_dim, queries) view: the B operand of dV += P^T dO, dK += dS^T Q.
    auto half_cols = [&](auto const& t) {
      return local_tile(t, Shape<Int<kHeadDimKV>, Int<kBlockM>>{}, make_coord(half, _0{}));
    };
    Tensor sQ0 = make_tensor(make_smem_ptr(stage_ptr(0, 0)), typename Traits::SmemLayoutQ{});
    Tensor sQt0 = make_tensor(make_smem_ptr(stage_ptr(0, 0)), typename Traits::SmemLayoutQt{});
    Tensor tSrK = thr.partition_fragment_A(sK);
    Tensor tSrV = thr.partition_fragment_A(sV);
    Tensor tSrQ = thr.partition_fragment_B(sQ0);     // also dO's
    Tensor tdKrQt = thr.partition_fragment_B(half_cols(sQt0));  // also dO^T's
    auto copy_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma);
    auto copy_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma);
    auto copy_bt = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma);
    Tensor tSsK = copy_a.get_thread_slice(tid_k).partition_S(sK);
    Tensor tSsV = copy_a.get_thread_slice(tid_k).partition_S(sV);

    Tensor tdKrdK = partition_fragment_C(mma, TileKV{});
    Tensor tdVrdV = partition_fragment_C(mma, TileKV{});
    clear(tdKrdK);
    clear(tdVrdV);
    Tensor tScS = thr.partition_C(make_identity_tensor(TileS{}));  // (key, query) in the tile
    Tensor tScS_rc = make_tensor(tScS.data(), sm80_acc_rowcol_layout(tScS.layout()));
    auto copy_ds = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, mma);
    auto thr_copy_ds = copy_ds.get_thread_slice(tid_k);
    Tensor tdSsdSt = thr_copy_ds.partition_D(sdSt);

    typename Traits::TiledMmadQ mma_dq;
    auto thr_dq = mma_dq.get_thread_slice(tid);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
    auto copy_dq_a = make_tiled_copy_A(typename Traits::SmemCopyAtomT{}, mma_dq);
    auto copy_dq_b = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dq);
    Tensor tdQsdS = copy_dq_a.get_thread_slice(tid).partition_S(sdS);
    Tensor tdQsKt = copy_dq_b.get_thread_slice(tid).partition_S(sKt);

    if constexpr (Traits::kKVInRegs) {
      // K and V landed with the first step's group (cp_async_wait<0> below would wait for it anyway).
      cp_async_wait<0>();
      __syncthreads();
      copy(copy_a, tSsK, copy_a.get_thread_slice(tid_k).retile_D(tSrK));
      copy(copy_a, tSsV, copy_a.get_thread_slice(tid_k).retile_D(tSrV));
    }

#pragma unroll 1
    for (int t = 0; t < steps; ++t) {
      const int slot = t & 1;                  // SparseList's step slot
      const int s = kStages == 2 ? slot : 0;   // Q / dO buffer
      // The band's next step (head, query block); SparseList reads it from the step slots instead.
      const bool last_of_head = m_block + 1 == m_max;
      const int next_bidh = last_of_head ? bidh + 1 : bidh, next_m_block = last_of_head ? m_min : m_block + 1;
      cp_async_wait<0>();
      __syncthreads();  // this step's tiles visible; every warp is done with the other buffer and with dS

      bool partial = true;
      if constexpr (kSparse) {
        const Step step = step_slots[slot];
        bidh = step.bidh, m_block = step.m_block, partial = step.partial;
      }
      Tensor sQ = make_tensor(make_smem_ptr(stage_ptr(s, 0)), typename Traits::SmemLayoutQ{});
      Tensor sdO = make_tensor(make_smem_ptr(stage_ptr(s, 1)), typename Traits::SmemLayoutQ{});
      Tensor sQt = make_tensor(make_smem_ptr(stage_ptr(s, 0)), typename Traits::SmemLayoutQt{});
      Tensor sdOt = make_tensor(make_smem_ptr(stage_ptr(s, 1)), typename Traits::SmemLayoutQt{});
      const float* rows_s = row_base + s * 2 * kBlockM;  // kBlockM lse_log2, then kBlockM D
      // {lse_log2, lse_log2, D, D} of the query pair of accumulator columns c & ~1 and (c & ~1) + 1 (a thread's
      // columns come in such pairs, the even query first). The kernel of this form (with the epilogue below),
      // measured against one-float-per-column reads: hdim 64 non-causal +2%, causal -1.5%, hdim 128 the same loop. An interleaved layout read with one
      // 16-byte load measured hdim 64 non-causal -2 to -4%, causal +2-3%, hdim 128 -0.3 to +0.7%.
      auto row_values = [&](int c) {
        const int q0 = get<1>(tScS_rc(0, c & ~1));
        return make_float4(rows_s[q0], rows_s[q0 + 1], rows_s[kBlockM + q0], rows_s[kBlockM + q0 + 1]);
      };

      Tensor tSrS = partition_fragment_C(mma, TileS{});
      Tensor tSrdP = partition_fragment_C(mma, TileS{});
      clear(tSrS);
      clear(tSrdP);
      Tensor tSrS_rc = make_tensor(tSrS.data(), sm80_acc_rowcol_layout(tSrS.layout()));
      Tensor tSrdP_rc = make_tensor(tSrdP.data(), sm80_acc_rowcol_layout(tSrdP.layout()));
      // Masked (query, key) pairs get S = -inf, so exp2 below gives P = 0 (lse_log2 is +inf, never -inf, for
      // rows without keys). A pass of its own behind a uniform branch, between the two GEMMs: testing every
      // element inside the probabilities loop cost every step 266 instructions and kept ptxas from
      // interleaving that loop with the dP^T GEMM (hdim 128 causal: 1251 vs the non-causal 985 instructions a
      // step); here a step that needs no mask runs the non-causal schedule.
      const Mask step_bm = kSparse ? step_block_mask(bm, partial) : bm;
      const bool need_mask = (!kEven || kCausal || kLocal) && step_bm.tile_needs_mask(m_block, n_block);
      if constexpr (Traits::kKVInRegs) {
        gemm_rs(mma, tSrK, tSrQ, tSrS, copy_b.get_thread_slice(tid_k).partition_S(sQ), copy_b);
      } else {
        gemm_smem(mma, tSrK, tSrQ, tSrS, tSsK, copy_b.get_thread_slice(tid_k).partition_S(sQ), copy_a, copy_b);
      }
      if (need_mask) {
#pragma unroll
        for (int c = 0; c < size<1>(tSrS_rc); ++c) {
          const int query = m_block * kBlockM + get<1>(tScS_rc(0, c));
#pragma unroll
          for (int r = 0; r < size<0>(tSrS_rc); ++r) {
            if (step_bm.masked(query, n_block * kBlockN + get<0>(tScS_rc(r, c)))) tSrS_rc(r, c) = -INFINITY;
          }
        }
      }
      if constexpr (Traits::kKVInRegs) {
        gemm_rs(mma, tSrV, tSrQ, tSrdP, copy_b.get_thread_slice(tid_k).partition_S(sdO), copy_b);
      } else {
        gemm_smem(mma, tSrV, tSrQ, tSrdP, tSsV, copy_b.get_thread_slice(tid_k).partition_S(sdO), copy_a, copy_b);
      }
      // The next block's loads (Q, dO, lse_log2, D into buffer `buf`), as one cp.async group.
      auto load_next = [&](int buf) {
        if (t + 1 < steps) {
          if constexpr (kSparse) {
            const Step next = step_slots[slot ^ 1];
            load_step(next.bidh, next.m_block, buf);
          } else {
            load_step(next_bidh, next_m_block, buf);
          }
        }
        cp_async_fence();
      };
      // Two buffers: the loads go out behind the first GEMMs, not right after the barrier, where every warp
      // would issue their address arithmetic at once while the tensor cores wait.
      if constexpr (kStages == 2) load_next(s ^ 1);

      // P^T = exp2(S^T * scale_log2 - lse_log2[q]) (0 where masked: S = -inf), dS^T = P^T * (dP^T - D[q]).
      // With softcap the score was cap * t, t = tanh(s * scale / cap), so dS picks up dt/ds ~ (1 - t^2): a
      // pass of its own, S becomes t and dP becomes (dP - D) * (1 - t^2) + D, so the loop below is the one
      // without softcap (adding and subtracting D costs an ulp of D, the size of the rounding in dP - D).
      if constexpr (kSoftcap) {
#pragma unroll
        for (int c = 0; c < size<1>(tSrS_rc); ++c) {
          const float4 v = row_values(c);
          const float dpsum = (c & 1) ? v.w : v.z;
#pragma unroll
          for (int r = 0; r < size<0>(tSrS_rc); ++r) {
            const float t = tanh_approx(tSrS_rc(r, c) * softcap_scale);
            // A masked score stays -inf (tanh would make it -1); its dS is 0 whatever dP becomes.
            if constexpr (kCausal || kLocal || !kEven) {
              tSrS_rc(r, c) = tSrS_rc(r, c) == -INFINITY ? -INFINITY : t;
            } else {
              tSrS_rc(r, c) = t;
            }
            tSrdP_rc(r, c) = fmaf(tSrdP_rc(r, c) - dpsum, 1.f - t * t, dpsum);
          }
        }
      }
#pragma unroll
      for (int c = 0; c < size<1>(tSrS_rc); ++c) {
        // A column is one query for every row of this thread.
        const float4 v = row_values(c);
        const float lse = (c & 1) ? v.y : v.x, dpsum = (c & 1) ? v.w : v.z;
#pragma unroll
        for (int r = 0; r < size<0>(tSrS_rc); ++r) {
          const float prob = exp2_approx(fmaf(tSrS_rc(r, c), scale_log2, -lse));
          tSrS_rc(r, c) = prob;
          tSrdP_rc(r, c) = prob * (tSrdP_rc(r, c) - dpsum);
        }
      }
      Tensor tPrP = make_tensor_like<Element>(tSrS);
      Tensor tdSrdS = make_tensor_like<Element>(tSrdP);
      convert_fragment(tSrS, tPrP);
      convert_fragment(tSrdP, tdSrdS);
      Tensor tPrP_a = make_tensor(tPrP.data(), sm80_acc_as_a_layout(tPrP.layout()));
      Tensor tdSrdS_a = make_tensor(tdSrdS.data(), sm80_acc_as_a_layout(tdSrdS.layout()));

      gemm_rs(mma, tPrP_a, tdKrQt, tdVrdV, copy_bt.get_thread_slice(tid_k).partition_S(half_cols(sdOt)),
              copy_bt);  // dV
      auto gemm_dk = [&] {
        gemm_rs(mma, tdSrdS_a, tdKrQt, tdKrdK, copy_bt.get_thread_slice(tid_k).partition_S(half_cols(sQt)),
                copy_bt);
      };
      // Split: dK now, so that dS^T's registers are free before dQ's accumulators (register pressure);
      // otherwise after the dQ reductions, whose latency its MMAs hide. One buffer: now, so that the next
      // block's Q can load behind the dQ GEMM.
      constexpr bool kdKFirst = kSplit == 2 || kStages == 1;
      if constexpr (kdKFirst) gemm_dk();
      if constexpr (kdSInQ) __syncthreads();  // every warp is done with Q^T, whose bytes dS^T takes
      if (half == 0) copy(copy_ds, thr_copy_ds.retile_S(tdSrdS), tdSsdSt);  // both halves hold the same dS^T
      __syncthreads();  // dS^T complete in shared memory; one buffer: Q and dO read for the last time
      if constexpr (kStages == 1 && !kdSInQ) load_next(0);

      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(tdQrdQ);
      gemm_smem(mma_dq, tdQrdS, tdQrKt, tdQrdQ, tdQsdS, tdQsKt, copy_dq_a, copy_dq_b);
      if constexpr (kdSInQ) {
        __syncthreads();  // every warp has read dS (in Q's buffer)
        load_next(0);
      }

      // dQ into dq_accum in register order (see the top of this file). Deterministic: in turn.
      const int64_t row0 = accum_row(bidh);
      // (No deterministic mode with a block mask: turn() follows the band; the host never asks for it.)
      int* semaphore = !kSparse && p.dq_semaphore ? p.dq_semaphore + row0 / kBlockM + m_block : nullptr;
      if (semaphore != nullptr) {
        if (tid == 0) {
          while (load_acquire_gpu(semaphore) != turn(bm, n_block, m_block)) {
          }
        }
        __syncthreads();
      }
      float* dq_accum = p.dq_accum + (row0 + int64_t(m_block) * kBlockM) * kHeadDim + tid;
#pragma unroll
      for (int e = 0; e < size(tdQrdQ); ++e) red_add_f32(dq_accum + e * kNumThreads, tdQrdQ(e));
      if (semaphore != nullptr) {
        __threadfence();
        __syncthreads();
        if (tid == 0) release_increment_gpu(semaphore);
      }

      if constexpr (!kdKFirst) gemm_dk();
      if constexpr (kSparse) {
        // Every thread read slot s before the dS^T barrier above; the next loop's barrier publishes step t + 2.
        if (tid == 0 && t + 2 < steps) {
          Cursor c = *cursor;
          advance(c);
          step_slots[slot] = step_of(c);
          *cursor = c;
        }
      } else {
        bidh = next_bidh;
        m_block = next_m_block;
      }
    }

    cp_async_wait<0>();  // a key block no query sees skipped the loop with its K/V copies still in flight

    // dK (scaled: S = scale * Q K^T) and dV, rows past seqlen_k skipped.
    Tensor tdKVc = thr.partition_C(make_identity_tensor(TileKV{}));
    auto out_ptr = [&](void* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
      return static_cast<Element*>(base) + seq.batch * batch_stride + bidh_kv * head_stride +
             (seq.offset_k + int64_t(n_block) * kBlockN) * row_stride;
    };
    Element* out_k = out_ptr(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
    Element* out_v = out_ptr(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
    const int rows = seqlen_k - n_block * kBlockN;
    if constexpr (!kStagedDKV) {
      store_pairs(tdKrdK, tdKVc, out_k + half * kHeadDimKV, p.dk_row_stride, rows, p.softmax_scale);
      store_pairs(tdVrdV, tdKVc, out_v + half * kHeadDimKV, p.dv_row_stride, rows, 1.f);
    } else {
      // Through memory into a function of its own: inlined, the staging code moved the loop's register
      // allocation (hdim 128 non-causal loop 0 -> 6 spill instructions); as a call the hdim
      // 128 causal loop has 2 (5 without staging). The barrier: every warp is done with the last step's K^T,
      // Q^T and dO^T, whose bytes the staging tiles reuse.
      static_assert(2 * kBlockN * staged_pitch<kHeadDim> * int(sizeof(Element)) <= kSmemBytes,
                    "dK and dV staging fits the buffers");
      float buf_k[size(tdKrdK)], buf_v[size(tdVrdV)];
#pragma unroll
      for (int e = 0; e < size(tdKrdK); ++e) buf_k[e] = tdKrdK(e), buf_v[e] = tdVrdV(e);
      __syncthreads();
      store_kv_staged(buf_k, buf_v, out_k, out_v, p.dk_row_stride, p.dv_row_stride, rows, p.softmax_scale,
                      half * kHeadDimKV, tid_k, smem);
    }
  }
};

}  // namespace flash4

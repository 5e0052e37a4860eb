// Split-KV decode kernel (cp.async + mma.sync: one kernel for Ampere and Hopper; decoding is bound by HBM
// bandwidth, not by the tensor cores).
//
// One CTA per (16 packed query rows, split, KV head, sequence). The rows are the query heads of one KV head
// times the query tokens (DecodeParams), so a 32/8-head model decoding one token fills 4 of the 16 rows and
// reads each K/V tile once for its 4 query heads. The CTA's four warps share each K/V tile by keys: warp w
// takes keys [w * kBlockN / 4, (w + 1) * kBlockN / 4) of every tile, runs its own online softmax over them,
// and the four (max, sum, O) states merge through shared memory at the end, as the splits merge in the
// combine kernel. Tiles stream through kStages cp.async buffers; rows outside the sequence's keys (and rows
// of pages outside the pool) are zero-filled, never read, and masked.
//
// fp8 caches (ElementKV e4m3, q 16-bit): the cp.async stages hold the tiles' bytes as they are (half the
// HBM traffic, which is what bounds decoding); each thread widens the rows it loaded into one 16-bit K and V
// tile (e4m3 values are exact in bf16 and fp16), which the warps then read as above. The scales fold into the
// score scale (k_descale, the same for the whole CTA's KV head) and into the output (v_descale).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include <cmath>
#include <type_traits>

#include "../common/decode_splits.h"
#include "../common/mask.hpp"
#include "../common/softmax.hpp"
#include "../common/sync.hpp"
#include "../params.h"
#include "../sm80/utils_sm80.hpp"
#include "kv_source.hpp"

namespace flash4 {

using namespace cute;

template <class Element_, int kHeadDim_, int kBlockN_, int kStages_, class ElementKV_ = Element_>
struct DecodeTraits {
  using Element = Element_;
  using ElementKV = ElementKV_;  // the caches'
  static constexpr bool kKV8 = sizeof(ElementKV) == 1;
  static_assert(kKV8 || std::is_same_v<Element, ElementKV>);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kBlockM = 16;  // one mma.sync M atom
  static constexpr int kWarps = 4;
  static constexpr int kNumThreads = 32 * kWarps;
  static constexpr int kWarpN = kBlockN / kWarps;  // keys per warp per tile
  static_assert(kWarpN % 16 == 0, "P V needs whole k16 slices of keys per warp");
  static_assert(kHeadDim % 32 == 0 && kStages >= 2);

  // Each warp is its own 16 x kWarpN (scores) / 16 x head_dim (output) MMA.
  using TiledMma = TiledMMA<Sm80MmaAtom<Element>, Layout<Shape<_1, _1, _1>>, Tile<_16, _16, _16>>;
  using SmemLayoutAtom = typename Sm80SmemTiling<Element, kHeadDim, kNumThreads>::SmemLayoutAtom;
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutVt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;

  static constexpr int kElemsQ = cosize_v<SmemLayoutQ>;
  static constexpr int kElemsKV = cosize_v<SmemLayoutKV>;
  static constexpr int kVecs = kHeadDim / 8;  // 16-byte vectors per 16-bit row
  static constexpr int kLoadVecs = kHeadDim * int(sizeof(ElementKV)) / 16;  // per cache row
  // Main loop: Q + kStages x (K + V); fp8: Q + one 16-bit K and V + kStages x (K + V) fp8 stages (row-major
  // bytes). Epilogue (aliasing the K / V buffers): each warp's fp32 output and its per-row (max, sum).
  static constexpr int kStageBytes = kBlockN * kHeadDim * int(sizeof(ElementKV));
  static constexpr int kMainBytes = kKV8 ? int(sizeof(Element)) * (kElemsQ + 2 * kElemsKV) + 2 * kStages * kStageBytes
                                         : int(sizeof(Element)) * (kElemsQ + 2 * kStages * kElemsKV);
  static constexpr int kMergeFloats = kWarps * kBlockM * kHeadDim;
  static constexpr int kEpilogueBytes =
      int(sizeof(Element)) * kElemsQ + 4 * (kMergeFloats + 2 * kWarps * kBlockM);
  static constexpr int kSmemBytes = kMainBytes > kEpilogueBytes ? kMainBytes : kEpilogueBytes;
};

// 16-byte cp.async; valid == false zero-fills the destination without reading the source.
CUTE_DEVICE void cp_async_16_zfill(void* smem, const void* gmem, bool valid) {
  const uint32_t s = cast_smem_ptr_to_uint(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}

template <class Traits_, class KVSource>
struct DecodeKernel {
  using Traits = Traits_;
  using Element = typename Traits::Element;
  using ElementKV = typename Traits::ElementKV;
  static constexpr bool kKV8 = Traits::kKV8;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kWarps = Traits::kWarps;
  static constexpr int kWarpN = Traits::kWarpN;
  static constexpr int kVecs = Traits::kVecs;
  static constexpr int kLoadVecs = Traits::kLoadVecs;
  static constexpr int kNumThreads = Traits::kNumThreads;
  // Paged caches add the page-id ring past the K / V buffers (and past the epilogue's merge scratch).
  static constexpr int kSmemBytes = Traits::kSmemBytes + (KVSource::kPaged ? 4 * PageRing::kSize : 0);
  using Params = DecodeParams;

  static_assert(kBlockM == kDecodeBlockM, "the host sizes the grid with decode_m_blocks");
  CUTE_HOST_DEVICE static int m_blocks(DecodeParams const& p) {
    return decode_m_blocks(p.seqlen_q, p.nheads_q / p.nheads_kv);
  }
  static Params to_params(DecodeParams const& p) { return p; }
  static dim3 grid(DecodeParams const& p) { return dim3(m_blocks(p) * p.num_splits, p.nheads_kv, p.batch); }

  // The query token and head of packed row R of KV head hk, or token -1 past the last token.
  struct RowCoord {
    int token, head;
  };
  CUTE_DEVICE static RowCoord row_coord(DecodeParams const& p, int group, int hk, int R) {
    const int t = R / group;
    return {t < p.seqlen_q ? t : -1, hk * group + R % group};
  }

  CUTE_DEVICE void operator()(Params const& p, char* smem_buf) const {
    const int m_blocks_ = m_blocks(p);
    const int m_block = blockIdx.x % m_blocks_, split = blockIdx.x / m_blocks_;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int group = p.nheads_q / p.nheads_kv;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    const DecodeSeq seq = decode_seq(p, b);
    const int seqlen_k = seq.seqlen_k(), off = seqlen_k - p.seqlen_q;
    // Keys (relative to key_begin) that some row of this tile sees; then this split's share of the blocks.
    const int t_first = m_block * kBlockM / group;
    const int t_last = min((m_block * kBlockM + kBlockM - 1) / group, p.seqlen_q - 1);
    const int lo = seq.key_begin + max(0, t_first + off - p.window_left);
    const int hi = seq.key_begin + min(seqlen_k, t_last + off + p.window_right + 1);
    int n_begin = 0, n_end = 0;
    if (hi > lo) {
      const int n_lo = lo / kBlockN, n_hi = (hi + kBlockN - 1) / kBlockN;
      const int per = (n_hi - n_lo + p.num_splits - 1) / p.num_splits;
      n_begin = n_lo + split * per;
      n_end = min(n_begin + per, n_hi);
    }

    Element* smem = reinterpret_cast<Element*>(smem_buf);
    Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
    // The 16-bit K / V tiles: kStages of each, or (fp8) one, after which come the fp8 stages.
    constexpr int kTiles = kKV8 ? 1 : kStages;
    Tensor sK = make_tensor(sQ.data() + int(Traits::kElemsQ), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(sK.data() + int(kTiles * Traits::kElemsKV), typename Traits::SmemLayoutKV{});
    uint8_t* stage_k = reinterpret_cast<uint8_t*>(smem + int(Traits::kElemsQ) + 2 * kTiles * int(Traits::kElemsKV));
    uint8_t* stage_v = stage_k + kStages * Traits::kStageBytes;
    float* merge_o = reinterpret_cast<float*>(smem + int(Traits::kElemsQ));  // epilogue only
    float* merge_stat = merge_o + int(Traits::kMergeFloats);                  // (max offset, sum) per warp and row

    typename Traits::TiledMma mma;
    auto thr = mma.get_thread_slice(lane);
    Tensor tOrO = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(tOrO);
    Tensor tOrO_rc = make_tensor(tOrO.data(), sm80_acc_rowcol_layout(tOrO.layout()));
    constexpr int kRows = decltype(size<0>(tOrO_rc))::value;  // 2: rows lane / 4 and lane / 4 + 8
    // fp8 caches: the KV head's scales (1 without), k_descale into the score scale (under softcap, into the
    // scale inside tanh), v_descale into the output.
    const int64_t scale_index = int64_t(b) * p.nheads_kv + hk;
    const float k_descale = kKV8 && p.k_descale != nullptr ? p.k_descale[scale_index] : 1.f;
    const float v_descale = kKV8 && p.v_descale != nullptr ? p.v_descale[scale_index] : 1.f;
    OnlineSoftmax<kRows> softmax(p.score_scale_log2() * (p.softcap > 0.f ? 1.f : k_descale));

    if (n_end > n_begin) {
      const Element* q = static_cast<const Element*>(p.q) + int64_t(b) * p.q_batch_stride;
      // Q: 16 packed rows, zeros past the last token.
      for (int i = tid; i < kBlockM * kVecs; i += kNumThreads) {
        const int r = i / kVecs, c = (i % kVecs) * 8;
        const RowCoord rc = row_coord(p, group, hk, m_block * kBlockM + r);
        const Element* src = q + int64_t(max(rc.token, 0)) * p.q_row_stride + rc.head * p.q_head_stride + c;
        cp_async_16_zfill(&sQ(r, c), src, rc.token >= 0);
      }
      const int slab = KVSource::slab_of(p, b);
      const ElementKV* kbase = static_cast<const ElementKV*>(p.k) + hk * p.k_head_stride;
      const ElementKV* vbase = static_cast<const ElementKV*>(p.v) + hk * p.v_head_stride;
      // A thread loads 16-byte pieces (8 or, fp8, 16 values) of rows r0 + it * kRowStep of every tile.
      constexpr int kIters = (kBlockN * kLoadVecs + kNumThreads - 1) / kNumThreads;
      constexpr int kRowStep = kNumThreads / kLoadVecs;
      static_assert(kNumThreads % kLoadVecs == 0 && kBlockN * kLoadVecs % kNumThreads == 0);
      constexpr int kPiece = 16 / int(sizeof(ElementKV));
      const int r0 = tid / kLoadVecs, c0 = (tid % kLoadVecs) * kPiece;
      PageRing ring(reinterpret_cast<int*>(smem_buf + Traits::kSmemBytes), p, b, n_begin * kBlockN);
      auto load_kv = [&](int n, int stage) {
        if constexpr (KVSource::kPaged) ring.refill(p, n * kBlockN);
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
          const int r = r0 + it * kRowStep, key = n * kBlockN + r;
          KVRow kr;
          if constexpr (KVSource::kPaged) {
            kr = ring.locate(p, key);
          } else {
            kr = KVSource::locate(p, slab, b, key);
          }
          const bool valid = kr.valid && key >= seq.key_begin && key < seq.key_end;
          const ElementKV* ks = kbase + int64_t(kr.slab) * p.k_batch_stride + int64_t(kr.row) * p.k_row_stride + c0;
          const ElementKV* vs = vbase + int64_t(kr.slab) * p.v_batch_stride + int64_t(kr.row) * p.v_row_stride + c0;
          if constexpr (kKV8) {
            const int at = stage * Traits::kStageBytes + r * kHeadDim + c0;
            cp_async_16_zfill(stage_k + at, valid ? ks : kbase, valid);
            cp_async_16_zfill(stage_v + at, valid ? vs : vbase, valid);
          } else {
            cp_async_16_zfill(&sK(r, c0) + stage * int(Traits::kElemsKV), valid ? ks : kbase, valid);
            cp_async_16_zfill(&sV(r, c0) + stage * int(Traits::kElemsKV), valid ? vs : vbase, valid);
          }
        }
      };
      // fp8: the pieces this thread loaded of stage `stage`, widened into the 16-bit K and V tiles (only its own
      // pieces: its cp.async wait covers them, and it alone loads there again).
      auto widen = [&](int stage) {
        if constexpr (kKV8) {
          cutlass::NumericArrayConverter<Element, ElementKV, 16> convert;
          // Two 8-value vectors of the swizzled 16-bit tile (each contiguous, not necessarily adjacent).
          auto put = [&](const uint8_t* src, auto& tile, int r) {
            const auto wide = convert(*reinterpret_cast<const cutlass::Array<ElementKV, 16>*>(src));
            *reinterpret_cast<uint4*>(&tile(r, c0)) = reinterpret_cast<const uint4*>(&wide)[0];
            *reinterpret_cast<uint4*>(&tile(r, c0 + 8)) = reinterpret_cast<const uint4*>(&wide)[1];
          };
          // Not unrolled: beside head dim 256's 128 output registers, unrolled copies spilled 160 B.
#pragma unroll 1
          for (int it = 0; it < kIters; ++it) {
            const int r = r0 + it * kRowStep, at = stage * Traits::kStageBytes + r * kHeadDim + c0;
            put(stage_k + at, sK, r);
            put(stage_v + at, sV, r);
          }
        }
      };
      if constexpr (KVSource::kPaged) {
        // The first ring's worth of page ids (with Q) must land before the first tile's addresses exist.
        ring.fill(p, PageRing::kSize);
        cp_async_fence();
        cp_async_wait<0>();
        __syncthreads();
      }
      // Prologue: kStages - 1 tiles in flight (Q rides with the first). One commit group per tile, empty
      // ones included, so "all but the newest kStages - 2 groups" always means "tile i has landed".
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (n_begin + s < n_end) load_kv(n_begin + s, s);
        cp_async_fence();
      }

      // Per-row mask bounds, relative to key_begin: row r sees [row_lo, row_hi).
      Tensor tScS = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kWarpN>>{}));
      Tensor tScS_rc = make_tensor(tScS.data(), sm80_acc_rowcol_layout(tScS.layout()));
      int row_lo[kRows], row_hi[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int t = row_coord(p, group, hk, m_block * kBlockM + get<0>(tScS_rc(r, 0))).token;
        const int tt = t < 0 ? p.seqlen_q - 1 : t;  // padding rows: any finite bounds (discarded)
        row_lo[r] = seq.key_begin + max(0, tt + off - p.window_left);
        row_hi[r] = seq.key_begin + min(seqlen_k, tt + off + p.window_right + 1);
      }

      Tensor sKw = local_tile(sK, Shape<Int<kWarpN>, Int<kHeadDim>>{}, make_coord(warp, _0{}));
      Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
      Tensor sVtw = local_tile(sVt, Shape<Int<kHeadDim>, Int<kWarpN>>{}, make_coord(_0{}, warp));
      Tensor tSrQ = thr.partition_fragment_A(sQ);
      Tensor tSrK = thr.partition_fragment_B(sKw);
      Tensor tOrVt = thr.partition_fragment_B(sVtw);
      auto copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma);
      auto copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma);
      auto copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma);
      auto thr_q = copy_q.get_thread_slice(lane);
      auto thr_k = copy_k.get_thread_slice(lane);
      auto thr_v = copy_v.get_thread_slice(lane);
      Tensor tSsQ = thr_q.partition_S(sQ);
      Tensor tSsK = thr_k.partition_S(sKw);
      Tensor tOsVt = thr_v.partition_S(sVtw);
      Tensor tSrQ_v = thr_q.retile_D(tSrQ);
      Tensor tSrK_v = thr_k.retile_D(tSrK);
      Tensor tOrVt_v = thr_v.retile_D(tOrVt);
      auto in_stage = [](auto const& t, int s) {
        return make_tensor(t.data() + (kKV8 ? 0 : s) * int(Traits::kElemsKV), t.layout());
      };
      const float softcap_scale = p.softcap_scale() * k_descale;

#pragma unroll 1
      for (int i = 0; i < n_end - n_begin; ++i) {
        const int n = n_begin + i, stage = i % kStages;
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile i (and Q) visible to all; every warp is done with tile i - 1's buffers
        if (n + kStages - 1 < n_end) load_kv(n + kStages - 1, (i + kStages - 1) % kStages);
        cp_async_fence();
        if constexpr (kKV8) {
          widen(stage);
          __syncthreads();  // the 16-bit tile i visible to all
        }
        if (i == 0) copy(copy_q, tSsQ, tSrQ_v);

        Tensor tSrS = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kWarpN>>{});
        clear(tSrS);
        Tensor tSsK_s = in_stage(tSsK, stage);
        copy(copy_k, tSsK_s, tSrK_v);
#pragma unroll
        for (int k = 0; k < size<2>(tSrQ); ++k) cute::gemm(mma, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
        if (p.softcap > 0.f) apply_softcap(tSrS, softcap_scale);
        Tensor tSrS_rc = make_tensor(tSrS.data(), sm80_acc_rowcol_layout(tSrS.layout()));
        const int key0 = n * kBlockN + warp * kWarpN;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int c = 0; c < size<1>(tSrS_rc); ++c) {
            const int key = key0 + get<1>(tScS_rc(r, c));
            if (key < row_lo[r] || key >= row_hi[r]) tSrS_rc(r, c) = -INFINITY;
          }
        }
        softmax.rescale(tOrO_rc, softmax.template update<false>(tSrS_rc));

        Tensor tOrP = make_tensor_like<Element>(tSrS);
        cutlass::NumericArrayConverter<Element, float, decltype(size(tSrS))::value> convert;
        *reinterpret_cast<cutlass::Array<Element, decltype(size(tSrS))::value>*>(tOrP.data()) =
            convert(*reinterpret_cast<cutlass::Array<float, decltype(size(tSrS))::value> const*>(tSrS.data()));
        Tensor tOrP_a = make_tensor(tOrP.data(), sm80_acc_as_a_layout(tOrP.layout()));
        copy(copy_v, in_stage(tOsVt, stage), tOrVt_v);
#pragma unroll
        for (int k = 0; k < size<2>(tOrP_a); ++k) cute::gemm(mma, tOrP_a(_, _, k), tOrVt(_, _, k), tOrO);
      }
      cp_async_wait<0>();
    }
    __syncthreads();  // every warp is done with the K / V buffers, which the merge reuses
    // The combine (which waits for this whole grid) may be scheduled now. Without splits the next kernel is
    // the next call's decode kernel: scheduled this early, its CTAs would be placed around ours still running
    // and pile up on the few free SMs (measured 4% slower at 16 x 8 KV heads), so it waits for our exit.
    if (p.num_splits > 1) allow_dependent_grid();

    // Merge the four warps: each publishes its unnormalized O and per-row (max offset, sum).
    Tensor tOcO = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tOcO_rc = make_tensor(tOcO.data(), sm80_acc_rowcol_layout(tOcO.layout()));
    float* my_o = merge_o + warp * kBlockM * kHeadDim;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(tOcO_rc(r, 0));
      const float sum = allreduce_sum<4>(softmax.row_sum[r]);
      if (lane % 4 == 0) {
        merge_stat[2 * (warp * kBlockM + row)] = softmax.max_offset(softmax.row_max[r]);
        merge_stat[2 * (warp * kBlockM + row) + 1] = sum;
      }
#pragma unroll
      for (int c = 0; c < size<1>(tOrO_rc); ++c) my_o[row * kHeadDim + get<1>(tOcO_rc(r, c))] = tOrO_rc(r, c);
    }
    __syncthreads();

    // Each thread finishes 4 consecutive columns of some rows: O = sum_w 2^(m_w - M) O_w / L with
    // M = max_w m_w and L = sum_w 2^(m_w - M) l_w, over the warps that saw a key (l_w > 0).
    const bool partial = p.num_splits > 1;
    for (int i = tid; i < kBlockM * (kHeadDim / 4); i += kNumThreads) {
      const int row = i / (kHeadDim / 4), col = (i % (kHeadDim / 4)) * 4;
      const RowCoord rc = row_coord(p, group, hk, m_block * kBlockM + row);
      if (rc.token < 0) continue;
      float m_max = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        if (merge_stat[2 * (w * kBlockM + row) + 1] > 0.f) m_max = fmaxf(m_max, merge_stat[2 * (w * kBlockM + row)]);
      }
      float total = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float l = merge_stat[2 * (w * kBlockM + row) + 1];
        if (l > 0.f) {
          const float f = exp2f(merge_stat[2 * (w * kBlockM + row)] - m_max);
          total += f * l;
          const float4 o4 = *reinterpret_cast<const float4*>(merge_o + (w * kBlockM + row) * kHeadDim + col);
          acc[0] += f * o4.x, acc[1] += f * o4.y, acc[2] += f * o4.z, acc[3] += f * o4.w;
        }
      }
      const float inv = total > 0.f ? v_descale / total : 0.f;
      const float lse = total > 0.f ? (m_max + log2f(total)) * float(M_LN2) : -INFINITY;
      const int64_t lse_index = (int64_t(b) * p.nheads_q + rc.head) * p.seqlen_q + rc.token;
      if (partial) {
        const int64_t part = int64_t(split) * p.batch * p.nheads_q * p.seqlen_q + lse_index;
        *reinterpret_cast<float4*>(p.o_accum + part * kHeadDim + col) =
            make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
        if (col == 0) p.lse_accum[part] = lse;
      } else {
        Element* o = static_cast<Element*>(p.o) + int64_t(b) * p.o_batch_stride +
                     int64_t(rc.token) * p.o_row_stride + rc.head * p.o_head_stride + col;
        cutlass::Array<Element, 4> out4;
#pragma unroll
        for (int j = 0; j < 4; ++j) out4[j] = Element(acc[j] * inv);
        *reinterpret_cast<cutlass::Array<Element, 4>*>(o) = out4;
        if (col == 0) p.lse[lse_index] = lse;
      }
    }
  }
};

}  // namespace flash4

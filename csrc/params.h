// Torch-free parameters shared by the binding, the dispatch table and every kernel.
//
// Units: every stride is in ELEMENTS (not bytes) and 64-bit, so tensors with more than 2^31
// elements index correctly. Shapes are 32-bit: TMA coordinates are 32-bit anyway.
#pragma once

#include <cmath>
#include <cstdint>

// The few helpers below run on the host (the sm90 kernels' to_params) and in the sm80 kernels, which take
// these structs as their parameters; a host compiler sees plain inline functions.
#if defined(__CUDACC__)
#define FLASH4_PARAMS_FN __host__ __device__ inline
#else
#define FLASH4_PARAMS_FN inline
#endif

namespace flash4 {

// kE4M3: fp8 q, k, v (forward only, sm90; output bf16).
enum class DType : int { kFP16 = 0, kBF16 = 1, kE4M3 = 2 };

struct DropoutParams {
  const int64_t* rng = nullptr;
  uint32_t threshold = 0;
  float inv_keep = 1.f;
};

// What forward and backward share beyond the tensors: the score scale, packed-batch geometry, sliding
// window, softcap. The mask kind itself (none, causal, window) is a template parameter of the kernel the
// dispatch table picks, not a field.
struct SeqMaskParams {
  float softmax_scale = 0.f;
  // softmax_scale * log2(e): the kernels use exp2, so the scale and the change of base fold into one FMA.
  float softmax_scale_log2 = 0.f;

  // Packed (varlen) batches, else all null: sequence b owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of
  // q/out and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k/v, which are then (total, heads, head_dim) with
  // batch strides 0; seqlen_q/seqlen_k are the longest lengths (they size the grid), total_q/total_k the
  // packed row counts. seqused_q/seqused_k (batch), optional, shorten each sequence to its first rows.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  const int* seqused_q = nullptr;
  const int* seqused_k = nullptr;
  int total_q = 0, total_k = 0;

  // Sliding window, read by the kLocal kernels only: query i sees keys
  // [i + seqlen_k - seqlen_q - window_left, i + seqlen_k - seqlen_q + window_right]; the binding passes an
  // unbounded side as a value larger than any length. softcap > 0: scores s become softcap * tanh(s / softcap).
  int window_left = 0, window_right = 0;
  float softcap = 0.f;

  // ALiBi, read by the Alibi instantiations only (common/score_bias.hpp): the logit of query i and key j gains
  // -slopes[b * alibi_batch_stride + h] * |i + seqlen_k - seqlen_q - j| (per sequence); fp32, stride 0 for
  // one (nheads_q,) vector shared by the batch. Never together with softcap (the binding checks).
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;

  // Dropout, read by the Dropout instantiations only (common/dropout.hpp, flash_attn4/dropout.py): rng holds
  // the call's (seed, offset) on the device; an element is kept iff its random byte is >= threshold (p rounded
  // to a multiple of 1 / 256, times 256), and kept probabilities are scaled by inv_keep = 256 / (256 - threshold).
  DropoutParams dropout;

  // How the kernels turn a raw score s = q.k into the softmax exponent, in one place for both directions:
  // exp2(t * score_scale_log2() - ...) with t = s, or with softcap t = tanh(s * softcap_scale()) (the capped
  // scaled score is softcap * t); lse_scale() turns the running max of t back into natural-log units.
  FLASH4_PARAMS_FN float score_scale_log2() const {
    return softcap > 0.f ? float(softcap * M_LOG2E) : softmax_scale_log2;
  }
  FLASH4_PARAMS_FN float softcap_scale() const { return softcap > 0.f ? softmax_scale / softcap : 0.f; }
  FLASH4_PARAMS_FN float lse_scale() const { return softcap > 0.f ? softcap : softmax_scale; }

  // The device's multiprocessor count: the sm90 forward runs one CTA per SM, so the CTA launched num_sms places
  // after this one starts about when this one ends; this one prefetches that tile's first inputs into L2
  // (0: no prefetch).
  int num_sms = 0;
  // Shared memory one CTA may take (the device's opt-in maximum, or FLASH_ATTN4_SMEM_CAP when lower): the
  // Ampere-path launchers pick the tile that fits (tile_size.h; 99 KB on sm86 / 89 / 120). 0: no limit known.
  int smem_per_block = 0;
  // Per-CTA profiling stamps, written only by builds with -DFLASH4_TRACE (common/trace.hpp); else null.
  unsigned long long* trace = nullptr;
};

// Block iterators (common/block_sparse.hpp): the band a causal / window mask leaves, or a block mask's
// index lists. Tags only; the dispatch table keys on them.
struct DenseBand {};
struct SparseList {};
// Score modifiers (common/score_bias.hpp, common/dropout.hpp, where they are defined): none, ALiBi, dropout.
struct NoBias;
struct Alibi;
struct Dropout;

// Keys (and queries) per block of a block mask (flash_attn4/block_mask.py): the sm90 forward's query tile,
// and a multiple of its kBlockN.
constexpr int kMaskBlock = 128;

// A block mask's lists (common/block_sparse.hpp): counts (B, H, rows) and indices (B, H, rows, num_blocks)
// int32, strides in elements (0 for a broadcast batch or head), last dim contiguous. The forward's rows are
// query blocks listing key blocks; the backward's are the transpose (key blocks listing query blocks). All
// null for a dense call.
struct BlockSparseParams {
  const int* kv_count = nullptr;  // partial blocks (with the element mask)
  const int* kv_index = nullptr;
  const int* full_count = nullptr;  // full blocks (without it)
  const int* full_index = nullptr;
  int64_t count_batch_stride = 0, count_head_stride = 0, count_row_stride = 0;
  int64_t index_batch_stride = 0, index_head_stride = 0, index_row_stride = 0;
  int num_blocks = 0;  // the lists' length: nk (forward) or nq (backward), in kMaskBlock blocks
};

struct FwdParams : SeqMaskParams {
  // q: (batch, seqlen_q, nheads_q, head_dim); k, v: (batch, seqlen_k, nheads_kv, head_dim); v's head dim
  // (and o's) is the instantiation's v head dim, smaller than head_dim in the MLA ones (192 / 128).
  // The last dim is contiguous; batch/row/head strides are arbitrary multiples of 8 elements
  // (16 bytes: the TMA alignment rule), checked by the binding.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;

  // o: (batch, seqlen_q, nheads_q, head_dim) in q's dtype; same alignment rule as q.
  void* o = nullptr;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  // lse: (batch, nheads_q, seqlen_q) float32, contiguous, or (nheads_q, total_q) for packed batches;
  // natural log; -inf for rows that see no key.
  float* lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  // Ampere path, float16 inputs, head dims <= 128, no window or block mask: accumulate each key block's P V in
  // fp16 and add it into the fp32 O (FLASH_ATTN4_FP16_ACCUM=1; AccumPVF16, launch_fwd_sm80.hpp). Off by default.
  bool accum_pv_fp16 = false;

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int nheads_q = 0;
  int nheads_kv = 0;  // nheads_q % nheads_kv == 0 (GQA/MQA)
  int head_dim = 0;   // equals the instantiation's head dim

  // Read by the block-sparse instantiations only (SparseList).
  BlockSparseParams block_sparse;

  // fp8 (kE4M3) only: q, k and v hold x / descale; the descales are contiguous fp32 (batch, nheads_kv). v is
  // then V^T, (batch, nheads_kv, head_dim, seqlen_k rounded up to 32) with the keys contiguous and permuted
  // within each 32 (csrc/fp8_vt.cu, csrc/sm90/fp8_sm90.hpp): v_row_stride steps head_dim there.
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;

  // Attention sinks (fp32, (nheads_q,) logits), or null: the sm90 and sm80 forward kernels fold them into each
  // finished row (common/softmax.hpp, apply_sink), so out and lse come back with them.
  const float* sinks = nullptr;

  DType dtype = DType::kBF16;
};

// Packed batches keep their fp32 backward scratch in rows that start each sequence on a multiple of
// kAccumRowAlign (so a query block never straddles two sequences): sequence b starts at row
// padded_row_offset(cu_seqlens_q[b], b), and (total_q + batch * kAccumRowAlign) rows cover them all.
constexpr int kAccumRowAlign = 128;
inline constexpr int padded_row_offset(int cu_q, int b) {
  return (cu_q + b * kAccumRowAlign) / kAccumRowAlign * kAccumRowAlign;
}

struct BwdParams : SeqMaskParams {
  // Inputs, same conventions as FwdParams: (batch, seqlen, heads, head_dim), last dim contiguous, other
  // strides multiples of 8 elements. dout and out are shaped like q.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;
  const void* dout = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;
  int64_t dout_batch_stride = 0, dout_row_stride = 0, dout_head_stride = 0;
  const float* lse = nullptr;  // (batch, nheads_q, seqlen_q), natural log, from the forward
  // Gradient of lse, (batch, nheads_q, seqlen_q) contiguous, or null for zero. Since d lse / d s_ij = P_ij,
  // it enters as dS = P * (dP - (D - dlse)): the pre-pass folds it into D.
  const float* dlse = nullptr;

  // Outputs: dq like q, dk/dv like k/v (summed over the query heads of a GQA group).
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  // lse and dlse of packed batches: (nheads_q, total_q), with these strides (batch stride 0).
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  // Scratch, contiguous, rows padded to seqlen_q_rounded (a multiple of the kernel's kBlockM); packed
  // batches use (nheads_q, accum_rows) with sequence b from padded_row_offset (accum_batch_stride 0):
  //   dq_accum (batch, nheads_q, seqlen_q_rounded, head_dim) fp32, zeroed before the pre-pass. Within each
  //            block of kBlockM rows the kernel may store elements in its own order (the sm90 kernel keeps
  //            its accumulator's register order so a whole block is one bulk reduce-add); the post-pass
  //            that matches the kernel undoes it;
  //   dpsum    (batch, nheads_q, seqlen_q_rounded) fp32: D = rowsum(dout * out) - dlse;
  //   lse_log2 (batch, nheads_q, seqlen_q_rounded) fp32: lse * log2(e), +inf for rows that see no key and
  //            for padding rows, so that exp2(s * scale_log2 - lse_log2) is 0 there instead of NaN.
  float* dq_accum = nullptr;
  float* dpsum = nullptr;
  float* lse_log2 = nullptr;
  int seqlen_q_rounded = 0;
  // Row strides of the scratch (dq_accum multiplies them by head_dim): fixed-length batches
  // (nheads_q * seqlen_q_rounded, seqlen_q_rounded), packed ones (0, accum_rows).
  int64_t accum_batch_stride = 0, accum_head_stride = 0;
  // Deterministic dQ: null for the default (blocks of keys add into dq_accum in whatever order they
  // finish), else zeroed int32 counters, one per (batch, head_q, query block of the kernel's kBlockM rows, at
  // scratch row / kBlockM), with which the key blocks take turns in a fixed order, so dq is bitwise
  // reproducible.
  int* dq_semaphore = nullptr;
  // The persistent backward's dynamic schedule (kernel_bwd_persistent_sm90.hpp): a zeroed int32 counter of key
  // tiles taken. The binding keeps it in dq_accum's zeroed allocation, past the scratch.
  int* tile_counter = nullptr;

  // Read by the block-sparse instantiations only (SparseList): the transposed lists (key blocks listing
  // query blocks). Never together with dq_semaphore.
  BlockSparseParams block_sparse;

  int batch = 0, seqlen_q = 0, seqlen_k = 0, nheads_q = 0, nheads_kv = 0, head_dim = 0;
  DType dtype = DType::kBF16;
};

// Decoding from a KV cache (csrc/decode/): few query rows per sequence, a long cache. The query heads of one
// KV head are packed into the rows of one tile (row r of KV head g is query token r / group, head
// g * group + r % group), so each K/V tile is read once per group; the keys of a sequence are cut into
// num_splits slices, one CTA each, whose fp32 partials a combine kernel merges through their LSEs.
struct DecodeParams : SeqMaskParams {
  // q: (batch, seqlen_q, nheads_q, head_dim), last dim contiguous.
  const void* q = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;

  // Contiguous caches: k, v (cache_batch, capacity, nheads_kv, head_dim), the batch stride per cache row.
  // Paged caches (page_table non-null): k, v (num_pages, page_size, nheads_kv, head_dim), the batch stride
  // per page; key t of sequence b lives in page page_table[b * page_table_stride + t / page_size], row
  // t % page_size. A page id outside [0, num_pages) reads as zeros and is never written.
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  const int* page_table = nullptr;
  int64_t page_table_stride = 0;
  int page_size = 0, num_pages = 0;
  int page_shift = -1;  // log2(page_size) where it is a power of two (a shift per key row, not a division)
  int capacity = 0;     // key rows a sequence can hold: the cache's seqlen, or max_pages * page_size
  int cache_batch = 0;  // rows of a contiguous cache (cache_batch_idx values are clamped into it)

  // Per sequence (all optional, int32 (batch,), read on the device): the keys are cache rows
  // [leftpad, cache_seqlens + seqlen_new), clamped to [0, capacity); without cache_seqlens the cache is full
  // (capacity rows). cache_batch_idx maps batch row b to cache row cache_batch_idx[b] (contiguous caches).
  const int* cache_seqlens = nullptr;
  const int* cache_leftpad = nullptr;
  const int* cache_batch_idx = nullptr;
  int seqlen_new = 0;  // tokens appended this call (already written to the cache by the append kernel)

  // out: like q; lse: (batch, nheads_q, seqlen_q) fp32 contiguous.
  void* o = nullptr;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  float* lse = nullptr;

  // num_splits > 1: partials o_accum (num_splits, batch, nheads_q, seqlen_q, head_dim) and lse_accum
  // (num_splits, batch, nheads_q, seqlen_q), fp32 contiguous; an empty slice writes 0 and -inf.
  int num_splits = 1;
  float* o_accum = nullptr;
  float* lse_accum = nullptr;

  int batch = 0, seqlen_q = 0, nheads_q = 0, nheads_kv = 0, head_dim = 0;
  DType dtype = DType::kBF16;

  // fp8 caches (e4m3, kv8 kernels): sequence b's key / value of kv head h is the cached value times
  // k_descale / v_descale[b * nheads_kv + h] (null: 1); q and out keep `dtype`.
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
};

// The append kernel (decode/append_kv.hpp): new k, v (batch, seqlen_new, nheads_kv, head_dim) written into
// the cache of DecodeParams at rows cache_seqlens[b] + t (a row past the capacity, or in a page outside the
// pool, is skipped), with rotary on k and on q (q_rot gets the rotated q) when cos / sin are given.
struct AppendParams {
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t kn_batch_stride = 0, kn_row_stride = 0, kn_head_stride = 0;
  int64_t vn_batch_stride = 0, vn_row_stride = 0, vn_head_stride = 0;
  // Rotary: the caller's q (strides in elements) is rotated into q_rot, (batch, seqlen_q, nheads_q, head_dim)
  // contiguous, which the attention kernel then reads (DecodeParams::q); null without rotary.
  const void* q = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  void* q_rot = nullptr;
  // rotary_cos / rotary_sin: (seqlen_ro, rotary_dim / 2), q's dtype, contiguous; positions past seqlen_ro
  // are clamped to its last row.
  const void* cos = nullptr;
  const void* sin = nullptr;
  int rotary_dim = 0, seqlen_ro = 0;
  bool interleaved = false;
  bool q_per_token = true;  // q token t at cache_seqlens - leftpad + t (causal / window), else all at + 0
};

}  // namespace flash4

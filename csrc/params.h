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

enum class DType : int { kFP16 = 0, kBF16 = 1 };

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
  // Per-CTA profiling stamps, written only by builds with -DFLASH4_TRACE (common/trace.hpp); else null.
  unsigned long long* trace = nullptr;
};

struct FwdParams : SeqMaskParams {
  // q: (batch, seqlen_q, nheads_q, head_dim); k, v: (batch, seqlen_k, nheads_kv, head_dim).
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

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int nheads_q = 0;
  int nheads_kv = 0;  // nheads_q % nheads_kv == 0 (GQA/MQA)
  int head_dim = 0;   // equals the instantiation's head dim

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

  int batch = 0, seqlen_q = 0, seqlen_k = 0, nheads_q = 0, nheads_kv = 0, head_dim = 0;
  DType dtype = DType::kBF16;
};

}  // namespace flash4

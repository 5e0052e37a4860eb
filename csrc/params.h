// Torch-free parameters shared by the binding, the dispatch table and every kernel.
//
// Units: every stride is in ELEMENTS (not bytes) and 64-bit, so tensors with more than 2^31
// elements index correctly. Shapes are 32-bit: TMA coordinates are 32-bit anyway.
#pragma once

#include <cstdint>

namespace flash4 {

enum class DType : int { kFP16 = 0, kBF16 = 1 };

struct FwdParams {
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

  // lse: (batch, nheads_q, seqlen_q) float32, contiguous; natural log; -inf for rows that see no key.
  float* lse = nullptr;

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int nheads_q = 0;
  int nheads_kv = 0;  // nheads_q % nheads_kv == 0 (GQA/MQA)
  int head_dim = 0;   // equals the instantiation's head dim

  float softmax_scale = 0.f;
  // softmax_scale * log2(e): the kernel uses exp2, so the scale and the change of base fold into one FMA.
  float softmax_scale_log2 = 0.f;
  // Bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
  bool causal = false;

  DType dtype = DType::kBF16;
};

}  // namespace flash4

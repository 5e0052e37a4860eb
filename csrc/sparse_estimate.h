// estimate_block_mask's kernels (sparse_estimate.cu): torch-free arguments and launches.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flash4 {

// x (batch, s, heads, d), d contiguous -> out (batch, n = ceil(s / block), heads, d) fp32 block means.
struct MeansArgs {
  enum DType { kF32, kF16, kBF16 };
  const void* x;
  float* out;
  DType dtype;
  int batch, s, n, heads, d, block;
  int64_t b_stride, row_stride, head_stride;  // elements
};

// Outputs are contiguous int32: counts (batch, hq, n) and indices (batch, hq, n, m), each row's set blocks in
// increasing order, zeros after its count; `dense` is scratch, (2, batch, hq, nq, nk) bytes.
struct EstimateParams {
  const float* q_mean;  // (batch, nq, hq, d)
  const float* k_mean;  // (batch, nk, hk, d)
  uint8_t* dense;
  int32_t *kv_count, *kv_index, *full_count, *full_index;      // per query block
  int32_t *q_count, *q_index, *full_q_count, *full_q_index;    // per key block
  int batch, hq, hk, d, sq, sk, block, nq, nk;
  float scale;          // softmax scale
  float threshold;      // keep a block while the mass of the blocks ranked before it is below this
  double density;       // > 0: keep the top max(1, ceil(visible * density)) blocks instead
  int keep_first, keep_local;
  int64_t left, right;  // window sides after causal (right = 0), -1 unbounded
};

void launch_block_means(const MeansArgs& a, cudaStream_t stream);
size_t estimate_smem_bytes(int nk, int d);
void launch_estimate_blocks(const EstimateParams& p, cudaStream_t stream);

}  // namespace flash4

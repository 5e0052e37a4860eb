// The fp8 forward's V pre-pass: V (batch, seqlen_k, nheads_kv, head_dim) -> V^T (batch, nheads_kv, head_dim,
// seqlen_k rounded up to 32), keys contiguous and permuted within every 32 (csrc/sm90/fp8_sm90.hpp: position
// 16 h + 4 t + 2 i + e holds key 16 h + 8 i + 2 t + e), zeros past seqlen_k. A transpose through shared
// memory: 16-byte loads along head_dim, 16-byte stores along keys, so it runs near copy bandwidth (torch's
// generic permute copy of the same view ran at a tenth of it).
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "params.h"

namespace flash4 {
namespace {

constexpr int kKeys = 64, kDims = 64, kThreads = 256;  // one 64 x 64-byte tile a CTA

__global__ void __launch_bounds__(kThreads) fp8_vt_kernel(const uint8_t* __restrict__ v, uint8_t* __restrict__ vt,
                                                          int seqlen_k, int seqlen_pad, int nheads_kv, int head_dim,
                                                          int64_t v_batch_stride, int64_t v_row_stride,
                                                          int64_t v_head_stride) {
  // +4 bytes a row: the reads below walk down a column of keys, 68-byte rows spread them over the banks.
  __shared__ uint8_t tile[kKeys][kDims + 4];
  const int key0 = blockIdx.x * kKeys, dim0 = blockIdx.y * kDims;
  const int bh = blockIdx.z, b = bh / nheads_kv, h = bh % nheads_kv;
  {  // load: thread -> (key row, 16-byte chunk of head_dim)
    const int r = threadIdx.x / 4, c = (threadIdx.x % 4) * 16;
    const int key = key0 + r;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (key < seqlen_k && dim0 + c < head_dim) {
      x = *reinterpret_cast<const uint4*>(v + b * v_batch_stride + int64_t(key) * v_row_stride + h * v_head_stride +
                                          dim0 + c);
    }
    uint32_t* dst = reinterpret_cast<uint32_t*>(&tile[r][c]);
    dst[0] = x.x, dst[1] = x.y, dst[2] = x.z, dst[3] = x.w;
  }
  __syncthreads();
  // store: thread -> (head_dim row, 16 output positions)
  const int d = threadIdx.x / 4, p0 = (threadIdx.x % 4) * 16;
  if (dim0 + d >= head_dim || key0 + p0 >= seqlen_pad) return;
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t word = 0;
#pragma unroll
    for (int byte = 0; byte < 4; ++byte) {
      const int p = p0 + 4 * j + byte;  // position within the tile; its 32-key group starts at p & ~31
      const int k = p & 31;
      const int key = (p & ~31) + 16 * (k >> 4) + 8 * ((k >> 1) & 1) + 2 * ((k >> 2) & 3) + (k & 1);
      word |= uint32_t(tile[key][d]) << (8 * byte);
    }
    w[j] = word;
  }
  *reinterpret_cast<uint4*>(vt + (int64_t(bh) * head_dim + dim0 + d) * seqlen_pad + key0 + p0) =
      make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace

// v: head_dim contiguous, the other strides (elements = bytes) multiples of 16; vt contiguous,
// (batch, nheads_kv, head_dim, seqlen_pad) with seqlen_pad = round_up(seqlen_k, 32); head_dim a multiple of 16.
void launch_fp8_vt(const void* v, void* vt, int batch, int seqlen_k, int nheads_kv, int head_dim,
                   int64_t v_batch_stride, int64_t v_row_stride, int64_t v_head_stride, cudaStream_t stream) {
  const int seqlen_pad = (seqlen_k + 31) / 32 * 32;
  const dim3 grid((seqlen_pad + kKeys - 1) / kKeys, (head_dim + kDims - 1) / kDims, batch * nheads_kv);
  fp8_vt_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint8_t*>(v), static_cast<uint8_t*>(vt), seqlen_k,
                                               seqlen_pad, nheads_kv, head_dim, v_batch_stride, v_row_stride,
                                               v_head_stride);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("flash_attn4: fp8 V pre-pass launch: ") +
                                                   cudaGetErrorString(err));
}

}  // namespace flash4

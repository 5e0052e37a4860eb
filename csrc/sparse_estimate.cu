// estimate_block_mask's GPU path (flash_attn4/sparsity.py has the method and the PyTorch version it matches):
// three launches instead of ~50 small PyTorch ops, whose host time, not their GPU work, was the estimator's cost.
//   1. block_means: per block of `block` tokens the mean query / key, fp32 (one read of q and of k).
//   2. estimate_rows: per (batch, head, query block) the mean query's softmax over the mean keys (weighted by
//      each key block's size), the key blocks kept (threshold on the mass of the better blocks, or the top
//      density fraction of the visible ones; plus the forced sinks / diagonal), split into partial and full by
//      the causal / window mask, written as the row lists and as a dense byte matrix.
//   3. block_columns: the transposed lists (per key block, the query blocks that read it) from that matrix.
// The ranking is O(nk^2) comparisons a row, with no sort: beside the attention's 4 block^2 d FLOPs per block
// pair it costs nk / (4 block^2 d) of it (well under 1% up to a million tokens).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "sparse_estimate.h"

namespace flash4 {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// One thread sums kVec consecutive elements of a (head, dim) column over the block's rows; kVec * sizeof(T) is 16
// bytes when the layout allows it (one vector load a row).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) block_means_kernel(const T* __restrict__ x, float* __restrict__ out, int s,
                                                               int n, int cols, int d, int block, int64_t b_stride,
                                                               int64_t row_stride, int64_t head_stride) {
  const int c0 = (blockIdx.x * kThreads + threadIdx.x) * kVec;
  if (c0 >= cols) return;
  const int i = blockIdx.y, b = blockIdx.z;
  const int row0 = i * block, rows = min(block, s - row0);
  const T* p = x + b * b_stride + int64_t(c0 / d) * head_stride + c0 % d + int64_t(row0) * row_stride;
  float acc[kVec] = {};
  struct alignas(sizeof(T) * kVec) Pack { T v[kVec]; };
#pragma unroll 4
  for (int r = 0; r < rows; ++r) {
    const Pack v = *reinterpret_cast<const Pack*>(p + int64_t(r) * row_stride);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] += to_float(v.v[e]);
  }
  float* o = out + (int64_t(b) * n + i) * cols + c0;
  const float inv = 1.f / float(rows);
#pragma unroll
  for (int e = 0; e < kVec; ++e) o[e] = acc[e] * inv;
}

// Ordered compaction of two flags a thread, block-wide: each set flag's slot among the set flags of the chunk
// (thread order), and the chunk's totals. Every thread of the block calls it (it synchronizes).
struct Slots {
  int slot[2], total[2];
};
__device__ Slots ordered_slots(bool a, bool b, int (*s_warp)[kWarps]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned ballot[2] = {__ballot_sync(0xffffffffu, a), __ballot_sync(0xffffffffu, b)};
  if (lane == 0) s_warp[0][warp] = __popc(ballot[0]), s_warp[1][warp] = __popc(ballot[1]);
  __syncthreads();
  Slots r{};
#pragma unroll
  for (int f = 0; f < 2; ++f) {
    int before = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? s_warp[f][w] : 0;
      total += s_warp[f][w];
    }
    r.slot[f] = before + __popc(ballot[f] & ((1u << lane) - 1u));
    r.total[f] = total;
  }
  __syncthreads();  // s_warp is rewritten by the next chunk
  return r;
}

// Two lists (partial, full) of one row or column, filled chunk by chunk in increasing position order: each
// chunk's set flags go behind the ones already written; finish() zeroes the unused slots and writes the counts.
struct ListPair {
  int32_t* index[2];
  int n, base[2] = {0, 0};
  __device__ void add(bool partial, bool full, int pos, int (*s_warp)[kWarps]) {
    const Slots s = ordered_slots(partial, full, s_warp);
    if (partial) index[0][base[0] + s.slot[0]] = pos;
    if (full) index[1][base[1] + s.slot[1]] = pos;
    base[0] += s.total[0], base[1] += s.total[1];
  }
  __device__ void finish(int32_t* count_partial, int32_t* count_full) const {
    for (int f = 0; f < 2; ++f) {
      for (int k = base[f] + threadIdx.x; k < n; k += kThreads) index[f][k] = 0;
    }
    if (threadIdx.x == 0) *count_partial = base[0], *count_full = base[1];
  }
};

__device__ float block_reduce(float v, bool is_max, float* s_red) {
  for (int o = 16; o; o /= 2) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  if (threadIdx.x % 32 == 0) s_red[threadIdx.x / 32] = v;
  __syncthreads();
  v = s_red[0];
  for (int w = 1; w < kWarps; ++w) v = is_max ? fmaxf(v, s_red[w]) : v + s_red[w];
  __syncthreads();
  return v;
}

// Whether the causal / window mask (bottom-right aligned) lets some / every element of block (i, j) through.
struct Visibility {
  bool some, every;
};
__device__ Visibility visibility(const EstimateParams& p, int i, int j) {
  const int64_t off = int64_t(p.sk) - p.sq;
  const int64_t r0 = int64_t(i) * p.block + off, r1 = min(int64_t(i + 1) * p.block, int64_t(p.sq)) - 1 + off;
  const int64_t c0 = int64_t(j) * p.block, c1 = min(int64_t(j + 1) * p.block, int64_t(p.sk)) - 1;
  Visibility v{true, true};
  if (p.right >= 0) v.some &= r1 + p.right >= c0, v.every &= r0 + p.right >= c1;
  if (p.left >= 0) v.some &= r0 - p.left <= c1, v.every &= r1 - p.left <= c0;
  return v;
}

__global__ void __launch_bounds__(kThreads) estimate_rows_kernel(EstimateParams p) {
  extern __shared__ float s_dyn[];
  float* s_mass = s_dyn;      // nk: logits, then masses (-1 where the mask hides the block)
  float* s_q = s_dyn + p.nk;  // d: this query block's mean
  __shared__ float s_red[kWarps];
  __shared__ int s_warp[2][kWarps];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hk = h / (p.hq / p.hk);
  const int64_t bh = int64_t(b) * p.hq + h;
  const float* q = p.q_mean + ((int64_t(b) * p.nq + i) * p.hq + h) * p.d;
  for (int e = threadIdx.x; e < p.d; e += kThreads) s_q[e] = q[e];
  __syncthreads();

  // Logits: a warp a key block; log(rows) weighs the mean key by its block's size.
  float hi = -INFINITY;
  for (int j = warp; j < p.nk; j += kWarps) {
    const float* k = p.k_mean + ((int64_t(b) * p.nk + j) * p.hk + hk) * p.d;
    float acc = 0.f;
    for (int e = lane; e < p.d; e += 32) acc += s_q[e] * k[e];
    for (int o = 16; o; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    const float rows = float(min(p.block, p.sk - j * p.block));
    const float logit = visibility(p, i, j).some ? acc * p.scale + logf(rows) : -INFINITY;
    hi = fmaxf(hi, logit);
    if (lane == 0) s_mass[j] = logit;
  }
  __syncthreads();
  hi = block_reduce(hi, true, s_red);
  float sum = 0.f, visible = 0.f;
  for (int j = threadIdx.x; j < p.nk; j += kThreads) {
    const bool seen = s_mass[j] != -INFINITY;
    const float e = seen ? expf(s_mass[j] - hi) : 0.f;
    s_mass[j] = seen ? e : -1.f;
    sum += e, visible += seen;
  }
  sum = block_reduce(sum, false, s_red);
  visible = block_reduce(visible, false, s_red);
  const float inv = 1.f / sum;
  for (int j = threadIdx.x; j < p.nk; j += kThreads) s_mass[j] = s_mass[j] < 0.f ? -1.f : s_mass[j] * inv;
  __syncthreads();
  const int n_keep = p.density > 0 ? max(1, int(ceil(double(visible) * p.density))) : 0;
  // The diagonal: the key block of this query block's last row.
  const int64_t last = min(int64_t(i + 1) * p.block, int64_t(p.sq)) - 1 + int64_t(p.sk) - p.sq;
  const int64_t diag = last >= 0 ? last / p.block : -((-last + p.block - 1) / p.block);

  const int64_t row = bh * p.nq + i;
  ListPair lists{{p.kv_index + row * p.nk, p.full_index + row * p.nk}, p.nk};
  uint8_t* dense_partial = p.dense + row * p.nk;
  uint8_t* dense_full = dense_partial + int64_t(p.batch) * p.hq * p.nq * p.nk;
  for (int j0 = 0; j0 < p.nk; j0 += kThreads) {
    const int j = j0 + threadIdx.x;
    bool partial = false, full = false;
    if (j < p.nk) {
      const Visibility vis = visibility(p, i, j);
      const float mj = s_mass[j];
      // The blocks ranked before j (larger mass, ties by index), their count and their mass.
      int rank = 0;
      float before = 0.f;
      for (int k = 0; k < p.nk; ++k) {
        const float m = s_mass[k];
        const bool ahead = m > mj || (m == mj && k < j);
        rank += ahead;
        before += ahead ? m : 0.f;
      }
      const bool chosen = p.density > 0 ? rank < n_keep : before < p.threshold;
      const bool forced = j < p.keep_first || (j <= diag && j > diag - p.keep_local);
      const bool keep = (chosen || forced) && vis.some;
      partial = keep && !vis.every, full = keep && vis.every;
      dense_partial[j] = partial, dense_full[j] = full;
    }
    lists.add(partial, full, j, s_warp);
  }
  lists.finish(p.kv_count + row, p.full_count + row);
}

// Per (batch, head, key block j): the query blocks whose row lists hold j, partial and full.
__global__ void __launch_bounds__(kThreads) block_columns_kernel(EstimateParams p) {
  __shared__ int s_warp[2][kWarps];
  const int j = blockIdx.x;
  const int64_t bh = int64_t(blockIdx.z) * p.hq + blockIdx.y;
  const uint8_t* dense_partial = p.dense + bh * p.nq * p.nk + j;
  const uint8_t* dense_full = dense_partial + int64_t(p.batch) * p.hq * p.nq * p.nk;
  const int64_t col = bh * p.nk + j;
  ListPair lists{{p.q_index + col * p.nq, p.full_q_index + col * p.nq}, p.nq};
  for (int i0 = 0; i0 < p.nq; i0 += kThreads) {
    const int i = i0 + threadIdx.x;
    const bool partial = i < p.nq && dense_partial[int64_t(i) * p.nk];
    const bool full = i < p.nq && dense_full[int64_t(i) * p.nk];
    lists.add(partial, full, i, s_warp);
  }
  lists.finish(p.q_count + col, p.full_q_count + col);
}

void check(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn4: estimate_block_mask ") + what + ": " + cudaGetErrorString(err));
  }
}

template <typename T>
void launch_means(const MeansArgs& a, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int cols = a.heads * a.d;
  const bool vec = a.d % kVec == 0 && a.b_stride % kVec == 0 && a.row_stride % kVec == 0 &&
                   a.head_stride % kVec == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
  const int per = vec ? kVec : 1;
  const dim3 grid((cols + kThreads * per - 1) / (kThreads * per), a.n, a.batch);
  const T* x = static_cast<const T*>(a.x);
  if (vec) {
    block_means_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(x, a.out, a.s, a.n, cols, a.d, a.block, a.b_stride,
                                                               a.row_stride, a.head_stride);
  } else {
    block_means_kernel<T, 1><<<grid, kThreads, 0, stream>>>(x, a.out, a.s, a.n, cols, a.d, a.block, a.b_stride,
                                                            a.row_stride, a.head_stride);
  }
  check("block means");
}

}  // namespace

void launch_block_means(const MeansArgs& a, cudaStream_t stream) {
  switch (a.dtype) {
    case MeansArgs::kF32: return launch_means<float>(a, stream);
    case MeansArgs::kF16: return launch_means<__half>(a, stream);
    case MeansArgs::kBF16: return launch_means<__nv_bfloat16>(a, stream);
  }
}

size_t estimate_smem_bytes(int nk, int d) { return size_t(nk + d) * sizeof(float); }

void launch_estimate_blocks(const EstimateParams& p, cudaStream_t stream) {
  estimate_rows_kernel<<<dim3(p.nq, p.hq, p.batch), kThreads, estimate_smem_bytes(p.nk, p.d), stream>>>(p);
  check("rows");
  block_columns_kernel<<<dim3(p.nk, p.hq, p.batch), kThreads, 0, stream>>>(p);
  check("columns");
}

}  // namespace flash4

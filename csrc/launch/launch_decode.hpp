// Host side of the decode path: append (rotary) kernel when the call appends or rotates, the split-KV
// kernel, and the combine kernel when the keys were split. Included once per generated decode instantiation.
#pragma once

#include "../common/tile_size.h"
#include "../decode/append_kv.hpp"
#include "../decode/combine.hpp"
#include "../decode/kernel_decode.hpp"
#include "../dispatch.h"
#include "launch_common.hpp"

namespace flash4 {

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads) decode_entry(typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) char smem[];
  Kernel{}(params, smem);
#endif
}

template <class Combine>
__global__ void __launch_bounds__(Combine::kNumThreads) decode_combine_entry(DecodeParams const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  Combine{}(params);
#endif
}

template <class Append, class KVSource>
__global__ void __launch_bounds__(Append::kNumThreads) append_kv_entry(DecodeParams const params,
                                                                        AppendParams const append) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  Append{}.template run<KVSource>(params, append);
#endif
}

template <DType kDType, int kHeadDim, bool kPaged>
void run_decode_impl(const DecodeParams& p, const AppendParams* append, cudaStream_t stream) {
  using Element = CutlassElement<kDType>;
  using KVSource = std::conditional_t<kPaged, PagedKV, ContiguousKV>;
  if (append != nullptr) {
    using Append = AppendKV<Element>;
    const int64_t rows = Append::rows(p, *append);
    if (rows > 0) {
      const unsigned blocks = unsigned((rows + Append::kWarps - 1) / Append::kWarps);
      append_kv_entry<Append, KVSource><<<blocks, Append::kNumThreads, 0, stream>>>(p, *append);
      check_cuda(cudaGetLastError(), "decode append kernel launch");
    }
  }
  constexpr DecodeTile tile = decode_tile(kHeadDim);
  using Kernel = DecodeKernel<DecodeTraits<Element, kHeadDim, tile.block_n, tile.stages>, KVSource>;
  launch_kernel<Kernel>(decode_entry<Kernel>, p, stream, "decode kernel launch");
  if (p.num_splits > 1) {
    using Combine = DecodeCombine<Element, kHeadDim>;
    decode_combine_entry<Combine><<<Combine::grid(p), Combine::kNumThreads, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "decode combine kernel launch");
  }
}

}  // namespace flash4

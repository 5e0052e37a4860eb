// Host side of the decode path: append (rotary) kernel when the call appends or rotates, the split-KV
// kernel, and the combine kernel when the keys were split. Included once per generated decode instantiation.
// The three are short, back to back, and each reads what the one before wrote, so each is launched with
// programmatic serialization (launch_entry): its launch overlaps the previous kernel's tail and it waits
// (wait_prior_grid) before its first global access. The decode kernel lets the combine be scheduled once its
// key loop is done.
#pragma once

#include "../common/sync.hpp"
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
  wait_prior_grid();
  Kernel{}(params, smem);
#endif
}

template <class Combine>
__global__ void __launch_bounds__(Combine::kNumThreads) decode_combine_entry(DecodeParams const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  wait_prior_grid();
  Combine{}(params);
#endif
}

template <class Append, class KVSource>
__global__ void __launch_bounds__(Append::kNumThreads) append_kv_entry(DecodeParams const params,
                                                                        AppendParams const append) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  allow_dependent_grid();  // the decode kernel waits for all of this grid anyway
  wait_prior_grid();
  Append{}.template run<KVSource>(params, append);
#endif
}

// kKV8: e4m3 caches (q and out kDType).
template <DType kDType, int kHeadDim, bool kPaged, bool kKV8>
void run_decode_impl(const DecodeParams& p, const AppendParams* append, cudaStream_t stream) {
  using Element = CutlassElement<kDType>;
  using ElementKV = std::conditional_t<kKV8, cutlass::float_e4m3_t, Element>;
  using KVSource = std::conditional_t<kPaged, PagedKV, ContiguousKV>;
  // The table's tile where the device's shared memory holds it, else the 99 KB row (tile_size.h; the same
  // kBlockN, which the host's split count assumed). Checked before the append changes the cache.
  constexpr DecodeTile large = decode_tile(kHeadDim, false, kKV8), small = decode_tile(kHeadDim, true, kKV8);
  static_assert(large.block_n == small.block_n);
  using Large = DecodeKernel<DecodeTraits<Element, kHeadDim, large.block_n, large.stages, ElementKV>, KVSource>;
  using Small = DecodeKernel<DecodeTraits<Element, kHeadDim, small.block_n, small.stages, ElementKV>, KVSource>;
  // The host's split count (decode_ctas_per_sm) sized the CTAs as these.
  static_assert(Large::kSmemBytes == decode_smem_bytes(kHeadDim, kPaged, kKV8));
  static_assert(Small::kSmemBytes == decode_smem_bytes(kHeadDim, kPaged, kKV8, true));
  const bool use_large = smem_fits(p, Large::kSmemBytes);
  if (!use_large) require_smem(p, Small::kSmemBytes, "decode kernel");
  if (append != nullptr) {
    using Append = AppendKV<ElementKV>;  // fp8: a copy (no rotary: the binding checks)
    const int64_t rows = Append::rows(p, *append);
    if (rows > 0) {
      const unsigned blocks = unsigned((rows + Append::kWarps - 1) / Append::kWarps);
      launch_entry(append_kv_entry<Append, KVSource>, dim3(blocks), Append::kNumThreads, 0, stream, true,
                   "decode append kernel launch", p, *append);
    }
  }
  if (use_large) {
    launch_kernel<Large>(decode_entry<Large>, p, stream, "decode kernel launch", /*overlap_prior=*/true);
  } else if constexpr (!std::is_same_v<Large, Small>) {
    launch_kernel<Small>(decode_entry<Small>, p, stream, "decode kernel launch", /*overlap_prior=*/true);
  }
  if (p.num_splits > 1) {
    using Combine = DecodeCombine<Element, kHeadDim>;
    launch_entry(decode_combine_entry<Combine>, Combine::grid(p), Combine::kNumThreads, 0, stream, true,
                 "decode combine kernel launch", p);
  }
}

}  // namespace flash4

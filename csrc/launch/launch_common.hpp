// Host-side helpers shared by the launch templates.
#pragma once

#include <cuda_runtime_api.h>

#include <cutlass/numeric_types.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../params.h"
#include "../sm90/kernel_entry_sm90.hpp"

namespace flash4 {

template <DType kDType>
using CutlassElement = std::conditional_t<kDType == DType::kBF16, cutlass::bfloat16_t, cutlass::half_t>;

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn4: ") + what + ": " + cudaGetErrorString(err));
  }
}

// Whether a fixed-length batch's lengths are multiples of the tile, so the kernels' kEven variant (no row
// predicates, no key-end mask) serves it. Packed batches and seqused never qualify.
template <class HostParams>
bool tiles_even(const HostParams& p, int block_m, int block_n) {
  return p.cu_seqlens_q == nullptr && p.seqused_q == nullptr && p.seqused_k == nullptr &&
         p.seqlen_q % block_m == 0 && p.seqlen_k % block_n == 0;
}

// Launches `entry` (a kernel_entry_smXX<Kernel>) with Kernel's Params built from the torch-free params `p`.
template <class Kernel, class Entry, class HostParams>
void launch_kernel(Entry entry, const HostParams& p, cudaStream_t stream, const char* what) {
  // Beyond 48 KB a kernel must opt in to dynamic shared memory. The attribute is sticky but belongs to
  // the current device's context, so it is set once per device (bit d of a mask), not once per process.
  static std::atomic<uint64_t> attr_set_on_device{0};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(attr_set_on_device.load(std::memory_order_relaxed) & bit)) {
    check_cuda(cudaFuncSetAttribute(entry, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes),
               "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    attr_set_on_device.fetch_or(bit, std::memory_order_relaxed);
  }
  const typename Kernel::Params params = Kernel::to_params(p);
  entry<<<Kernel::grid(p), Kernel::kNumThreads, Kernel::kSmemBytes, stream>>>(params);
  check_cuda(cudaGetLastError(), what);
}

// Builds Kernel's Params from the torch-free params `p` and launches kernel_entry_sm90<Kernel> on `stream`.
template <class Kernel, class HostParams>
void launch_sm90(const HostParams& p, cudaStream_t stream, const char* what) {
  launch_kernel<Kernel>(kernel_entry_sm90<Kernel>, p, stream, what);
}

}  // namespace flash4

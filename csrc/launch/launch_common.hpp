// Host-side helpers shared by the launch templates.
#pragma once

#include <cuda_runtime.h>

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
using CutlassElement =
    std::conditional_t<kDType == DType::kE4M3, cutlass::float_e4m3_t,
                       std::conditional_t<kDType == DType::kBF16, cutlass::bfloat16_t, cutlass::half_t>>;

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

// Whether a kernel taking `bytes` of shared memory fits this call's budget (params' smem_per_block: the device's
// opt-in maximum or FLASH_ATTN4_SMEM_CAP; 0 = not known, no limit).
template <class HostParams>
bool smem_fits(const HostParams& p, int bytes) {
  return p.smem_per_block <= 0 || bytes <= p.smem_per_block;
}

// A launcher whose smallest tile does not fit the budget says so (before anything runs).
template <class HostParams>
void require_smem(const HostParams& p, int bytes, const char* what) {
  if (!smem_fits(p, bytes)) {
    throw std::runtime_error(std::string("flash_attn4: the ") + what + " needs " + std::to_string(bytes) +
                             " bytes of shared memory a block and this device (or FLASH_ATTN4_SMEM_CAP) allows " +
                             std::to_string(p.smem_per_block));
  }
}

// Whether the current device runs programmatic dependent launch (sm90 and later), asked once per device.
inline bool device_has_pdl() {
  static std::atomic<uint64_t> known{0}, has{0};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(known.load(std::memory_order_relaxed) & bit)) {
    int major = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
    if (major >= 9) has.fetch_or(bit, std::memory_order_relaxed);
    known.fetch_or(bit, std::memory_order_relaxed);
  }
  return has.load(std::memory_order_relaxed) & bit;
}

// Launches `entry` on `stream`. With `overlap_prior` (and a device that has it) the launch carries the
// programmatic-serialization attribute: the kernel may be scheduled while the previous kernel in the stream
// is still running and must call wait_prior_grid() (common/sync.hpp) before it touches global memory.
template <class... KernelArgs, class... Args>
void launch_entry(void (*entry)(KernelArgs...), dim3 grid, int threads, int smem_bytes, cudaStream_t stream,
                  bool overlap_prior, const char* what, Args const&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = overlap_prior && device_has_pdl() ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&config, entry, args...), what);
}

// Launches `entry` (a kernel_entry_smXX<Kernel>) with Kernel's Params built from the torch-free params `p`.
template <class Kernel, class Entry, class HostParams>
void launch_kernel(Entry entry, const HostParams& p, cudaStream_t stream, const char* what,
                   bool overlap_prior = false) {
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
  if (overlap_prior) {
    launch_entry(entry, Kernel::grid(p), Kernel::kNumThreads, Kernel::kSmemBytes, stream, true, what, params);
    return;
  }
  entry<<<Kernel::grid(p), Kernel::kNumThreads, Kernel::kSmemBytes, stream>>>(params);
  check_cuda(cudaGetLastError(), what);
}

// Builds Kernel's Params from the torch-free params `p` and launches kernel_entry_sm90<Kernel> on `stream`.
template <class Kernel, class HostParams>
void launch_sm90(const HostParams& p, cudaStream_t stream, const char* what) {
  launch_kernel<Kernel>(kernel_entry_sm90<Kernel>, p, stream, what);
}

}  // namespace flash4

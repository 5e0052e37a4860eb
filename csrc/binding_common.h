// Helpers of the binding files (flash_api.cpp, decode_api.cpp): messages, layout and device checks.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

namespace flash4::binding {

using OptTensor = std::optional<at::Tensor>;

// Error messages are assembled with std::to_string and std::string only. Streaming integers into
// c10::str (std::ostringstream) crashed on the H200 machine: the extension, built by that machine's
// newer g++, carried its own ostream<<long whose locale facets did not match the process's libstdc++.
inline std::string str(at::IntArrayRef xs) {
  std::string s = "(";
  for (size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + std::to_string(xs[i]);
  return s + ")";
}
inline std::string str(int64_t x) { return std::to_string(x); }

// TMA descriptors need 16-byte aligned base addresses and strides (8 elements of a 16-bit type, 16 of fp8) and
// a contiguous innermost dimension. The Python side copies inputs that break this; these checks make a direct
// call fail loudly instead of faulting.
inline void check_tma_layout(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, std::string("flash_attn4: ") + name +
                                     " must have a contiguous last dimension (stride 1), got strides " +
                                     str(t.strides()));
  const int64_t per16 = 16 / t.element_size();
  for (int d = 0; d < t.dim() - 1; ++d) {
    TORCH_CHECK(t.stride(d) % per16 == 0, std::string("flash_attn4: every stride of ") + name +
                                              " except the last must be a multiple of " + str(per16) +
                                              " elements (16 bytes) for TMA; got " + str(t.strides()) +
                                              ". Call .contiguous() first.");
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              std::string("flash_attn4: ") + name +
                  " must start at a 16-byte aligned address (got a view with an odd offset); call .contiguous().");
}

// A window side as the kernels take it: -1 (unbounded) becomes `unbounded`, a value past every length, so no
// kernel branches on "unbounded"; larger sides are cut there too.
inline int window_side(int64_t side, int unbounded) {
  return side < 0 ? unbounded : int(std::min<int64_t>(side, unbounded));
}

inline int device_arch(const at::Tensor& t) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(t.get_device());
  return prop->major * 10 + prop->minor;
}

// The kernel family a call asks for (flash_attn4/_build_info.py kernel_arch decides it, FLASH_ATTN4_FORCE_SM80
// included): 90 runs the sm_90a kernels, an arch-specific target that only compute capability 9.0 executes; 80
// the Ampere-path kernels, built for sm_80 (and sm_90, so Hopper can run them), any capability from 8.0 on.
inline void check_kernel_arch(const at::Tensor& q, int64_t kernel_arch) {
  const int arch = device_arch(q);
  TORCH_CHECK(kernel_arch == 90 || kernel_arch == 80,
              "flash_attn4: kernel_arch must be 90 or 80 (flash_attn4._build_info.kernel_arch picks it), got " +
                  str(kernel_arch));
  TORCH_CHECK(kernel_arch != 90 || arch == 90,
              "flash_attn4: the sm90 kernels run on compute capability 9.0 only; this device is sm_" + str(arch));
  TORCH_CHECK(kernel_arch != 80 || arch >= 80,
              "flash_attn4: the Ampere-path kernels need compute capability 8.0 or newer; this device is sm_" +
                  str(arch));
}

// Multiprocessor count of t's device (cached by torch).
inline int num_sms(const at::Tensor& t) {
  return at::cuda::getDeviceProperties(t.get_device())->multiProcessorCount;
}

// An on / off environment variable: "1" is on; unset, empty or "0" off; anything else is an error.
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0' || std::string(v) == "0") return false;
  TORCH_CHECK(std::string(v) == "1", std::string("flash_attn4: ") + name + " must be 0 or 1, got '" + v + "'");
  return true;
}

// Shared memory a CTA may opt in to on t's device, lowered by FLASH_ATTN4_SMEM_CAP (bytes) when that is set
// and smaller: the cap makes the Ampere-path launchers pick the tiles a card with that much would get (e.g.
// 101376, the 99 KB of sm86 / 89 / 120), so one GPU can test them. Read on every call (a getenv), so that a
// test can change it.
inline int smem_per_block(const at::Tensor& t) {
  const int device = int(at::cuda::getDeviceProperties(t.get_device())->sharedMemPerBlockOptin);
  const char* cap = std::getenv("FLASH_ATTN4_SMEM_CAP");
  if (cap == nullptr || *cap == '\0') return device;
  char* end = nullptr;
  const long v = std::strtol(cap, &end, 10);
  TORCH_CHECK(end != cap && *end == '\0' && v > 0,
              std::string("flash_attn4: FLASH_ATTN4_SMEM_CAP must be a positive number of bytes, got '") + cap + "'");
  return v < device ? int(v) : device;
}

}  // namespace flash4::binding

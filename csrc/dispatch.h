// Run-time dispatch: (direction, arch, dtype, head dim, causal, local) -> launcher.
//
// The table itself (kernel_table.cpp) is written by generate_kernels.py together with the
// instantiations, so a pruned build (FLASH_ATTN4_HDIMS=128 ...) prunes the table at the same time and
// nobody maintains a hand-written dtype x hdim ladder.
#pragma once

#include <cuda_runtime_api.h>

#include "params.h"

namespace flash4 {

using FwdLauncher = void (*)(const FwdParams&, cudaStream_t);

struct FwdKernelEntry {
  int arch;  // 90 for the sm_90a kernels
  DType dtype;
  int head_dim;
  int head_dim_v;  // v's and o's: head_dim, or smaller in the MLA instantiations (192 / 128)
  bool causal;
  bool local;  // sliding window (BlockMask's kLocal); never together with causal
  bool sparse;  // walks a block mask's lists (SparseList) instead of the band the mask leaves
  bool alibi;   // adds the ALiBi bias (score_bias.hpp)
  bool dropout;  // drops probabilities (dropout.hpp)
  FwdLauncher launch;
  const char* name;
};

// Defined in the generated kernel_table.cpp.
extern const FwdKernelEntry kFwdKernels[];
extern const int kNumFwdKernels;

// Returns nullptr when no instantiation matches (the binding turns that into a clear error).
inline const FwdKernelEntry* find_fwd_kernel(int arch, DType dtype, int head_dim, bool causal, bool local,
                                             bool sparse = false, bool alibi = false, bool dropout = false,
                                             int head_dim_v = 0) {
  if (head_dim_v == 0) head_dim_v = head_dim;
  for (int i = 0; i < kNumFwdKernels; ++i) {
    const FwdKernelEntry& e = kFwdKernels[i];
    if (e.arch == arch && e.dtype == dtype && e.head_dim == head_dim && e.head_dim_v == head_dim_v &&
        e.causal == causal && e.local == local && e.sparse == sparse && e.alibi == alibi && e.dropout == dropout) {
      return &e;
    }
  }
  return nullptr;
}

using BwdLauncher = void (*)(const BwdParams&, cudaStream_t);

struct BwdKernelEntry {
  int arch;
  DType dtype;
  int head_dim;
  int head_dim_v;  // as FwdKernelEntry's
  bool causal;
  bool local;
  bool sparse;  // walks a block mask's transposed lists (SparseList)
  bool alibi;
  bool dropout;
  BwdLauncher launch;
  const char* name;
};

extern const BwdKernelEntry kBwdKernels[];
extern const int kNumBwdKernels;

inline const BwdKernelEntry* find_bwd_kernel(int arch, DType dtype, int head_dim, bool causal, bool local,
                                             bool sparse = false, bool alibi = false, bool dropout = false,
                                             int head_dim_v = 0) {
  if (head_dim_v == 0) head_dim_v = head_dim;
  for (int i = 0; i < kNumBwdKernels; ++i) {
    const BwdKernelEntry& e = kBwdKernels[i];
    if (e.arch == arch && e.dtype == dtype && e.head_dim == head_dim && e.head_dim_v == head_dim_v &&
        e.causal == causal && e.local == local && e.sparse == sparse && e.alibi == alibi && e.dropout == dropout) {
      return &e;
    }
  }
  return nullptr;
}

// Decode (split-KV, KV caches): one family for every arch from sm80 on (decode/kernel_decode.hpp), per
// (dtype, head dim, paged cache, fp8 cache). `append` non-null: the append / rotary kernel runs first.
using DecodeLauncher = void (*)(const DecodeParams&, const AppendParams*, cudaStream_t);

struct DecodeKernelEntry {
  DType dtype;
  int head_dim;
  bool paged;
  bool kv8;  // e4m3 caches (q and out `dtype`)
  DecodeLauncher launch;
  const char* name;
};

extern const DecodeKernelEntry kDecodeKernels[];
extern const int kNumDecodeKernels;

inline const DecodeKernelEntry* find_decode_kernel(DType dtype, int head_dim, bool paged, bool kv8 = false) {
  for (int i = 0; i < kNumDecodeKernels; ++i) {
    const DecodeKernelEntry& e = kDecodeKernels[i];
    if (e.dtype == dtype && e.head_dim == head_dim && e.paged == paged && e.kv8 == kv8) return &e;
  }
  return nullptr;
}

// Declared here, defined (and explicitly instantiated, one combination per .cu) in launch/.
// Iter: DenseBand / SparseList; Bias (the score modifier): NoBias / Alibi / Dropout (sm90 only); kHeadDimV: v's
// head dim where it differs from q / k's (MLA, sm90 only).
template <int Arch, DType kDType, int kHeadDim, bool kCausal, bool kLocal, class Iter = DenseBand,
          class Bias = NoBias, int kHeadDimV = kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream);
template <int Arch, DType kDType, int kHeadDim, bool kCausal, bool kLocal, class Iter = DenseBand,
          class Bias = NoBias, int kHeadDimV = kHeadDim>
void run_bwd(const BwdParams& params, cudaStream_t stream);
template <DType kDType, int kHeadDim, bool kPaged, bool kKV8>
void run_decode(const DecodeParams& params, const AppendParams* append, cudaStream_t stream);

}  // namespace flash4

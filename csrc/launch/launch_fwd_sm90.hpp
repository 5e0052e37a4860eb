// Host side of the sm90 forward: picks the tile for (head dim, causal) and launches. Included once per
// generated instantiation .cu.
#pragma once

#include "../common/dropout.hpp"
#include "../common/tile_size.h"
#include "../dispatch.h"
#include "../sm90/kernel_fwd_persistent_sm90.hpp"
#include "../sm90/kernel_fwd_sm90.hpp"
#include "../sm90/kernel_traits_fwd_sm90.hpp"
#include "launch_common.hpp"

namespace flash4 {

// The launches without a score bias: block-sparse, persistent (windows), softcap or plain. SoftcapTraits: the
// softcap kernels' tile (128 rows where Traits has 192: with three warpgroups the softcap kernel spilled 20 B
// in 160 registers).
template <class Traits, bool kCausal, bool kLocal, class Iter, class SoftcapTraits = Traits>
void run_fwd_sm90_unbiased(const FwdParams& p, cudaStream_t stream) {
  if constexpr (kIsSparse<Iter>) {
    if (p.softcap > 0.f) {
      launch_sm90<FwdKernelSm90<Traits, kCausal, kLocal, true, Iter>>(p, stream, "block-sparse forward (softcap)");
    } else {
      launch_sm90<FwdKernelSm90<Traits, kCausal, kLocal, false, Iter>>(p, stream, "block-sparse forward launch");
    }
    return;
  }
  // Softcap is its own kernel (see MainloopFwdSm90), chosen here so the dispatch table stays per mask.
  // Sliding windows of fixed-length batches at head dims 64 and 128, when the window is at most half the
  // sequence (so that nearly every tile costs the same), take the persistent kernel: H200, window 4096 at 32k,
  // 1.762 -> 1.713 ms, same run. Wider windows have tiles as unequal as causal
  // ones, which its static schedule does not balance (the whole causal triangle through it: 13% slower than
  // the causal kernel); packed batches and the other head dims were not measured with it.
  auto launch = [&](auto traits, auto softcap) {
    using T = decltype(traits);
    constexpr bool kSoftcap = decltype(softcap)::value;
    if constexpr (kLocal && (T::kHeadDim == 64 || T::kHeadDim == 128)) {
      const bool uniform_tiles = p.cu_seqlens_q == nullptr && p.seqused_q == nullptr && p.seqused_k == nullptr &&
                                 FwdKernelSm90<T, kCausal, kLocal, kSoftcap>::tail_blocks(p) > 0;
      if (uniform_tiles) {
        launch_sm90<FwdPersistentKernelSm90<T, kCausal, kLocal, kSoftcap>>(
            p, stream, kSoftcap ? "persistent forward launch (softcap)" : "persistent forward launch");
        return;
      }
    }
    launch_sm90<FwdKernelSm90<T, kCausal, kLocal, kSoftcap>>(
        p, stream, kSoftcap ? "forward kernel launch (softcap)" : "forward kernel launch");
  };
  if (p.softcap > 0.f) {
    launch(SoftcapTraits{}, cute::true_type{});
  } else {
    launch(Traits{}, cute::false_type{});
  }
}

template <DType kDType, int kHeadDim, bool kCausal, bool kLocal, class Iter = DenseBand, class Bias = NoBias,
          int kHeadDimV = kHeadDim>
void run_fwd_sm90_16bit(const FwdParams& p, cudaStream_t stream) {
  // Windows mask on both sides: they take the causal tiles (smaller kBlockN, fewer registers for masks).
  // Block-sparse kernels too: their kBlockN must divide the mask's 128-key blocks (causal tiles: 128 up to
  // head dim 128, 64 at 256).
  constexpr bool kPlain = !kIsSparse<Iter> && !Bias::kEnabled && !Bias::kDrops;
  constexpr FwdTileSm90 tile = fwd_tile_sm90(kHeadDim, kCausal || kLocal || kIsSparse<Iter>, kHeadDimV, kPlain);
  using Element = CutlassElement<kDType>;
  using Traits = FwdTraitsSm90<Element, kHeadDim, tile.block_m, tile.block_n, tile.stages, Element, kHeadDimV>;
  if constexpr (Bias::kEnabled) {
    // Biased scores take the one-tile-per-CTA kernel (no softcap: the binding checks).
    launch_sm90<FwdKernelSm90<Traits, kCausal, kLocal, false, Iter, Bias>>(p, stream, "forward launch (ALiBi)");
  } else if constexpr (Bias::kDrops) {
    // Dropout takes the one-tile-per-CTA kernel, without softcap (the binding checks: the backward's fused
    // dropout pass has no softcap derivative).
    launch_sm90<FwdKernelSm90<Traits, kCausal, kLocal, false, Iter, Bias>>(p, stream, "forward launch (dropout)");
  } else {
    using SoftcapTraits = FwdTraitsSm90<Element, kHeadDim, 128, tile.block_n, tile.stages, Element, kHeadDimV>;
    run_fwd_sm90_unbiased<Traits, kCausal, kLocal, Iter, SoftcapTraits>(p, stream);
  }
}

// fp8 q, k and V^T (the binding's pre-pass), bf16 out; no softcap (the binding checks), dense masks.
template <int kHeadDim, bool kCausal, bool kLocal>
void run_fwd_sm90_fp8(const FwdParams& p, cudaStream_t stream) {
  constexpr FwdTileSm90 tile = fwd_tile_sm90_fp8(kHeadDim, kCausal || kLocal);
  using Traits =
      FwdTraitsSm90<cutlass::float_e4m3_t, kHeadDim, tile.block_m, tile.block_n, tile.stages, cutlass::bfloat16_t>;
  launch_sm90<FwdKernelSm90<Traits, kCausal, kLocal, false>>(p, stream, "fp8 forward kernel launch");
}

// kHeadDimV: v's and o's head dim (MLA instantiations: below kHeadDim).
template <DType kDType, int kHeadDim, bool kCausal, bool kLocal, class Iter = DenseBand, class Bias = NoBias,
          int kHeadDimV = kHeadDim>
void run_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  if constexpr (kDType == DType::kE4M3) {
    static_assert(!kIsSparse<Iter> && !Bias::kEnabled && !Bias::kDrops, "no block-sparse, biased or dropout fp8 kernel");
    static_assert(kHeadDimV == kHeadDim, "no MLA fp8 kernel");
    run_fwd_sm90_fp8<kHeadDim, kCausal, kLocal>(p, stream);
  } else {
    run_fwd_sm90_16bit<kDType, kHeadDim, kCausal, kLocal, Iter, Bias, kHeadDimV>(p, stream);
  }
}

}  // namespace flash4

// The sm90 backward's score math on the S^T and dP^T accumulators (rowcol views: keys x queries), between
// the GEMMs of a step: P^T from S^T and the saved lse, dS^T from dP^T, P^T and D. Softcap lives here (the
// only score modifier so far); a new one (ALiBi, sinks) is another transform of S^T before the exponential
// and its derivative in ds_from_dp; a score bias (common/score_bias.hpp) only changes P, since it is constant
// in the scores. `Params` is the mainloop's (scale_log2, softcap_scale).
#pragma once

#include <cute/tensor.hpp>

#include "../common/fast_math.hpp"
#include "../common/mask.hpp"  // apply_softcap
#include "../common/score_bias.hpp"

namespace flash4 {

using namespace cute;

template <int kBlockM, int kBlockN>
struct ScoresBwdSm90 {
  // P^T = exp2(S^T * scale_log2 - lse_log2[q]) in place; masked entries are 0. Rows of Q past seqlen_q have
  // lse_log2 = +inf (pre-pass), so they give 0 without a mask. lse_s points at this thread's first query
  // column; tScS0_rc (thread 0's coordinates) gives the other columns' offsets, which fold to immediates.
  template <class Params, class Mask, class Bias, class TS, class TC, class TC0>
  CUTE_DEVICE static void probabilities(Params const& params, Mask const& bm, Bias const& bias, TS& tSrS_rc,
                                        TC const& tScS_rc, TC0 const& tScS0_rc, const float* lse_s, int n_block,
                                        int m_block) {
    const int key0 = n_block * kBlockN, query0 = m_block * kBlockM;
    const bool need_mask = bm.tile_needs_mask(m_block, n_block);
    if constexpr (Bias::kEnabled) {
      bias.template apply</*kRowsAreQueries=*/false>(tSrS_rc, tScS_rc, tScS0_rc, key0, query0);
    } else if (params.softcap_scale != 0.f) {
      apply_softcap(tSrS_rc, params.softcap_scale);
    }
#pragma unroll
    for (int r = 0; r < size<0>(tSrS_rc); ++r) {
#pragma unroll
      for (int c = 0; c < size<1>(tSrS_rc); ++c) {
        tSrS_rc(r, c) = exp2_approx(fmaf(tSrS_rc(r, c), params.scale_log2, -lse_s[get<1>(tScS0_rc(r, c))]));
      }
    }
    // Masking is a separate pass that only the boundary blocks take, so the common path carries no index
    // arithmetic (it was what pushed the causal kernel into spilling).
    if (need_mask) {
#pragma unroll
      for (int r = 0; r < size<0>(tSrS_rc); ++r) {
        const int key = key0 + get<0>(tScS_rc(r, 0));
#pragma unroll
        for (int c = 0; c < size<1>(tSrS_rc); ++c) {
          const int query = query0 + get<1>(tScS_rc(r, c));
          if (bm.masked(query, key)) tSrS_rc(r, c) = 0.f;
        }
      }
    }
  }

  // dS^T = P^T * (dP^T - D[q]), written over dP^T's registers (D columns read as in probabilities()).
  // With softcap the score was cap * t, t = tanh(s * scale / cap), so dS picks up dt/ds ~ (1 - t^2); t is
  // recovered from P itself (log2 P = t * scale_log2 - lse_log2) instead of living in more registers.
  template <class Params, class TdP, class TS, class TC0>
  CUTE_DEVICE static void ds_from_dp(Params const& params, TdP& tSrdP_rc, TS const& tSrS_rc, TC0 const& tScS0_rc,
                                     const float* dpsum_s, const float* lse_s) {
#pragma unroll
    for (int r = 0; r < size<0>(tSrdP_rc); ++r) {
#pragma unroll
      for (int c = 0; c < size<1>(tSrdP_rc); ++c) {
        tSrdP_rc(r, c) = tSrS_rc(r, c) * (tSrdP_rc(r, c) - dpsum_s[get<1>(tScS0_rc(r, c))]);
      }
    }
    if (params.softcap_scale != 0.f) {
      const float inv_scale_log2 = 1.f / params.scale_log2;
#pragma unroll
      for (int r = 0; r < size<0>(tSrdP_rc); ++r) {
#pragma unroll
        for (int c = 0; c < size<1>(tSrdP_rc); ++c) {
          const float p = tSrS_rc(r, c);
          const float t = (log2_approx(p) + lse_s[get<1>(tScS0_rc(r, c))]) * inv_scale_log2;
          tSrdP_rc(r, c) = p > 0.f ? tSrdP_rc(r, c) * (1.f - t * t) : 0.f;
        }
      }
    }
  }

  // `read` carries across the tiles of a persistent CTA, which loads K and V once per tile (barrier_kv phase
  // kv_phase); after_gemms() runs once this warpgroup's last GEMM of the tile has retired.
};

}  // namespace flash4

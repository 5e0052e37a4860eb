// Small sm90 helpers: register-layout views of WGMMA accumulators and the warpgroup GEMM issue sequence.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "../common/fragment.hpp"  // convert_fragment

namespace flash4 {

using namespace cute;

// A WGMMA accumulator fragment has per-thread shape ((2, 2, N/8), MMA_M, MMA_N):
// (column pair, row +8, block of 8 columns). Softmax wants (rows, cols):
// rows = (row +8, MMA_M), cols = (column pair, column block, MMA_N).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout acc) {
  static_assert(decltype(rank<0>(acc))::value == 3);
  static_assert(decltype(rank(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

template <class Tensor>
CUTE_DEVICE auto make_rowcol_view(Tensor&& t) {
  return make_tensor(t.data(), acc_rowcol_layout(t.layout()));
}

// The same registers seen as the A operand of a register-sourced WGMMA (P in O += P V): the A fragment
// of a 64xKx16 atom is ((2, 2, 2), MMA_M, K/16), i.e. two 8-column blocks per k-step. The accumulator
// of S = Q K^T already holds P's values in exactly that thread/value order, so this is a re-view, no data
// movement.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_a_operand_layout(Layout acc) {
  static_assert(decltype(size<0, 2>(acc))::value % 2 == 0);
  auto l = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(l), get<1>(l), get<2, 0>(l)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(l), get<2>(acc))));
}

// Issues C (+)= A * B for this thread's warpgroup and commits it as one WGMMA batch.
// kZeroInit: overwrite C. kWait >= 0: wait until at most kWait batches are in flight before returning;
// -1 returns right after the issue so the caller can overlap CUDA-core work with the tensor cores.
// The operand fences stop the compiler from moving reads/writes of the register operands across the
// asynchronous MMA.
template <bool kZeroInit, int kWait, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void warpgroup_gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  constexpr bool kRegA = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(tCrA));
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tCrC);
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(tCrA));
}

// Params of a TMA pipeline (cutlass::PipelineTmaAsync) whose producer is thread 0 of warpgroup 0 and whose
// consumer warpgroups each release a stage once.
template <class Pipeline>
CUTE_DEVICE typename Pipeline::Params tma_pipeline_params(uint32_t transaction_bytes, int warp_group,
                                                          int num_consumers) {
  typename Pipeline::Params params;
  params.transaction_bytes = transaction_bytes;
  params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = num_consumers;
  return params;
}

// setmaxnreg moves registers only within the CTA's launch allocation: each thread starts with the kernel's
// register count (__launch_bounds__(threads, 1): 65536 / threads rounded down to 8, at most 255), and a
// setmaxnreg.inc waits until the other warpgroups' releases cover it, forever if they never do.
constexpr int launch_regs(int threads) { return 65536 / threads / 8 * 8 > 255 ? 255 : 65536 / threads / 8 * 8; }
constexpr bool setmaxnreg_fits(int threads, int producer_regs, int consumer_regs) {
  return producer_regs * 128 + consumer_regs * (threads - 128) <= launch_regs(threads) * threads;
}

// Named barriers (id 0 is __syncthreads). bar.sync waits for `threads` arrivals counting itself;
// bar.arrive adds arrivals without waiting: that pair orders two warpgroups without stalling the
// signalling one.
CUTE_DEVICE void named_barrier_sync(int threads, int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
CUTE_DEVICE void named_barrier_arrive(int threads, int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A GMMA operand fragment (a tensor of shared-memory descriptors) whose base descriptor the optimizer cannot
// see: the per-k-step descriptors are derived from it where the GEMM issues, instead of all being made once
// before a loop and kept live (or spilled) through it.
template <class Fragment>
CUTE_DEVICE auto opaque_descriptors(Fragment const& f) {
  auto it = f.data();
  asm volatile("" : "+r"(it.desc_.reg32_[0]));
  return make_tensor(it, f.layout());
}

// The same value, hidden from the optimizer: what is derived from it is computed again, not kept live from
// an earlier computation of the same thing.
CUTE_DEVICE int opaque_int(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

enum class FwdBarrier : int {
  kEpilogue = 1,  // all consumer threads: O tile complete in shared memory
  kWarpGroup0 = 2,  // ping-pong: consumer warpgroup 0 may issue its GEMMs
  kWarpGroup1 = 3,  // ping-pong: consumer warpgroup 1 may issue its GEMMs
  kWarpGroup2 = 4,  // ping-pong: consumer warpgroup 2 (192-row tiles) may issue its GEMMs
};

enum class BwdBarrier : int {
  kdS = 1,        // both consumer warpgroups: dS of this step is in shared memory
  kdQEmpty0 = 2,  // consumer warpgroup w (+ w) and the dQ writer warp: its dQ smem chunk may be overwritten
  kdQFull0 = 4,   // consumer warpgroup w (+ w) and the dQ writer warp: its dQ smem chunk is complete
  kEpilogue = 6,  // both consumer warpgroups: every GEMM done / the dK, dV staging tile written or read
};

// Bulk (non-tensor) asynchronous reduce-add of `bytes` (multiple of 16, both addresses 16-byte aligned)
// fp32 values from shared to global memory, performed at L2; completion tracked by bulk async-groups.
CUTE_DEVICE void bulk_reduce_add_f32(float* gmem, const float* smem, int bytes) {
  const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem), "r"(src),
               "r"(bytes)
               : "memory");
}
CUTE_DEVICE void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until at most N groups still read their shared-memory source.
template <int N>
CUTE_DEVICE void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Until every group has completed, global writes included.
CUTE_DEVICE void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Orders the generic-proxy counter accesses (common/sync.hpp) with the async-proxy (bulk copy) writes they
// guard.
CUTE_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

}  // namespace flash4

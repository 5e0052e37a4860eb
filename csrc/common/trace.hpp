// Optional per-CTA timeline, for finding where a kernel's time goes between its tiles (tools/trace_tiles.py).
// Builds with -DFLASH4_TRACE record clock64() stamps (the SM's own cycle counter, comparable only within an
// SM) of a few events into a buffer the binding hands over (FwdParams / BwdParams::trace, one row of
// kTraceSlots words per CTA in launch order); every other build compiles the calls away.
#pragma once

#include <cute/config.hpp>

#include <cstdint>

namespace flash4 {

constexpr int kTraceSlots = 24;

// The words of a CTA's row (a persistent kernel's: of a tile's). Both directions stamp the events named here,
// some with a meaning of their own per direction. tools/trace_tiles.py reads this enum from this file, so the
// numbering lives in one place.
enum class TraceSlot : int {
  kInfo = 0,              // the SM and the blocks the tile visits (trace_info)
  kStart = 1,             // CTA start (persistent kernels: the tile's start)
  kFirstKV = 2,           // fwd: the first K block is ready; bwd: K and V are ready
  kFirstStep = 3,         // fwd: the first block's softmax is done (prologue); bwd: the first query block is done
  kLoopDone = 4,          // the main loop is done
  kMmaDone = 5,           // fwd: the last P V and the normalization are done; bwd: dK / dV are stored
  kEpilogueDone = 6,      // fwd: the epilogue is done; bwd: the dQ writer warp is done
  kWg1MmaDone = 7,        // warpgroup 1 at kMmaDone
  kProducerStart = 8,     // the producer starts (after setmaxnreg)
  kProducerIssued = 9,    // fwd: Q and the first K are issued (the prefetch point); bwd: K and V are issued
  kConsumerRegs = 10,     // the consumers' registers are allocated (setmaxnreg)
  kQReady = 11,           // fwd: Q is ready
  kEdgeStepStart = 12,    // fwd: the window's masked left-edge step starts
  kEdgeStepEnd = 13,      // fwd: and ends
  kFirstLoopStep = 14,    // fwd: the first step of the loop proper is done
  kWg1FirstKV = 15,       // fwd: warpgroup 1 at kFirstKV
  kWg1FirstStep = 16,     // fwd: warpgroup 1 at kFirstStep
  kWg1LoopDone = 17,      // fwd: warpgroup 1 at kLoopDone
  kWg1EpilogueDone = 18,  // fwd: warpgroup 1 at kEpilogueDone
  kWg1QReady = 19,        // fwd: warpgroup 1 at kQReady
};

// Slot 0 of a row: the SM (high 32 bits) and a kernel-defined count (low 32 bits: blocks the tile visits).
CUTE_DEVICE void trace_info(unsigned long long* trace, int linear, uint32_t count) {
#if defined(FLASH4_TRACE)
  if (trace != nullptr) {
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    trace[int64_t(linear) * kTraceSlots] = (uint64_t(smid) << 32) | count;
  }
#endif
}

CUTE_DEVICE void trace_stamp(unsigned long long* trace, int linear, TraceSlot slot) {
#if defined(FLASH4_TRACE)
  if (trace != nullptr) trace[int64_t(linear) * kTraceSlots + int(slot)] = clock64();
#endif
}

// The row of one CTA, handed to the parts of a kernel that stamp events inside their loops.
struct TraceRow {
  unsigned long long* trace;
  int linear;
  CUTE_DEVICE void stamp(TraceSlot slot) const { trace_stamp(trace, linear, slot); }
};

}  // namespace flash4

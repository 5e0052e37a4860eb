// Optional per-CTA timeline, for finding where a kernel's time goes between its tiles (tools/trace_tiles.py).
// Builds with -DFLASH4_TRACE record clock64() stamps (the SM's own cycle counter, comparable only within an
// SM) of a few events into a buffer the binding hands over (FwdParams / BwdParams::trace, one row of
// kTraceSlots words per CTA in launch order); every other build compiles the calls away.
#pragma once

#include <cute/config.hpp>

#include <cstdint>

namespace flash4 {

constexpr int kTraceSlots = 24;

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

CUTE_DEVICE void trace_stamp(unsigned long long* trace, int linear, int slot) {
#if defined(FLASH4_TRACE)
  if (trace != nullptr) trace[int64_t(linear) * kTraceSlots + slot] = clock64();
#endif
}

// The row of one CTA, handed to the parts of a kernel that stamp events inside their loops.
struct TraceRow {
  unsigned long long* trace;
  int linear;
  CUTE_DEVICE void stamp(int slot) const { trace_stamp(trace, linear, slot); }
};

}  // namespace flash4

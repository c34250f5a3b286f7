// The timeline probe of the Hopper backward (`generate --probe timeline`, read by
// tools/bwd_timeline.py): the first consumer thread of each CTA (and, for the dS stores, the
// producer thread) records where it is, in SM clock cycles, into a global array of the module that
// the tool finds by name. Without FLASHKILN_PROBE_TIMELINE every function here is empty and reads
// no clock, so shipped kernels carry none of it.
#pragma once

namespace flashkiln::hopper {

// Slots per CTA, indexed by blockIdx (x fastest); CTAs past kTimelineCtas record nothing.
enum TimelineSlot : int {
  kSmid,              // %smid
  kStartTime,         // %globaltimer at entry (ns)
  kStartClock,        // clock64 at entry, then at each of the marks below
  kKvClock,           // K and V landed
  kFirstStageClock,   // the first query tile's Q and dO landed
  kSweepEndClock,     // the last query tile's GEMMs done
  kEpilogueClock,     // dK and dV written out (issued)
  kEndTime,           // %globaltimer at the same point (ns)
  kSweepTiles,        // query tiles swept
  kStageWaitClocks,   // the consumer's clocks waiting for its stages' Q and dO (summed over the sweep)
  kDsStoreClocks,     // the producer's clocks storing a full bias's dS tiles (issue to their reads; summed)
  kDqWaitClocks,      // the consumer's clocks waiting for its dQ staging buffer (its writer's last add; summed)
  kTimelineSlots
};
inline constexpr int kTimelineCtas = 1 << 16;

// A span's start, for timeline_add_span (a 32-bit clock: spans are far shorter than its wrap).
struct TimelineSpan {
  unsigned start;
};

}  // namespace flashkiln::hopper

#ifdef FLASHKILN_PROBE_TIMELINE

extern "C" {
__device__ unsigned long long flashkiln_bwd_timeline[flashkiln::hopper::kTimelineCtas * flashkiln::hopper::kTimelineSlots];
}

namespace flashkiln::hopper {

__device__ __forceinline__ unsigned long long* timeline_row() {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  return cta < kTimelineCtas ? flashkiln_bwd_timeline + cta * kTimelineSlots : nullptr;
}

__device__ __forceinline__ void timeline_record(int slot, unsigned long long value) {
  if (unsigned long long* row = timeline_row()) {
    row[slot] = value;
  }
}

__device__ __forceinline__ unsigned long long global_time() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void timeline_clock(int slot) {
  timeline_record(slot, static_cast<unsigned long long>(clock64()));
}

__device__ __forceinline__ void timeline_start() {
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  timeline_record(kSmid, smid);
  timeline_record(kStartTime, global_time());
  timeline_clock(kStartClock);
}

__device__ __forceinline__ void timeline_end() {
  timeline_clock(kEpilogueClock);
  timeline_record(kEndTime, global_time());
}

__device__ __forceinline__ TimelineSpan timeline_span() {
  return {static_cast<unsigned>(clock())};
}

// Adds the clocks since `span` to a slot (a sum over the sweep), without waiting for the add.
__device__ __forceinline__ void timeline_add_span(int slot, TimelineSpan span) {
  if (unsigned long long* row = timeline_row()) {
    atomicAdd(row + slot, static_cast<unsigned long long>(static_cast<unsigned>(clock()) - span.start));
  }
}

}  // namespace flashkiln::hopper

#else

namespace flashkiln::hopper {

__device__ __forceinline__ void timeline_record(int, unsigned long long) {}
__device__ __forceinline__ void timeline_clock(int) {}
__device__ __forceinline__ void timeline_start() {}
__device__ __forceinline__ void timeline_end() {}
__device__ __forceinline__ TimelineSpan timeline_span() { return {0}; }
__device__ __forceinline__ void timeline_add_span(int, TimelineSpan) {}

}  // namespace flashkiln::hopper

#endif

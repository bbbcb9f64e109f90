// A cheap lower bound on elapsed time, to skip clock reads on the hot path.
//
// The stitching policy's free asks whether its stream's fences were polled within the last
// millisecond (stitch/share.cpp); the answer takes a read of the driver's clock, which on a
// GPU host is the wall clock (clock_gettime through the vDSO: tens of nanoseconds on a
// virtual machine, as much as the rest of the free). The processor's cycle counter is read
// in a few nanoseconds. A CycleGate turns an interval of the wall clock into counter ticks,
// with a margin, once it has measured the counter against std::chrono::steady_clock, so a
// caller skips the clock read only where the counter shows that less than `fraction` of
// the interval has passed, that is where the clock's answer is known. Everything else
// (the first reads, a counter that runs slower than measured, a counter that went
// backwards, a driver with a virtual clock) reads the clock as before: the gate changes no
// decision, only how often the clock is read.
//
// Only where the driver's clock is wall time (Driver::wall_clock: the simulated GPU's
// virtual clock moves with its trace, not with the processor) and on x86-64 (the time-stamp
// counter); elsewhere ticks() stays 0 and no read is skipped.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace ccalloc::core {

// The processor's cycle counter, or 0 where there is none the gate uses.
inline std::uint64_t cycle_count() {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return 0;
#endif
}

// How many frees may skip even the counter read after a read that found `ticks_left` ticks
// before the next poll can be due: as many as fit in half of them at the rate of frees
// since the read before (`elapsed` ticks over `frees` frees), at most `max`. Frees far
// apart (a counter that went backwards looks so too) get none.
inline std::uint32_t frees_within(std::uint64_t elapsed, std::uint64_t frees,
                                  std::uint64_t ticks_left, std::uint32_t max) {
  if (frees == 0) return 0;
  const std::uint64_t per_free = elapsed / frees == 0 ? 1 : elapsed / frees;
  const std::uint64_t n = ticks_left / 2 / per_free;
  return n < max ? static_cast<std::uint32_t>(n) : max;
}

class CycleGate {
 public:
  // Calibration waits this long after construction: the counter's rate over 10 ms is known to
  // far better than the margin.
  static constexpr std::int64_t kCalibrationUs = 10'000;

  // `interval_us`: the interval whose `fraction` ticks() measures; `on`: whether the caller's
  // clock is wall time (else the gate stays shut: ticks() is 0).
  CycleGate(std::int64_t interval_us, double fraction, bool on)
      : interval_us_(interval_us),
        fraction_(fraction),
        on_(on && cycle_count() != 0),
        start_cycles_(cycle_count()),
        start_(std::chrono::steady_clock::now()) {}

  // Counter ticks in `fraction` of the interval: fewer than this since a clock read mean
  // less than that much time has passed. 0 until calibrated, and where the gate is off.
  std::uint64_t ticks() const { return ticks_.load(std::memory_order_relaxed); }
  // Ticks that certainly fall within `us` microseconds (`fraction` of them), or 0.
  std::uint64_t ticks_for(std::int64_t us) const {
    const std::uint64_t gate = ticks();
    if (gate == 0 || us <= 0) return 0;
    return static_cast<std::uint64_t>(static_cast<double>(gate) * static_cast<double>(us) /
                                      static_cast<double>(interval_us_));
  }

  // Where the caller read its clock (its hot path's slow branch): calibrates once enough
  // time has passed since construction, and checks the counter against the clock after:
  // `us` is the clock now and `cycles` the counter read after it; `since_us` is the clock at
  // the caller's previous read and `since_cycles` the counter read before that (0 and
  // anything: none). So cycles - since_cycles covers at least the clock's interval however
  // long the thread was preempted between the reads: a pair read the other way round lets
  // one preemption of a tenth of the interval look like a slow counter (on a busy virtual
  // machine, one engine's gate shut in three of seven benchmark runs so). A counter found
  // running slower than calibrated by more than the margin shuts the gate for good.
  void observe(std::uint64_t cycles, std::int64_t us, std::uint64_t since_cycles,
               std::int64_t since_us) {
    if (!on_ || shut_.load(std::memory_order_relaxed)) return;
    const std::uint64_t gate = ticks();
    if (gate == 0) {
      calibrate(cycles);
      return;
    }
    if (since_cycles == 0 || cycles <= since_cycles || us <= since_us) return;
    // Ticks the counter would show for this much clock time at the calibrated rate, less
    // the margin: fewer than that, and a skip could have hidden a due read.
    const double elapsed_us = static_cast<double>(us - since_us);
    const double expected =
        elapsed_us * static_cast<double>(gate) / (static_cast<double>(interval_us_) * fraction_);
    if (elapsed_us >= 100.0 && static_cast<double>(cycles - since_cycles) < fraction_ * expected) {
      shut_.store(true, std::memory_order_relaxed);
      ticks_.store(0, std::memory_order_relaxed);
    }
  }

  bool shut() const { return shut_.load(std::memory_order_relaxed); }
  // Whether the gate may open at all (a wall clock and a cycle counter).
  bool on() const { return on_; }

 private:
  void calibrate(std::uint64_t cycles) {
    const auto elapsed = std::chrono::duration_cast<std::chrono::microseconds>(
                             std::chrono::steady_clock::now() - start_)
                             .count();
    if (elapsed < kCalibrationUs || cycles <= start_cycles_) return;
    const double per_us =
        static_cast<double>(cycles - start_cycles_) / static_cast<double>(elapsed);
    const auto gate =
        static_cast<std::uint64_t>(per_us * static_cast<double>(interval_us_) * fraction_);
    // Concurrent calibrations store about the same value.
    if (gate > 0) ticks_.store(gate, std::memory_order_relaxed);
  }

  const std::int64_t interval_us_;
  const double fraction_;
  const bool on_;
  const std::uint64_t start_cycles_;
  const std::chrono::steady_clock::time_point start_;
  std::atomic<std::uint64_t> ticks_{0};
  std::atomic<bool> shut_{false};
};

}  // namespace ccalloc::core

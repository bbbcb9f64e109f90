// The simulated GPU: a first-class Driver that models a device without one.
//
// It has a capacity; hands out deterministic, 2 MiB-aligned addresses (or, with an address
// oracle, a given sequence of addresses, e.g. the ones a recorded trace got from
// cudaMalloc); reports OOM as a value; keeps streams and events whose completion the
// caller controls; counts every driver call; and accumulates simulated driver time from a
// cost model. Tests, `ccalloc replay` and CI run on it.
//
// Event model: work queued on a stream completes in order. An event recorded on a stream
// completes when the caller completes that event, a later event on the same stream, or the
// whole stream; synchronize calls complete what they wait for. With
// `events_complete_immediately`, every stream is always idle.
//
// Thread safety: all methods are safe to call concurrently.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ccalloc/driver.hpp"

namespace ccalloc::sim {

inline constexpr std::size_t kGiB = std::size_t{1} << 30;

// Simulated cost of each driver call, in microseconds. Defaults from
// shared/reference/perf-and-traces.md: cudaMalloc averaged 59.2 us and cudaFree 46 us in
// ResNet-50 training (§1.1). Synchronisation has no published per-call figure; its default
// is an assumption, stated as such in docs/simulated-gpu.md.
struct CostModel {
  double allocate_us = 59.2;
  double free_us = 46.0;
  double synchronize_us = 10.0;
  double event_record_us = 0.0;
  double event_query_us = 0.0;
};

struct Counters {
  std::uint64_t allocate_calls = 0;  // including the ones that returned OOM
  std::uint64_t allocate_ooms = 0;
  std::uint64_t free_calls = 0;
  std::uint64_t mem_info_calls = 0;
  std::uint64_t event_creates = 0;
  std::uint64_t event_destroys = 0;
  std::uint64_t event_records = 0;
  std::uint64_t event_queries = 0;
  std::uint64_t event_synchronizes = 0;
  std::uint64_t stream_synchronizes = 0;
  bool operator==(const Counters&) const = default;
};

struct Options {
  std::size_t capacity = 141 * kGiB;
  int device = 0;
  CostModel cost;
  // First address handed out; addresses are `alignment`-aligned, lowest free range first.
  DevicePtr base_address = DevicePtr{0x7f0000000000};
  std::size_t alignment = std::size_t{2} << 20;
  bool events_complete_immediately = false;
};

// One device allocation a recorded run obtained: the oracle hands `address` to the next
// allocation if it asks for `size` bytes.
struct OracleEntry {
  DevicePtr address = 0;
  std::size_t size = 0;
};

class SimDriver final : public Driver {
 public:
  explicit SimDriver(Options options = {});
  ~SimDriver() override;

  // Successive device allocations get these addresses while their sizes match; from the
  // first mismatch on (or once the sequence is used up) addresses come from the
  // deterministic allocator again.
  void set_address_oracle(std::vector<OracleEntry> sequence);
  // Number of allocations that got their address from the oracle.
  std::size_t oracle_hits() const;
  // True once the oracle was abandoned because a size differed.
  bool oracle_diverged() const;

  void complete_event(EventId event);
  void complete_stream(StreamId stream);
  void complete_all();
  // Sets the virtual clock returned by now_us().
  void set_time_us(std::int64_t t);

  Counters counters() const;
  double simulated_driver_us() const;
  std::size_t used_bytes() const;
  std::size_t capacity() const { return options_.capacity; }
  const Options& options() const { return options_; }

  // Driver
  int device() const override { return options_.device; }
  DevicePtr allocate(std::size_t bytes) override;
  void free(DevicePtr ptr, std::size_t bytes) override;
  MemInfo mem_info() override;
  EventId create_event() override;
  void destroy_event(EventId event) override;
  void record_event(EventId event, StreamId stream) override;
  bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void synchronize_stream(StreamId stream) override;
  std::int64_t now_us() override;
  std::size_t vm_granularity() override;
  DevicePtr reserve_address_range(std::size_t bytes) override;
  void free_address_range(DevicePtr base, std::size_t bytes) override;
  PhysicalHandle create_physical(std::size_t bytes) override;
  void release_physical(PhysicalHandle handle, std::size_t bytes) override;
  void map(DevicePtr va, std::size_t bytes, PhysicalHandle handle) override;
  void unmap(DevicePtr va, std::size_t bytes) override;
  DevicePtr allocate_async(std::size_t bytes, StreamId stream) override;
  void free_async(DevicePtr ptr, std::size_t bytes, StreamId stream) override;
  void stream_wait_event(StreamId stream, EventId event) override;
  void pool_trim(std::size_t keep_bytes) override;
  PoolUsage pool_usage() override;
  void pool_reset_peaks() override;
  void synchronize_device() override;
  std::string name() const override;

 private:
  struct Event {
    bool recorded = false;
    StreamId stream = 0;
    std::uint64_t sequence = 0;  // position in its stream's queue
  };
  struct StreamState {
    std::uint64_t recorded = 0;   // events recorded so far
    std::uint64_t completed = 0;  // events completed so far (a prefix)
  };

  DevicePtr place(std::size_t bytes);  // requires mutex_
  bool event_done(const Event& e) const;
  Event& event_ref(EventId event);

  const Options options_;
  mutable std::mutex mutex_;
  std::map<DevicePtr, std::size_t> live_;  // address -> size
  std::size_t used_ = 0;
  std::vector<OracleEntry> oracle_;
  std::size_t oracle_next_ = 0;
  std::size_t oracle_hits_ = 0;
  bool oracle_diverged_ = false;
  std::unordered_map<EventId, Event> events_;
  EventId next_event_ = 1;
  std::unordered_map<StreamId, StreamState> streams_;
  Counters counters_;
  double driver_us_ = 0.0;
  std::atomic<std::int64_t> time_us_{0};
};

}  // namespace ccalloc::sim

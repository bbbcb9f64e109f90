// The simulated GPU. Model and contracts: include/ccalloc/sim.hpp and docs/simulated-gpu.md.
//
// State invariants, all under mutex_:
//   used_ == sum of the sizes in live_, and used_ <= capacity;
//   the ranges [address, address + size) in live_ are disjoint and never contain 0;
//   for every stream, completed <= recorded, and an event recorded on it at sequence q is
//   complete exactly when q <= completed (work on a stream finishes in order).
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <iterator>
#include <limits>
#include <string>
#include <utility>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"

namespace ccalloc::sim {
namespace {

constexpr DevicePtr kMaxPtr = std::numeric_limits<DevicePtr>::max();

std::string device_label(int device) {
  return "simulated GPU " + std::to_string(device);
}

// Both helpers throw rather than wrap: a wrapped address would alias a low range and make
// the simulator hand out overlapping memory silently.
DevicePtr align_up(DevicePtr addr, std::size_t alignment, int device) {
  const DevicePtr mask = alignment - 1;
  if (addr > kMaxPtr - mask) {
    throw DriverError("ccalloc: " + device_label(device) + " ran out of virtual address space");
  }
  return (addr + mask) & ~mask;
}

DevicePtr range_end(DevicePtr addr, std::size_t bytes, int device) {
  if (bytes > kMaxPtr - addr) {
    throw DriverError("ccalloc: " + device_label(device) + " ran out of virtual address space");
  }
  return addr + bytes;
}

bool overlaps_live(const std::map<DevicePtr, std::size_t>& live, DevicePtr addr, DevicePtr end) {
  auto next = live.lower_bound(addr);
  if (next != live.end() && next->first < end) return true;
  if (next == live.begin()) return false;
  const auto prev = std::prev(next);
  return prev->first + prev->second > addr;
}

// Completes `e` and everything queued before it on its stream. A template only because
// the event and stream types are private to SimDriver.
template <typename Streams, typename Event>
void complete_through(Streams& streams, const Event& e) {
  if (!e.recorded) return;
  auto& s = streams.at(e.stream);
  s.completed = std::max(s.completed, e.sequence);
}

void check_options(const Options& o) {
  if (o.alignment == 0 || (o.alignment & (o.alignment - 1)) != 0) {
    throw DriverError("ccalloc: " + device_label(o.device) + ": alignment " +
                      std::to_string(o.alignment) + " bytes is not a power of two");
  }
  // 0 means OOM to every caller, so no range may start there.
  if (o.base_address == 0) {
    throw DriverError("ccalloc: " + device_label(o.device) +
                      ": base_address must be non-zero, because 0 is the OOM value");
  }
}

}  // namespace

SimDriver::SimDriver(Options options) : options_(std::move(options)) {
  check_options(options_);
}

SimDriver::~SimDriver() = default;

void SimDriver::set_address_oracle(std::vector<OracleEntry> sequence) {
  std::lock_guard lock(mutex_);
  oracle_ = std::move(sequence);
  oracle_next_ = 0;
  oracle_hits_ = 0;
  oracle_diverged_ = false;
}

std::size_t SimDriver::oracle_hits() const {
  std::lock_guard lock(mutex_);
  return oracle_hits_;
}

bool SimDriver::oracle_diverged() const {
  std::lock_guard lock(mutex_);
  return oracle_diverged_;
}

// The oracle is consulted only for allocations that fit, because a recorded cudaMalloc
// that ran out of memory produced no address to replay.
DevicePtr SimDriver::place(std::size_t bytes) {
  if (!oracle_diverged_ && oracle_next_ < oracle_.size()) {
    const OracleEntry& next = oracle_[oracle_next_];
    // A recorded run's addresses stay meaningful only while both runs ask for the same
    // sizes in the same order; after the first difference, later entries describe a
    // different history, so the oracle is abandoned for good rather than resynchronised.
    const bool usable = next.size == bytes && next.address != 0 &&
                        bytes <= kMaxPtr - next.address &&
                        !overlaps_live(live_, next.address, next.address + bytes);
    if (usable) {
      ++oracle_next_;
      ++oracle_hits_;
      return next.address;
    }
    oracle_diverged_ = true;
  }

  // First fit over the gaps between live ranges, lowest address first. Oracle ranges may
  // be unaligned or lie below base_address, so a range can end anywhere; the scan relies
  // only on live_ being sorted and disjoint.
  DevicePtr addr = align_up(options_.base_address, options_.alignment, options_.device);
  auto it = live_.upper_bound(addr);
  if (it != live_.begin()) {
    const auto prev = std::prev(it);
    const DevicePtr prev_end = prev->first + prev->second;
    if (prev_end > addr) addr = align_up(prev_end, options_.alignment, options_.device);
  }
  for (; it != live_.end(); ++it) {
    const DevicePtr live_end = it->first + it->second;
    if (live_end <= addr) continue;
    if (it->first >= range_end(addr, bytes, options_.device)) break;
    addr = align_up(live_end, options_.alignment, options_.device);
  }
  range_end(addr, bytes, options_.device);
  return addr;
}

DevicePtr SimDriver::allocate(std::size_t bytes) {
  if (bytes == 0) {
    throw DriverError("ccalloc: allocate of 0 bytes on " + device_label(options_.device) +
                      ": the driver needs a positive size");
  }
  std::lock_guard lock(mutex_);
  ++counters_.allocate_calls;
  // A failed cudaMalloc still costs a driver round trip, so OOMs are charged too.
  driver_us_ += options_.cost.allocate_us;
  if (bytes > options_.capacity - used_) {
    ++counters_.allocate_ooms;
    return 0;
  }
  const DevicePtr addr = place(bytes);
  live_.emplace(addr, bytes);
  used_ += bytes;
  return addr;
}

void SimDriver::free(DevicePtr ptr, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const auto it = live_.find(ptr);
  if (it == live_.end() || it->second != bytes) {
    char buf[320];
    if (it == live_.end()) {
      std::snprintf(buf, sizeof buf,
                    "ccalloc: free of pointer 0x%" PRIxPTR
                    " (%zu bytes) on %s, which is not the start of a live allocation",
                    ptr, bytes, device_label(options_.device).c_str());
    } else {
      std::snprintf(buf, sizeof buf,
                    "ccalloc: free of pointer 0x%" PRIxPTR
                    " with size %zu bytes on %s, but it was allocated with %zu bytes",
                    ptr, bytes, device_label(options_.device).c_str(), it->second);
    }
    throw DriverError(buf);
  }
  live_.erase(it);
  used_ -= bytes;
  ++counters_.free_calls;
  driver_us_ += options_.cost.free_us;
}

MemInfo SimDriver::mem_info() {
  std::lock_guard lock(mutex_);
  ++counters_.mem_info_calls;
  return MemInfo{options_.capacity - used_, options_.capacity};
}

EventId SimDriver::create_event() {
  std::lock_guard lock(mutex_);
  ++counters_.event_creates;
  const EventId id = next_event_++;
  events_.emplace(id, Event{});
  return id;
}

void SimDriver::destroy_event(EventId event) {
  std::lock_guard lock(mutex_);
  event_ref(event);
  events_.erase(event);
  ++counters_.event_destroys;
}

void SimDriver::record_event(EventId event, StreamId stream) {
  std::lock_guard lock(mutex_);
  Event& e = event_ref(event);
  StreamState& s = streams_[stream];
  // Re-recording moves the event to the stream's tail, as cudaEventRecord does: it then
  // waits for the new work only.
  e.recorded = true;
  e.stream = stream;
  e.sequence = ++s.recorded;
  if (options_.events_complete_immediately) s.completed = s.recorded;
  ++counters_.event_records;
  driver_us_ += options_.cost.event_record_us;
}

bool SimDriver::query_event(EventId event) {
  std::lock_guard lock(mutex_);
  const Event& e = event_ref(event);
  ++counters_.event_queries;
  driver_us_ += options_.cost.event_query_us;
  return event_done(e);
}

void SimDriver::complete_event(EventId event) {
  std::lock_guard lock(mutex_);
  complete_through(streams_, event_ref(event));
}

void SimDriver::complete_stream(StreamId stream) {
  std::lock_guard lock(mutex_);
  const auto it = streams_.find(stream);
  if (it != streams_.end()) it->second.completed = it->second.recorded;
}

void SimDriver::complete_all() {
  std::lock_guard lock(mutex_);
  for (auto& [id, s] : streams_)
    s.completed = s.recorded;
}

void SimDriver::synchronize_event(EventId event) {
  std::lock_guard lock(mutex_);
  complete_through(streams_, event_ref(event));
  ++counters_.event_synchronizes;
  driver_us_ += options_.cost.synchronize_us;
}

void SimDriver::synchronize_stream(StreamId stream) {
  std::lock_guard lock(mutex_);
  const auto it = streams_.find(stream);
  if (it != streams_.end()) it->second.completed = it->second.recorded;
  ++counters_.stream_synchronizes;
  driver_us_ += options_.cost.synchronize_us;
}

void SimDriver::set_time_us(std::int64_t t) { time_us_.store(t, std::memory_order_relaxed); }

// Read without the mutex: trace entries stamp every allocator action with it.
std::int64_t SimDriver::now_us() { return time_us_.load(std::memory_order_relaxed); }

Counters SimDriver::counters() const {
  std::lock_guard lock(mutex_);
  return counters_;
}

double SimDriver::simulated_driver_us() const {
  std::lock_guard lock(mutex_);
  return driver_us_;
}

std::size_t SimDriver::used_bytes() const {
  std::lock_guard lock(mutex_);
  return used_;
}

std::string SimDriver::name() const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s (%.2f GiB)", device_label(options_.device).c_str(),
                static_cast<double>(options_.capacity) / static_cast<double>(kGiB));
  return buf;
}

bool SimDriver::event_done(const Event& e) const {
  if (!e.recorded) return true;
  return e.sequence <= streams_.at(e.stream).completed;
}

SimDriver::Event& SimDriver::event_ref(EventId event) {
  const auto it = events_.find(event);
  if (it == events_.end()) {
    throw DriverError("ccalloc: unknown event " + std::to_string(event) + " on " +
                      device_label(options_.device) +
                      ": it was never created by this driver, or it was destroyed");
  }
  return it->second;
}


// --- not yet implemented (virtual memory and the stream-ordered pool) ---
namespace {
[[noreturn]] void not_yet(const char* what) {
  throw ccalloc::DriverError(std::string("ccalloc: ") + what + " is not implemented yet");
}
}  // namespace
std::size_t SimDriver::vm_granularity() { not_yet("vm_granularity"); }
DevicePtr SimDriver::reserve_address_range(std::size_t) { not_yet("reserve_address_range"); }
void SimDriver::free_address_range(DevicePtr, std::size_t) { not_yet("free_address_range"); }
PhysicalHandle SimDriver::create_physical(std::size_t) { not_yet("create_physical"); }
void SimDriver::release_physical(PhysicalHandle, std::size_t) { not_yet("release_physical"); }
void SimDriver::map(DevicePtr, std::size_t, PhysicalHandle) { not_yet("map"); }
void SimDriver::unmap(DevicePtr, std::size_t) { not_yet("unmap"); }
DevicePtr SimDriver::allocate_async(std::size_t, StreamId) { not_yet("allocate_async"); }
void SimDriver::free_async(DevicePtr, std::size_t, StreamId) { not_yet("free_async"); }
void SimDriver::stream_wait_event(StreamId, EventId) { not_yet("stream_wait_event"); }
void SimDriver::pool_trim(std::size_t) { not_yet("pool_trim"); }
PoolUsage SimDriver::pool_usage() { not_yet("pool_usage"); }
void SimDriver::pool_reset_peaks() { not_yet("pool_reset_peaks"); }
void SimDriver::synchronize_device() { not_yet("synchronize_device"); }

}  // namespace ccalloc::sim

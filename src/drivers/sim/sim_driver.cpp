// The simulated GPU. Model and contracts: include/ccalloc/sim.hpp and docs/simulated-gpu.md.
//
// State invariants, all under mutex_:
//   used_ == sum of the sizes in live_; physical_bytes_ == sum of the sizes in physical_;
//   used_ + physical_bytes_ + pool_pages_ * vm_granularity <= capacity;
//   the ranges of live_, reservations_ and pool_slots_ are pairwise disjoint and never
//   contain 0; every mapping lies inside one reservation, mappings are disjoint, and a
//   handle is mapped by map() at most once, exactly where its Physical::mapped_at says, and
//   then by no map_range(); Physical::range_mappings counts its map_range() mappings;
//   for every stream, completed <= recorded, and an event (or pool free) recorded on it at
//   sequence q is complete exactly when q <= completed (work on a stream finishes in order);
//   pool pages: pool_pages_ == pages in free_pages_ + pages of small_pages_ + pages of live
//   large allocations; pool_used_ == sum of the requested sizes in pool_live_; the blocks of a
//   small page tile it, no two free blocks are adjacent, and small_free_ holds exactly the
//   free ones.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <string>
#include <utility>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"

namespace ccalloc::sim {
namespace {

constexpr DevicePtr kMaxPtr = std::numeric_limits<DevicePtr>::max();
// The stream-ordered pool rounds requests to this, and serves rounded sizes below
// kPoolSmallLimit from shared pages.
constexpr std::size_t kPoolRounding = 512;
constexpr std::size_t kPoolSmallLimit = std::size_t{1} << 20;

std::string device_label(int device) {
  return "simulated GPU " + std::to_string(device);
}

std::string hex(DevicePtr p) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, p);
  return buf;
}

std::string bytes_str(std::size_t n) {
  return std::to_string(n) + " bytes";
}

// [addr, addr + bytes) as text.
std::string range_str(DevicePtr addr, std::size_t bytes) {
  return "[" + hex(addr) + ", " + hex(addr + bytes) + ") (" + bytes_str(bytes) + ")";
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

// The end of one range of `ranges` that overlaps [addr, end), or 0 if none does. Skipping
// to that end is safe for a first-fit search: no start in [addr, end of the range) avoids
// it.
template <typename Map, typename SizeOf>
DevicePtr overlap_end(const Map& ranges, DevicePtr addr, DevicePtr end, SizeOf size_of) {
  auto next = ranges.lower_bound(addr);
  if (next != ranges.begin()) {
    const auto prev = std::prev(next);
    const DevicePtr prev_end = prev->first + size_of(prev->second);
    if (prev_end > addr) return prev_end;
  }
  if (next != ranges.end() && next->first < end) return next->first + size_of(next->second);
  return 0;
}

std::size_t plain_size(std::size_t s) {
  return s;
}

bool is_power_of_two(std::size_t n) {
  return n != 0 && (n & (n - 1)) == 0;
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
  if (o.base_address == 0 || o.vm_base_address == 0 || o.pool_base_address == 0) {
    throw DriverError("ccalloc: " + device_label(o.device) +
                      ": base_address, vm_base_address and pool_base_address must be non-zero, "
                      "because 0 is the OOM value");
  }
  // Small pool allocations (< 1 MiB) must fit in one page.
  if (!is_power_of_two(o.vm_granularity) || o.vm_granularity < kPoolSmallLimit) {
    throw DriverError("ccalloc: " + device_label(o.device) + ": vm_granularity " +
                      std::to_string(o.vm_granularity) +
                      " bytes is not a power of two of at least 1 MiB");
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
                        !overlaps_any(next.address, next.address + bytes);
    if (usable) {
      ++oracle_next_;
      ++oracle_hits_;
      return next.address;
    }
    oracle_diverged_ = true;
  }

  return first_fit(options_.base_address, bytes, options_.alignment);
}

// The lowest `alignment`-aligned address at or above `start` whose range overlaps no device
// allocation, reservation or pool range. Oracle ranges may be unaligned or lie below
// base_address, so a range can end anywhere; the search relies only on each map being
// sorted and disjoint.
DevicePtr SimDriver::first_fit(DevicePtr start, std::size_t bytes, std::size_t alignment) const {
  const int device = options_.device;
  DevicePtr addr = align_up(start, alignment, device);
  for (;;) {
    const DevicePtr end = range_end(addr, bytes, device);
    const DevicePtr next =
        std::max({overlap_end(live_, addr, end, plain_size),
                  overlap_end(reservations_, addr, end, plain_size),
                  overlap_end(pool_slots_, addr, end, [](const PoolSlot& s) { return s.bytes; })});
    if (next == 0) return addr;
    addr = align_up(next, alignment, device);
  }
}

bool SimDriver::overlaps_any(DevicePtr addr, DevicePtr end) const {
  return overlap_end(live_, addr, end, plain_size) != 0 ||
         overlap_end(reservations_, addr, end, plain_size) != 0 ||
         overlap_end(pool_slots_, addr, end, [](const PoolSlot& s) { return s.bytes; }) != 0;
}

std::size_t SimDriver::device_used() const {
  return used_ + physical_bytes_ + pool_pages_ * options_.vm_granularity;
}

void SimDriver::fail(const std::string& what) const {
  throw DriverError("ccalloc: " + what + " on " + device_label(options_.device));
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
  if (bytes > options_.capacity - device_used()) {
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
  return MemInfo{options_.capacity - device_used(), options_.capacity};
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

void SimDriver::set_time_us(std::int64_t t) {
  time_us_.store(t, std::memory_order_relaxed);
}

// Read without the mutex: trace entries stamp every allocator action with it.
std::int64_t SimDriver::now_us() {
  return time_us_.load(std::memory_order_relaxed);
}

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
  return device_used();
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

// ---------------------------------------------------------------------------------------
// Virtual memory

std::size_t SimDriver::vm_granularity() {
  return options_.vm_granularity;
}

DevicePtr SimDriver::reserve_address_range(std::size_t bytes) {
  const std::size_t g = options_.vm_granularity;
  std::lock_guard lock(mutex_);
  if (bytes == 0 || bytes % g != 0) {
    fail("reserve_address_range of " + bytes_str(bytes) +
         ": the size must be a positive multiple of the granularity (" + bytes_str(g) + ")");
  }
  const DevicePtr base = first_fit(options_.vm_base_address, bytes, g);
  reservations_.emplace(base, bytes);
  ++counters_.reserve_calls;
  driver_us_ += options_.cost.reserve_us;
  return base;
}

void SimDriver::free_address_range(DevicePtr base, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const auto it = reservations_.find(base);
  if (it == reservations_.end()) {
    fail("free_address_range of " + range_str(base, bytes) + ": no reservation starts at " +
         hex(base));
  }
  if (it->second != bytes) {
    fail("free_address_range of " + range_str(base, bytes) + ": the reservation at " + hex(base) +
         " has " + bytes_str(it->second));
  }
  const auto m = mappings_.lower_bound(base);
  if (m != mappings_.end() && m->first < base + bytes) {
    fail("free_address_range of " + range_str(base, bytes) + ": " +
         range_str(m->first, m->second.bytes) + " is still mapped inside it");
  }
  reservations_.erase(it);
  ++counters_.address_frees;
  driver_us_ += options_.cost.address_free_us;
}

PhysicalHandle SimDriver::create_physical(std::size_t bytes) {
  const std::size_t g = options_.vm_granularity;
  std::lock_guard lock(mutex_);
  if (bytes == 0 || bytes % g != 0) {
    fail("create_physical of " + bytes_str(bytes) +
         ": the size must be a positive multiple of the granularity (" + bytes_str(g) + ")");
  }
  ++counters_.physical_creates;
  // A failed cuMemCreate is still a driver round trip.
  driver_us_ += options_.cost.physical_create_us;
  if (bytes > options_.capacity - device_used()) {
    ++counters_.physical_create_ooms;
    return 0;
  }
  const PhysicalHandle handle = next_handle_++;
  physical_.emplace(handle, Physical{bytes, 0});
  physical_bytes_ += bytes;
  return handle;
}

void SimDriver::release_physical(PhysicalHandle handle, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const auto it = physical_.find(handle);
  const std::string what =
      "release_physical of handle " + std::to_string(handle) + " (" + bytes_str(bytes) + ")";
  if (it == physical_.end()) {
    fail(what + ": no such physical allocation (never created, or already released)");
  }
  if (it->second.bytes != bytes) {
    fail(what + ": it was created with " + bytes_str(it->second.bytes));
  }
  // CUDA would defer the release until the mapping goes; the engine always unmaps first,
  // so a release of a mapped handle is treated as the bug it would be there.
  if (it->second.mapped_at != 0) {
    fail(what + ": it is still mapped at " + hex(it->second.mapped_at) + "; unmap it first");
  }
  if (it->second.range_mappings != 0) {
    fail(what + ": " + std::to_string(it->second.range_mappings) +
         " ranges of it are still mapped; unmap them first");
  }
  physical_bytes_ -= bytes;
  physical_.erase(it);
  ++counters_.physical_releases;
  driver_us_ += options_.cost.physical_release_us;
}

void SimDriver::map(DevicePtr va, std::size_t bytes, PhysicalHandle handle) {
  const std::size_t g = options_.vm_granularity;
  std::lock_guard lock(mutex_);
  const std::string what =
      "map of handle " + std::to_string(handle) + " at " + range_str(va, bytes);
  if (bytes == 0 || bytes % g != 0 || va % g != 0) {
    fail(what + ": the address and size must be multiples of the granularity (" + bytes_str(g) +
         ")");
  }
  if (bytes > kMaxPtr - va) fail(what + ": the range passes the end of the address space");
  const auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin() || std::prev(r)->first + std::prev(r)->second < va + bytes) {
    fail(what + ": the range is not inside one reserved address range");
  }
  auto m = mappings_.lower_bound(va);
  if (m != mappings_.begin() && std::prev(m)->first + std::prev(m)->second.bytes > va) --m;
  if (m != mappings_.end() && m->first < va + bytes) {
    fail(what + ": it overlaps the mapping " + range_str(m->first, m->second.bytes) +
         " of handle " + std::to_string(m->second.handle));
  }
  const auto p = physical_.find(handle);
  if (p == physical_.end()) {
    fail(what + ": no such physical allocation (never created, or already released)");
  }
  if (p->second.mapped_at != 0) {
    fail(what + ": the handle is already mapped at " + hex(p->second.mapped_at));
  }
  if (p->second.range_mappings != 0) fail(what + ": ranges of the handle are already mapped");
  if (p->second.bytes != bytes) {
    fail(what + ": the handle has " + bytes_str(p->second.bytes) +
         ", and a mapping covers a whole physical allocation");
  }
  p->second.mapped_at = va;
  mappings_.emplace(va, Mapping{bytes, handle});
  ++counters_.maps;
  driver_us_ += options_.cost.map_us + options_.cost.set_access_us;
}

void SimDriver::unmap(DevicePtr va, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const std::string what = "unmap of " + range_str(va, bytes);
  if (bytes == 0) fail(what + ": the size must be positive");
  if (bytes > kMaxPtr - va) fail(what + ": the range passes the end of the address space");
  // Validate the whole range before changing anything: it must be one or more contiguous
  // mappings, each covered entirely.
  const DevicePtr end = va + bytes;
  auto it = mappings_.find(va);
  if (it == mappings_.end()) {
    const auto next = mappings_.upper_bound(va);
    if (next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second.bytes > va) {
      const auto& [start, m] = *std::prev(next);
      fail(what + ": it starts inside the mapping " + range_str(start, m.bytes) +
           "; unmap whole mappings");
    }
    fail(what + ": nothing is mapped at " + hex(va));
  }
  const auto first = it;
  DevicePtr cursor = va;
  while (cursor < end) {
    if (it == mappings_.end() || it->first != cursor) {
      fail(what + ": " + hex(cursor) + " is not mapped");
    }
    if (it->first + it->second.bytes > end) {
      fail(what + ": it ends inside the mapping " + range_str(it->first, it->second.bytes) +
           "; unmap whole mappings");
    }
    cursor += it->second.bytes;
    ++it;
  }
  for (auto m = first; m != it; ++m) {
    Physical& p = physical_.at(m->second.handle);
    if (m->second.ranged) {
      --p.range_mappings;
    } else {
      p.mapped_at = 0;
    }
  }
  mappings_.erase(first, it);
  ++counters_.unmaps;
  driver_us_ += options_.cost.unmap_us;
}

void SimDriver::map_range(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                          std::size_t offset) {
  const std::size_t g = options_.vm_granularity;
  std::lock_guard lock(mutex_);
  const std::string what = "map_range of handle " + std::to_string(handle) + " (offset " +
                           bytes_str(offset) + ") at " + range_str(va, bytes);
  if (bytes == 0 || bytes % g != 0 || va % g != 0 || offset % g != 0) {
    fail(what + ": the address, size and offset must be multiples of the granularity (" +
         bytes_str(g) + ")");
  }
  if (bytes > kMaxPtr - va) fail(what + ": the range passes the end of the address space");
  const auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin() || std::prev(r)->first + std::prev(r)->second < va + bytes) {
    fail(what + ": the range is not inside one reserved address range");
  }
  auto m = mappings_.lower_bound(va);
  if (m != mappings_.begin() && std::prev(m)->first + std::prev(m)->second.bytes > va) --m;
  if (m != mappings_.end() && m->first < va + bytes) {
    fail(what + ": it overlaps the mapping " + range_str(m->first, m->second.bytes) +
         " of handle " + std::to_string(m->second.handle));
  }
  const auto p = physical_.find(handle);
  if (p == physical_.end()) {
    fail(what + ": no such physical allocation (never created, or already released)");
  }
  if (p->second.mapped_at != 0) {
    fail(what + ": the handle is mapped whole at " + hex(p->second.mapped_at));
  }
  if (offset > p->second.bytes || bytes > p->second.bytes - offset) {
    fail(what + ": the handle has only " + bytes_str(p->second.bytes));
  }
  ++p->second.range_mappings;
  mappings_.emplace(va, Mapping{bytes, handle, offset, true});
  ++counters_.maps;
  driver_us_ += options_.cost.map_us + options_.cost.set_access_us;
}

std::vector<SimDriver::MappingInfo> SimDriver::mappings_in(DevicePtr base,
                                                           std::size_t bytes) const {
  std::lock_guard lock(mutex_);
  std::vector<MappingInfo> out;
  for (auto m = mappings_.lower_bound(base); m != mappings_.end() && m->first < base + bytes; ++m) {
    out.push_back(MappingInfo{m->first, m->second.bytes, m->second.handle, m->second.offset});
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// The stream-ordered pool

// A pool free is a position in its stream's queue, like an event recorded at the free.
SimDriver::FreeMark SimDriver::mark_free(StreamId stream) {
  StreamState& s = streams_[stream];
  const FreeMark m{stream, ++s.recorded};
  if (options_.events_complete_immediately) s.completed = s.recorded;
  return m;
}

bool SimDriver::mark_done(const FreeMark& m) const {
  return m.sequence <= streams_.at(m.stream).completed;
}

// The rules of reuse: the freeing stream itself (stream order); a stream that waited on an
// event recorded on the freeing stream after the free (ReuseFollowEventDependencies); any
// stream once the free has completed (ReuseAllowOpportunistic).
bool SimDriver::usable_by(FreeMarks& marks, StreamId stream) const {
  std::erase_if(marks, [this](const FreeMark& m) { return mark_done(m); });
  const auto self = streams_.find(stream);
  for (const FreeMark& m : marks) {
    if (m.stream == stream) continue;
    if (self != streams_.end()) {
      const auto w = self->second.waited.find(m.stream);
      if (w != self->second.waited.end() && w->second >= m.sequence) continue;
    }
    return false;
  }
  return true;
}

// Memory made of two free pieces waits for the frees of both (per stream, the later one).
void SimDriver::merge_marks(FreeMarks& into, const FreeMarks& from) const {
  for (const FreeMark& m : from) {
    const auto same = std::find_if(into.begin(), into.end(),
                                   [&m](const FreeMark& x) { return x.stream == m.stream; });
    if (same == into.end()) {
      into.push_back(m);
    } else {
      same->sequence = std::max(same->sequence, m.sequence);
    }
  }
  std::erase_if(into, [this](const FreeMark& m) { return mark_done(m); });
}

bool SimDriver::grow_pool(std::size_t pages) {
  const std::size_t g = options_.vm_granularity;
  if (pages > (options_.capacity - device_used()) / g) return false;
  pool_pages_ += pages;
  pool_reserved_high_ = std::max(pool_reserved_high_, pool_pages_ * g);
  ++counters_.pool_grows;
  counters_.pool_pages_grown += pages;
  driver_us_ += options_.cost.pool_grow_us;
  return true;
}

void SimDriver::add_free_pages(std::size_t pages, FreeMarks marks) {
  std::erase_if(marks, [this](const FreeMark& m) { return mark_done(m); });
  if (marks.empty() && !free_pages_.empty()) {
    PageRun& last = free_pages_.back();
    std::erase_if(last.marks, [this](const FreeMark& m) { return mark_done(m); });
    if (last.marks.empty()) {
      last.pages += pages;
      return;
    }
  }
  free_pages_.push_back(PageRun{pages, std::move(marks)});
}

// The lowest granularity-aligned range of the pool's address space that `stream` may use:
// it overlaps no live pool range, no freed one whose free `stream` may not yet follow, and
// nothing else on the device.
DevicePtr SimDriver::place_in_pool(std::size_t bytes, StreamId stream) {
  const std::size_t g = options_.vm_granularity;
  const int device = options_.device;
  DevicePtr addr = align_up(options_.pool_base_address, g, device);
  const auto first_overlapping = [this](DevicePtr a) {
    auto it = pool_slots_.lower_bound(a);
    if (it != pool_slots_.begin() && std::prev(it)->first + std::prev(it)->second.bytes > a) {
      --it;
    }
    return it;
  };
  DevicePtr end = 0;
  for (;;) {
    end = range_end(addr, bytes, device);
    DevicePtr next = std::max(overlap_end(live_, addr, end, plain_size),
                              overlap_end(reservations_, addr, end, plain_size));
    for (auto it = first_overlapping(addr); it != pool_slots_.end() && it->first < end;) {
      PoolSlot& slot = it->second;
      if (!slot.live && usable_by(slot.marks, stream)) {
        // Free address space for this stream; with no frees left to wait for, for all.
        it = slot.marks.empty() ? pool_slots_.erase(it) : std::next(it);
        continue;
      }
      next = std::max(next, it->first + slot.bytes);
      ++it;
    }
    if (next == 0) break;
    addr = align_up(next, g, device);
  }
  // Freed ranges still inside [addr, end) are usable by `stream`: claim them, keeping the
  // parts outside with their frees.
  for (auto it = first_overlapping(addr); it != pool_slots_.end() && it->first < end;) {
    const DevicePtr start = it->first;
    const DevicePtr stop = start + it->second.bytes;
    FreeMarks marks = std::move(it->second.marks);
    it = pool_slots_.erase(it);
    if (start < addr) pool_slots_.emplace(start, PoolSlot{addr - start, false, marks});
    if (stop > end) it = pool_slots_.emplace(end, PoolSlot{stop - end, false, marks}).first;
  }
  pool_slots_.emplace(addr, PoolSlot{bytes, true, {}});
  return addr;
}

void SimDriver::release_pool_slot(DevicePtr va, FreeMarks marks) {
  const auto it = pool_slots_.find(va);
  std::erase_if(marks, [this](const FreeMark& m) { return mark_done(m); });
  if (marks.empty()) {
    pool_slots_.erase(it);
  } else {
    it->second.live = false;
    it->second.marks = std::move(marks);
  }
}

// Whole pages from any free pages `stream` may use (oldest first), plus new pages for what
// they lack.
DevicePtr SimDriver::allocate_large(std::size_t rounded, StreamId stream) {
  const std::size_t g = options_.vm_granularity;
  const std::size_t pages = (rounded + g - 1) / g;
  std::size_t usable = 0;
  for (PageRun& run : free_pages_) {
    if (usable_by(run.marks, stream)) usable += run.pages;
  }
  const std::size_t missing = pages > usable ? pages - usable : 0;
  if (missing > 0 && !grow_pool(missing)) return 0;
  std::size_t need = pages - missing;
  for (auto it = free_pages_.begin(); need > 0 && it != free_pages_.end();) {
    if (!usable_by(it->marks, stream)) {
      ++it;
      continue;
    }
    const std::size_t take = std::min(need, it->pages);
    it->pages -= take;
    need -= take;
    it = it->pages == 0 ? free_pages_.erase(it) : std::next(it);
  }
  return place_in_pool(pages * g, stream);
}

// Best fit (smallest, then lowest address) among the free small blocks `stream` may use;
// else a block carved from a fresh small page: the oldest free page `stream` may use, or a
// new one.
DevicePtr SimDriver::allocate_small(std::size_t rounded, StreamId stream) {
  const std::size_t g = options_.vm_granularity;
  DevicePtr addr = 0;
  for (auto it = small_free_.lower_bound({rounded, 0}); it != small_free_.end(); ++it) {
    const DevicePtr a = it->second;
    SmallBlock& b = std::prev(small_pages_.upper_bound(a))->second.at(a);
    if (usable_by(b.marks, stream)) {
      addr = a;
      break;
    }
  }
  if (addr == 0) {
    FreeMarks marks;
    bool found = false;
    for (auto it = free_pages_.begin(); it != free_pages_.end(); ++it) {
      if (!usable_by(it->marks, stream)) continue;
      marks = it->marks;
      if (--it->pages == 0) free_pages_.erase(it);
      found = true;
      break;
    }
    if (!found && !grow_pool(1)) return 0;
    addr = place_in_pool(g, stream);
    small_pages_[addr].emplace(addr, SmallBlock{g, false, std::move(marks)});
    add_small_free(addr, g);
  }
  auto& blocks = std::prev(small_pages_.upper_bound(addr))->second;
  SmallBlock& b = blocks.at(addr);
  small_free_.erase({b.size, addr});
  if (b.size > rounded) {
    blocks.emplace(addr + rounded, SmallBlock{b.size - rounded, false, b.marks});
    add_small_free(addr + rounded, b.size - rounded);
  }
  b.size = rounded;
  b.allocated = true;
  b.marks.clear();
  return addr;
}

// Frees a small block and merges it with free neighbours; a page left wholly free returns
// to the pool's free pages, usable by large requests too.
void SimDriver::free_small(DevicePtr ptr, const FreeMark& mark) {
  const auto page = std::prev(small_pages_.upper_bound(ptr));
  auto& blocks = page->second;
  auto it = blocks.find(ptr);
  it->second.allocated = false;
  it->second.marks = {mark};
  const auto next = std::next(it);
  if (next != blocks.end() && !next->second.allocated) {
    small_free_.erase({next->second.size, next->first});
    it->second.size += next->second.size;
    merge_marks(it->second.marks, next->second.marks);
    blocks.erase(next);
  }
  if (it != blocks.begin()) {
    const auto prev = std::prev(it);
    if (!prev->second.allocated) {
      small_free_.erase({prev->second.size, prev->first});
      prev->second.size += it->second.size;
      merge_marks(prev->second.marks, it->second.marks);
      blocks.erase(it);
      it = prev;
    }
  }
  if (it->second.size == options_.vm_granularity) {
    const DevicePtr va = page->first;
    FreeMarks marks = std::move(it->second.marks);
    small_pages_.erase(page);
    add_free_pages(1, marks);
    release_pool_slot(va, std::move(marks));
  } else {
    add_small_free(it->first, it->second.size);
  }
}

DevicePtr SimDriver::allocate_async(std::size_t bytes, StreamId stream) {
  if (bytes == 0) {
    throw DriverError("ccalloc: allocate_async of 0 bytes on " + device_label(options_.device) +
                      ": the driver needs a positive size");
  }
  std::lock_guard lock(mutex_);
  ++counters_.async_allocates;
  driver_us_ += options_.cost.async_allocate_us;
  DevicePtr ptr = 0;
  std::size_t rounded = 0;
  if (bytes <= options_.capacity) {  // also keeps the rounding below from overflowing
    rounded = (bytes + kPoolRounding - 1) / kPoolRounding * kPoolRounding;
    ptr = rounded < kPoolSmallLimit ? allocate_small(rounded, stream)
                                    : allocate_large(rounded, stream);
  }
  if (ptr == 0) {
    ++counters_.async_allocate_ooms;
    return 0;
  }
  pool_live_.emplace(ptr, PoolAllocation{bytes, rounded, rounded < kPoolSmallLimit});
  pool_used_ += bytes;  // the real pool counts requested bytes too
  pool_used_high_ = std::max(pool_used_high_, pool_used_);
  return ptr;
}

void SimDriver::free_async(DevicePtr ptr, std::size_t bytes, StreamId stream) {
  std::lock_guard lock(mutex_);
  const auto it = pool_live_.find(ptr);
  const std::string what = "free_async of pointer " + hex(ptr) + " (" + bytes_str(bytes) +
                           ") on stream " + std::to_string(stream);
  if (it == pool_live_.end()) {
    fail(what + ": it is not a live stream-ordered allocation");
  }
  if (it->second.bytes != bytes) {
    fail(what + ": it was allocated with " + bytes_str(it->second.bytes));
  }
  const PoolAllocation a = it->second;
  pool_live_.erase(it);
  pool_used_ -= a.bytes;
  const FreeMark mark = mark_free(stream);
  if (a.small) {
    free_small(ptr, mark);
  } else {
    const std::size_t pages = pool_slots_.at(ptr).bytes / options_.vm_granularity;
    release_pool_slot(ptr, {mark});
    add_free_pages(pages, {mark});
  }
  ++counters_.async_frees;
  driver_us_ += options_.cost.async_free_us;
}

void SimDriver::stream_wait_event(StreamId stream, EventId event) {
  std::lock_guard lock(mutex_);
  const Event& e = event_ref(event);
  // Waiting on an event never recorded is a no-op, as in CUDA.
  if (e.recorded && e.stream != stream) {
    std::uint64_t& waited = streams_[stream].waited[e.stream];
    waited = std::max(waited, e.sequence);
  }
  ++counters_.stream_waits;
  driver_us_ += options_.cost.stream_wait_us;
}

// Releases free pages whose frees have completed while the pool keeps at least
// `keep_bytes` reserved (cudaMemPoolTrimTo never goes below its argument).
void SimDriver::pool_trim(std::size_t keep_bytes) {
  const std::size_t g = options_.vm_granularity;
  std::lock_guard lock(mutex_);
  ++counters_.pool_trims;
  const std::size_t before = pool_pages_;
  for (auto it = free_pages_.begin(); it != free_pages_.end();) {
    const std::size_t reserved = pool_pages_ * g;
    const std::size_t releasable = reserved > keep_bytes ? (reserved - keep_bytes) / g : 0;
    if (releasable == 0) break;
    std::erase_if(it->marks, [this](const FreeMark& m) { return mark_done(m); });
    if (!it->marks.empty()) {
      ++it;
      continue;
    }
    const std::size_t n = std::min(releasable, it->pages);
    it->pages -= n;
    pool_pages_ -= n;
    counters_.pool_pages_trimmed += n;
    it = it->pages == 0 ? free_pages_.erase(it) : std::next(it);
  }
  if (pool_pages_ != before) driver_us_ += options_.cost.pool_trim_us;
}

PoolUsage SimDriver::pool_usage() {
  std::lock_guard lock(mutex_);
  ++counters_.pool_usage_queries;
  return PoolUsage{pool_pages_ * options_.vm_granularity, pool_reserved_high_, pool_used_,
                   pool_used_high_};
}

void SimDriver::pool_reset_peaks() {
  std::lock_guard lock(mutex_);
  ++counters_.pool_peak_resets;
  pool_reserved_high_ = pool_pages_ * options_.vm_granularity;
  pool_used_high_ = pool_used_;
}

void SimDriver::synchronize_device() {
  std::lock_guard lock(mutex_);
  for (auto& [id, s] : streams_)
    s.completed = s.recorded;
  // Every free has completed: freed pool ranges are plain address space again.
  std::erase_if(pool_slots_, [](const auto& entry) { return !entry.second.live; });
  ++counters_.device_synchronizes;
  driver_us_ += options_.cost.synchronize_us;
}

}  // namespace ccalloc::sim

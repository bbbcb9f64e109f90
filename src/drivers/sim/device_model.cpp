// The simulated GPU's device model: its address space (first-fit placement and the
// address oracle), device allocations (cudaMalloc / cudaFree), streams and events, and the
// driver calls' counters and cost for them.
//
// Invariants, all under mutex_:
//   used_ == sum of the sizes in live_;
//   the ranges of live_, reservations_, pool_slots_ and opened_ are pairwise disjoint and never
//   contain 0 (every placement, here and in the other models, goes through first_fit or
//   avoids all three maps);
//   for every stream, completed <= recorded, and an event (or pool free) recorded on it at
//   sequence q is complete exactly when q <= completed (work on a stream finishes in order).
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "drivers/sim/sim_common.hpp"

namespace ccalloc::sim {
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
                  overlap_end(pool_slots_, addr, end, [](const PoolSlot& s) { return s.bytes; }),
                  overlap_end(opened_, addr, end, [](const Opened& o) { return o.bytes; })});
    if (next == 0) return addr;
    addr = align_up(next, alignment, device);
  }
}

bool SimDriver::overlaps_any(DevicePtr addr, DevicePtr end) const {
  return overlap_end(live_, addr, end, plain_size) != 0 ||
         overlap_end(reservations_, addr, end, plain_size) != 0 ||
         overlap_end(pool_slots_, addr, end, [](const PoolSlot& s) { return s.bytes; }) != 0 ||
         overlap_end(opened_, addr, end, [](const Opened& o) { return o.bytes; }) != 0;
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
  forbid_during_capture("free of device memory");
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
  forget_allocation(ptr);
  ++counters_.free_calls;
  driver_us_ += options_.cost.free_us;
}

MemInfo SimDriver::mem_info() {
  std::lock_guard lock(mutex_);
  ++counters_.mem_info_calls;
  return MemInfo{options_.capacity - device_used(), options_.capacity};
}

std::vector<Driver::ProcessMemory> SimDriver::processes_on_device() {
  std::lock_guard lock(mutex_);
  return {ProcessMemory{static_cast<long>(::getpid()), device_used()}};
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
  forbid_during_capture("record_event");
  Event& e = event_ref(event);
  StreamState& s = streams_[stream];
  // Re-recording moves the event to the stream's tail, as cudaEventRecord does: it then
  // waits for the new work only.
  e.recorded = true;
  e.stream = stream;
  e.sequence = ++s.recorded;
  if (options_.events_complete_immediately) s.completed = s.recorded;
  if (options_.gpu_lag_us >= 0 && stream < options_.lagged_streams_end) {
    s.lagging.emplace_back(clock_us(), e.sequence);
  }
  ++counters_.event_records;
  driver_us_ += options_.cost.event_record_us;
}

bool SimDriver::query_event(EventId event) {
  std::lock_guard lock(mutex_);
  forbid_during_capture("query_event");
  const Event& e = event_ref(event);
  ++counters_.event_queries;
  driver_us_ += options_.cost.event_query_us;
  if (e.recorded) catch_up(e.stream);
  return event_done(e);
}

void SimDriver::catch_up(StreamId id) {
  const std::int64_t now = clock_us();
  StreamState& stream = streams_.at(id);
  std::uint64_t through = 0;
  while (!stream.lagging.empty() && stream.lagging.front().first + options_.gpu_lag_us <= now) {
    through = std::max(through, stream.lagging.front().second);
    stream.lagging.pop_front();
  }
  if (through != 0) advance(id, through);
}

void SimDriver::advance(StreamId id, std::uint64_t through) {
  StreamState& s = streams_.at(id);
  if (through <= s.completed) return;
  s.completed = through;
  // Advancing another stream neither adds streams (a wait's stream has recorded the position
  // waited for) nor changes waits, and a way back here returns at once: `s` stays as it is.
  for (const StreamState::Wait& w : s.waits) {
    if (w.at < through) advance(w.stream, w.through);
  }
}

void SimDriver::complete_through(const Event& e) {
  if (e.recorded) advance(e.stream, e.sequence);
}

bool SimDriver::ordered_after(StreamId waiter, StreamId stream, std::uint64_t sequence) const {
  // Depth first over (stream, horizon): the waits of `at` < horizon count. A stream seen
  // with a horizon at least as far needs no second visit.
  std::unordered_map<StreamId, std::uint64_t> seen;
  std::vector<std::pair<StreamId, std::uint64_t>> todo{
      {waiter, std::numeric_limits<std::uint64_t>::max()}};
  while (!todo.empty()) {
    const auto [id, horizon] = todo.back();
    todo.pop_back();
    const auto it = streams_.find(id);
    if (it == streams_.end()) continue;
    for (const StreamState::Wait& w : it->second.waits) {
      if (w.at >= horizon) continue;
      if (w.stream == stream && w.through >= sequence) return true;
      const auto [at, fresh] = seen.try_emplace(w.stream, w.through);
      if (!fresh) {
        if (at->second >= w.through) continue;
        at->second = w.through;
      }
      // Waits queued on that stream before the position waited for.
      todo.emplace_back(w.stream, w.through);
    }
  }
  return false;
}

void SimDriver::begin_capture(StreamId stream) {
  std::lock_guard lock(mutex_);
  if (capturing_.contains(stream)) {
    throw DriverError("simulated GPU: stream " + std::to_string(stream) + " is already capturing");
  }
  const std::uint64_t id = next_capture_id_++;
  capturing_.emplace(stream, CaptureMember{id, {}});
  capture_origins_.emplace(id, stream);
}

std::map<StreamId, SimDriver::CaptureMember>::iterator SimDriver::capture_member(
    StreamId stream, const std::string& call) {
  const auto it = capturing_.find(stream);
  if (it == capturing_.end()) {
    throw DriverError("simulated GPU: " + call + " stream " + std::to_string(stream) +
                      ", which is not capturing");
  }
  return it;
}

void SimDriver::end_capture(StreamId stream) {
  std::lock_guard lock(mutex_);
  const auto it = capture_member(stream, "end_capture of");
  const std::uint64_t id = it->second.id;
  if (capture_origins_.at(id) != stream) {
    capturing_.erase(it);  // a stream that joined leaves; the capture goes on
    return;
  }
  std::erase_if(capturing_, [id](const auto& m) { return m.second.id == id; });
  std::erase_if(graph_nodes_, [id](const auto& n) { return n.second.capture == id; });
  capture_origins_.erase(id);
}

GraphNode SimDriver::capture_work(StreamId stream) {
  std::lock_guard lock(mutex_);
  const auto it = capture_member(stream, "capture_work on");
  const GraphNode node = next_graph_node_++;
  graph_nodes_.emplace(node, GraphNodeInfo{it->second.id, it->second.terminals});
  it->second.terminals.assign(1, node);
  return node;
}

void SimDriver::capture_join(StreamId waiter, StreamId waited) {
  std::lock_guard lock(mutex_);
  // Copied: the waiter's entry changes below.
  const CaptureMember source =
      capture_member(waited, "capture_join of stream " + std::to_string(waiter) + " to")->second;
  const auto to = capturing_.try_emplace(waiter, CaptureMember{source.id, {}}).first;
  if (to->second.id != source.id) {
    throw DriverError("simulated GPU: capture_join of stream " + std::to_string(waiter) +
                      " (capture " + std::to_string(to->second.id) + ") to stream " +
                      std::to_string(waited) + " (capture " + std::to_string(source.id) +
                      "): streams of two captures cannot wait on each other");
  }
  std::vector<GraphNode>& t = to->second.terminals;
  for (GraphNode n : source.terminals) {
    if (std::find(t.begin(), t.end(), n) == t.end()) t.push_back(n);
  }
}

bool SimDriver::is_capturing(StreamId stream) {
  std::lock_guard lock(mutex_);
  return capturing_.contains(stream);
}

bool SimDriver::capture_info(StreamId stream, CaptureInfo& out) {
  std::lock_guard lock(mutex_);
  if (stream == 0 && !capturing_.empty() && !capturing_.contains(0)) {
    // CUDA refuses to query the legacy stream while a (blocking) stream captures: the query
    // would make it depend on the capture (cudaErrorStreamCaptureImplicit).
    throw DriverError("simulated GPU: capture_info of the legacy default stream (0) while stream " +
                      std::to_string(capturing_.begin()->first) +
                      " captures (cudaErrorStreamCaptureImplicit)");
  }
  const auto it = capturing_.find(stream);
  out.capturing = it != capturing_.end();
  out.id = out.capturing ? it->second.id : 0;
  if (out.capturing) {
    out.terminals = it->second.terminals;
  } else {
    out.terminals.clear();
  }
  return out.capturing;
}

void SimDriver::node_dependencies(GraphNode node, std::vector<GraphNode>& out) {
  std::lock_guard lock(mutex_);
  const auto it = graph_nodes_.find(node);
  if (it == graph_nodes_.end()) {
    throw DriverError("simulated GPU: node_dependencies of graph node " + std::to_string(node) +
                      ", which is no node of a capture underway");
  }
  out = it->second.dependencies;
}

void SimDriver::forbid_during_capture(const char* what) const {
  if (capturing_.empty()) return;
  throw DriverError(std::string("simulated GPU: ") + what + " while stream " +
                    std::to_string(capturing_.begin()->first) +
                    " is being captured into a CUDA graph (illegal during capture)");
}

void SimDriver::complete_event(EventId event) {
  std::lock_guard lock(mutex_);
  complete_through(event_ref(event));
}

void SimDriver::complete_stream(StreamId stream) {
  std::lock_guard lock(mutex_);
  const auto it = streams_.find(stream);
  if (it != streams_.end()) advance(stream, it->second.recorded);
}

bool SimDriver::waited_for(StreamId waiter, EventId event) {
  std::lock_guard lock(mutex_);
  const Event& e = event_ref(event);
  if (!e.recorded || e.stream == waiter) return true;
  return ordered_after(waiter, e.stream, e.sequence);
}

void SimDriver::complete_all() {
  std::lock_guard lock(mutex_);
  for (auto& [id, s] : streams_)
    s.completed = s.recorded;
}

void SimDriver::synchronize_event(EventId event) {
  std::lock_guard lock(mutex_);
  forbid_during_capture("synchronize_event");
  complete_through(event_ref(event));
  ++counters_.event_synchronizes;
  driver_us_ += options_.cost.synchronize_us;
}

void SimDriver::synchronize_stream(StreamId stream) {
  std::lock_guard lock(mutex_);
  forbid_during_capture("synchronize_stream");
  const auto it = streams_.find(stream);
  if (it != streams_.end()) advance(stream, it->second.recorded);
  ++counters_.stream_synchronizes;
  driver_us_ += options_.cost.synchronize_us;
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

void SimDriver::stream_wait_event(StreamId stream, EventId event) {
  std::lock_guard lock(mutex_);
  const Event& e = event_ref(event);
  // Waiting on an event never recorded is a no-op, as in CUDA.
  if (e.recorded && e.stream != stream) {
    StreamState& s = streams_[stream];
    // A wait whose work has completed orders nothing that completion does not: everything
    // it reaches completed with it (advance).
    std::erase_if(s.waits, [this](const StreamState::Wait& w) {
      return streams_.at(w.stream).completed >= w.through;
    });
    s.waits.push_back(StreamState::Wait{s.recorded, e.stream, e.sequence});
  }
  ++counters_.stream_waits;
  driver_us_ += options_.cost.stream_wait_us;
}

}  // namespace ccalloc::sim

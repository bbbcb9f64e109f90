// The simulated GPU's stream-ordered pool model (cudaMallocAsync / cudaFreeAsync,
// cudaMemPoolTrimTo, the pool's usage attributes): requests rounded to kPoolRounding; large
// ones take whole pages from any free pages, small ones are carved best-fit from shared
// pages; freed memory is reused under the stream-order rules of usable_by().
//
// Invariants, all under mutex_:
//   pool_pages_ == pages in free_pages_ + pages of small_pages_ + pages of live large
//   allocations; pool_used_ == sum of the requested sizes in pool_live_; the blocks of a
//   small page tile it, no two free blocks are adjacent, and small_free_ holds exactly the
//   free ones;
//   a pool free is a position in its stream's queue (FreeMark), complete under the same
//   rule as an event; freed memory carries the marks of the frees it still waits for.
#include <algorithm>
#include <iterator>
#include <string>
#include <utility>

#include "drivers/sim/sim_common.hpp"

namespace ccalloc::sim {

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
  for (const FreeMark& m : marks) {
    if (m.stream == stream || ordered_after(stream, m.stream, m.sequence)) continue;
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
  const std::string what = "free_async of pointer " + hex_address(ptr) + " (" + bytes_str(bytes) +
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

// Releases free pages whose frees have completed while the pool keeps at least
// `keep_bytes` reserved (cudaMemPoolTrimTo never goes below its argument).
void SimDriver::pool_trim(std::size_t keep_bytes) {
  const std::size_t g = options_.vm_granularity;
  std::lock_guard lock(mutex_);
  forbid_during_capture("pool_trim");
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

}  // namespace ccalloc::sim

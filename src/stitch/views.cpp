// What the policy reports: statistics and their peaks, settings, observers, history,
// the OOM message, segments and snapshots (docs/ccalloc-policy.md, "What snapshots and
// tools show").
#include <algorithm>
#include <cstdio>
#include <string>

#include "core/arena_engine.hpp"
#include "core/common.hpp"
#include "core/format.hpp"
#include "core/rounding.hpp"
#include "stitch/engine.hpp"

namespace ccalloc::core {

// ---------------------------------------------------------------------------------------
// Stats, settings, observers, history

// The block statistics' currents are sums over the arenas, their peaks the sums of the
// arenas' baselines (core/peak_ledger.hpp), settled first so no peak is below its current.
DeviceStats StitchEngine::stats_locked(const AllArenasLock& all) const {
  settle_peak_debts(all);
  DeviceStats total = stats_;
  PeakBaselines peaks;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    add_block_stats(total, peaks, arena->stats, arena->debts);
  }
  set_tracked_peaks(total, peaks);
  return total;
}

DeviceStats StitchEngine::stats() const {
  const AllArenasLock all(*this);
  Lock device(device_mutex_);
  return stats_locked(all);
}

void StitchEngine::reset_peak_stats() {
  const AllArenasLock all(*this);
  ArenaEngine::reset_peaks(all, all.arenas());
  Lock device(device_mutex_);
  stats_.reset_peak();
}

void StitchEngine::reset_accumulated_stats() {
  const AllArenasLock all(*this);
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    arena->stats.reset_accumulated();
  }
  Lock device(device_mutex_);
  stats_.reset_accumulated();
}

void StitchEngine::set_memory_fraction(double fraction) {
  const std::optional<std::size_t> limit = fraction_limit(fraction, capacity_, device());
  Lock device(device_mutex_);
  fraction_ = fraction;
  limit_ = limit;
}

bool StitchEngine::reconfigure(const Config& next) {
  ArenaEngine::begin_reconfigure(*this, next);  // the fixed keys, then the fraction
  {
    // malloc rounds under its arena's lock and grow() reads the rest under device_mutex_.
    const AllArenasLock all(*this);
    Lock device(device_mutex_);
    config_ = next;
    chunk_pieces_ = std::max<std::size_t>(1, config_.large_segment_size / page_);
  }
  after_operation();
  return true;
}

double StitchEngine::memory_fraction() const {
  Lock device(device_mutex_);
  return fraction_;
}

std::size_t StitchEngine::allocation_size(DevicePtr ptr) const {
  return ArenaEngine::allocation_size(*this, ptr);
}

StitchEngine::PieceCounts StitchEngine::piece_counts() const {
  const AllArenasLock all(*this);
  Lock device(device_mutex_);
  PieceCounts c;
  for (const auto& [id, h] : handles_)
    c.total += h->live_at.size();
  c.spare = spare_.size();
  c.fences = fences_recorded_.load(std::memory_order_relaxed);
  c.borrow_waits = borrow_waits_.load(std::memory_order_relaxed);
  c.busy_borrow_waits = busy_borrow_waits_.load(std::memory_order_relaxed);
  c.clock_gate_open = fence_gate_.ticks() != 0;
  c.clock_gate_shut = fence_gate_.shut();
  c.fence_latency_us = fence_latency_us_.load(std::memory_order_relaxed);
  c.fence_latency_samples = fence_latency_samples_.load(std::memory_order_relaxed);
  c.borrowed_handles = borrowed_handles_;
  c.borrowed_pieces = borrowed_pieces_;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    for (const auto& spaces : arena->spaces) {
      for (const auto& s : spaces) {
        for (std::size_t p = 0; p < s->pages.size(); ++p) {
          const Page& page = s->pages[p];
          if (page.handle != nullptr && page.handle->live_at[page.piece] != page_va(*s, p)) {
            ++c.dead_pages;
          }
        }
      }
    }
  }
  return c;
}

void StitchEngine::add_oom_observer(Allocator::OomObserver observer) {
  ArenaEngine::add_oom_observer(*this, std::move(observer));
}

void StitchEngine::add_free_memory_callback(Allocator::FreeMemoryCallback callback) {
  // The OOM ladder reads the flag relaxed, then the callbacks under observers_mutex_.
  ArenaEngine::add_free_memory_callback(*this, std::move(callback), std::memory_order_relaxed);
}

void StitchEngine::add_trace_observer(TraceObserver observer) {
  Lock lock(trace_mutex_);
  trace_observers_.push_back(std::move(observer));
  tracing_.store(true, std::memory_order_relaxed);
}

void StitchEngine::record_trace_entry(TraceAction action, DevicePtr addr, std::size_t size,
                                      StreamId stream, const Origin& stack) {
  Lock lock(trace_mutex_);
  const TraceEntry entry = recorder_.record(action, addr, size, stream, driver_.now_us(), stack);
  for (const TraceObserver& observer : trace_observers_)
    observer(entry);
}

StitchEngine::OomReport StitchEngine::prepare_oom(const AllArenasLock& all, Arena& arena,
                                                  std::size_t requested, std::size_t rounded,
                                                  bool small, const Origin& stack) {
  const MemInfo info = driver_.mem_info();
  const std::vector<Driver::ProcessMemory> processes = driver_.processes_on_device();
  ++stats_.num_ooms;
  record_trace(TraceAction::kOom, info.free_bytes, rounded, arena.stream, stack);
  const Pool& pool = arena.pool(small);
  const std::size_t largest = pool.empty() ? 0 : (*pool.rbegin())->size;
  std::size_t allocated = 0;
  for (Arena* a : all.arenas()) {
    all.held(*a);
    allocated += static_cast<std::size_t>(pools_current(a->stats.allocated_bytes));
  }
  PytorchOomFigures p;
  p.requested = requested;
  p.device = device();
  p.capacity = info.total_bytes;
  p.device_free = info.free_bytes;
  p.processes = processes;
  p.limit = limit_;
  p.allocated = allocated;
  p.reserved = reserved_;
  std::string m = pytorch_oom_text(p) + " The request: " + std::to_string(requested) +
                  " bytes on stream " + std::to_string(arena.stream) + ", rounded to " +
                  format_size(rounded) + " (" + driver_.name() + "). ";
  if (limit_) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "per_process_memory_fraction %.4g allows ", fraction_);
    m += buf + format_size(*limit_) + ". ";
  }
  m += "The " + format_size(reserved_ - allocated) +
       " reserved but unallocated lies in pages shared with live blocks (free pages were "
       "already stitched or returned); the largest free block is " +
       format_size(largest) + " on this stream.";
  if (limit_ && info.free_bytes >= rounded) {
    m += " The per_process_memory_fraction limit refused it: raise the fraction "
         "(set_memory_fraction or per_process_memory_fraction) to let it succeed.";
  }
  return OomReport{std::move(m), requested, limit(), info.free_bytes};
}

void StitchEngine::raise_oom(const OomReport& report) {
  std::vector<Allocator::OomObserver> observers;
  {
    Lock lock(observers_mutex_);
    observers = oom_observers_;
  }
  for (const auto& observer : observers)
    observer(device(), report.requested, report.limit, report.free_bytes);
  after_operation();
  throw OutOfMemoryError(report.message, device(), report.requested);
}

void StitchEngine::record_history(const HistoryOptions& options) {
  Lock lock(trace_mutex_);
  recorder_.configure(options, /*blocks_keep_stacks=*/true);
  tracing_.store(recorder_.history_on || !trace_observers_.empty(), std::memory_order_relaxed);
}

void StitchEngine::annotate(std::string_view name, bool start) {
  Lock lock(trace_mutex_);
  recorder_.annotate(name, start, device(), driver_.now_us());
}

namespace {

BlockState state_of(bool allocated, bool pending) {
  if (allocated) return BlockState::kActiveAllocated;
  return pending ? BlockState::kActivePendingFree : BlockState::kInactive;
}

// A segment (SegmentInfo or SnapshotSegment) of a space's run of blocks starting at `first`.
template <class Segment, class Block>
void start_segment(Segment& seg, int device, const Block& first, StreamId stream, bool small) {
  seg.device = device;
  seg.address = first.ptr;
  seg.stream = stream;
  seg.is_small = small;
  seg.is_expandable = true;
}

// Adds a non-void block to its segment's totals; returns the block's state.
template <class Segment, class Block>
BlockState count_block(Segment& seg, const Block& b) {
  const bool allocated = b.kind == Block::Kind::kAllocated;
  const bool pending = b.kind == Block::Kind::kPending;
  seg.total_size += b.size;
  if (allocated) seg.allocated_size += b.size;
  if (allocated || pending) {
    seg.active_size += b.size;
    seg.requested_size += b.requested;
  }
  return state_of(allocated, pending);
}

// Appends the piece mapped at `page` of `space` to `runs`, extending the last run when the
// piece follows it in the same handle.
template <class Space>
void append_piece(std::vector<PieceRun>& runs, const Space& space, std::size_t page) {
  const auto& p = space.pages[page];
  if (!runs.empty() && runs.back().handle == p.handle->id &&
      runs.back().first + runs.back().count == p.piece) {
    ++runs.back().count;
    return;
  }
  runs.push_back(PieceRun{p.handle->id, p.piece, 1});
}

// The origin of the mapping that holds `ptr` of `space` (empty when none was recorded).
template <class Space>
const Origin& mapped_by(const Space& space, DevicePtr ptr, std::size_t page_size) {
  const auto it = space.mapping_at((ptr - space.base) / page_size);
  return it != space.mappings.end() ? it->second.stack : OperationContext::none();
}

SegmentInfo& segment_of(SegmentInfo& s) {
  return s;
}
template <class Stacks>
SnapshotSegment& segment_of(std::pair<SnapshotSegment, Stacks>& s) {
  return s.first;
}

// Sets the pieces of the segments [from, end) of `out`, all of space `space`: their pages
// are live, so each maps the piece that backs it.
template <class Segments, class Space>
void add_pieces(Segments& out, std::size_t from, const Space& space, std::size_t page_size) {
  for (std::size_t i = from; i < out.size(); ++i) {
    auto& seg = segment_of(out[i]);
    const std::size_t first = (seg.address - space.base) / page_size;
    for (std::size_t p = first; p < first + seg.total_size / page_size; ++p)
      append_piece(seg.pieces, space, p);
  }
}

// The physical memory behind the spaces of `arenas`: every handle, the spare pieces and,
// per space, the pages below its frontier that are dead (map a piece whose live page is
// elsewhere, or none).
template <class Arenas, class Handles, class Spare>
PhysicalMemory physical_memory(const Arenas& arenas, const Handles& handles, const Spare& spare,
                               int device, std::size_t page_size) {
  PhysicalMemory phys;
  phys.device = device;
  phys.piece_size = page_size;
  for (const auto& [id, h] : handles) {
    phys.handles.push_back(
        PhysicalHandleInfo{id, static_cast<std::uint32_t>(h->live_at.size()), h->counted_small});
  }
  const auto extend = [](PieceRun& run, PhysicalHandle id, std::uint32_t piece) {
    if (run.handle != id || run.first + run.count != piece) return false;
    ++run.count;
    return true;
  };
  for (const auto& [id, piece] : spare) {
    if (phys.spare.empty() || !extend(phys.spare.back(), id, piece)) {
      phys.spare.push_back(PieceRun{id, piece, 1});
    }
  }
  for (const auto& arena : arenas) {
    for (const auto& spaces : arena->spaces) {
      for (const auto& sp : spaces) {
        AddressRange& range = phys.ranges.emplace_back();
        range.address = sp->base;
        range.size = sp->reserved_pages * page_size;
        range.frontier = sp->pages.size() * page_size;
        range.stream = arena->stream;
        range.is_small = sp->small;
        for (std::size_t p = 0; p < sp->pages.size(); ++p) {
          const auto& page = sp->pages[p];
          const DevicePtr va = sp->base + p * page_size;
          if (page.handle == nullptr || page.handle->live_at[page.piece] == va) continue;
          DeadPages* last = range.dead.empty() ? nullptr : &range.dead.back();
          if (last == nullptr ||
              last->address + std::size_t{last->pieces.count} * page_size != va ||
              !extend(last->pieces, page.handle->id, page.piece)) {
            range.dead.push_back(DeadPages{va, PieceRun{page.handle->id, page.piece, 1}});
          }
        }
      }
    }
  }
  std::sort(phys.ranges.begin(), phys.ranges.end(),
            [](const AddressRange& a, const AddressRange& b) { return a.address < b.address; });
  return phys;
}

}  // namespace

// Each run of non-void blocks of a space is one segment (void pages hold no memory of
// theirs), as expandable segments report their mapped runs; its pages are live, so its
// pieces add up to its size and, with the spare pieces, to the reserved bytes.
std::vector<SegmentInfo> StitchEngine::segments() const {
  const AllArenasLock all(*this);
  std::vector<SegmentInfo> out;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    for (const auto& spaces : arena->spaces) {
      for (const auto& s : spaces) {
        const std::size_t from = out.size();
        SegmentInfo* seg = nullptr;
        for (const Block* b = s->first; b != nullptr; b = b->next) {
          if (b->kind == Block::Kind::kVoid) {
            seg = nullptr;
            continue;
          }
          if (seg == nullptr) {
            seg = &out.emplace_back();
            start_segment(*seg, device(), *b, arena->stream, s->small);
            seg->context = mapped_by(*s, b->ptr, page_).context;
          }
          const BlockState state = count_block(*seg, *b);
          seg->blocks.push_back(
              BlockInfo{b->ptr, b->size, b->requested, state,
                        state != BlockState::kInactive ? b->stack.context : nullptr});
        }
        add_pieces(out, from, *s, page_);
      }
    }
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  return out;
}

Snapshot StitchEngine::snapshot() {
  return snapshot(0);
}

Snapshot StitchEngine::snapshot(std::int64_t other_active_bytes) {
  Snapshot s;
  std::vector<HistoryEntry> entries;
  std::vector<std::pair<SnapshotSegment, std::vector<Origin>>> segs;
  {
    const AllArenasLock all(*this);
    std::int64_t active_bytes = 0;
    for (Arena* arena : all.arenas()) {
      all.held(*arena);
      active_bytes += pools_current(arena->stats.active_bytes);
    }
    record_trace(TraceAction::kSnapshot, 0,
                 static_cast<std::size_t>(active_bytes + other_active_bytes), 0, Origin{});
    s.allocator_settings = settings_of(config_);
    {
      Lock lock(trace_mutex_);
      recorder_.fill(s, entries);
    }
    {
      Lock device_lock(device_mutex_);
      s.physical.push_back(physical_memory(all.arenas(), handles_, spare_, device(), page_));
    }
    for (Arena* arena : all.arenas()) {
      all.held(*arena);
      for (const auto& spaces : arena->spaces) {
        for (const auto& sp : spaces) {
          const std::size_t from = segs.size();
          SnapshotSegment* seg = nullptr;
          for (const Block* b = sp->first; b != nullptr; b = b->next) {
            if (b->kind == Block::Kind::kVoid) {
              seg = nullptr;
              continue;
            }
            if (seg == nullptr) {
              seg = &segs.emplace_back().first;
              start_segment(*seg, device(), *b, arena->stream, sp->small);
              segs.back().second.push_back(mapped_by(*sp, b->ptr, page_));
            }
            SnapshotBlock block;
            block.address = b->ptr;
            block.size = b->size;
            block.requested_size = b->requested;
            block.island = b->in_island();
            block.state = count_block(*seg, *b);
            seg->blocks.push_back(block);
            segs.back().second.push_back(block.state != BlockState::kInactive ? b->stack
                                                                              : Origin{});
          }
          add_pieces(segs, from, *sp, page_);
        }
      }
    }
  }
  std::vector<StackTable::Id> ids;
  for (const HistoryEntry& e : entries) {
    if (e.stack.cpp != 0) ids.push_back(e.stack.cpp);
  }
  for (const auto& [seg, stacks] : segs) {
    for (const Origin& o : stacks) {
      if (o.cpp != 0) ids.push_back(o.cpp);
    }
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const auto frames = stack_table().symbolize(ids);
  // stacks: the segment's own (its first page's mapping), then one per block.
  for (auto& [seg, stacks] : segs) {
    seg.frames = StackTable::frames_of(frames, stacks[0].cpp);
    seg.context = std::move(stacks[0].context);
    for (std::size_t i = 0; i < seg.blocks.size(); ++i) {
      seg.blocks[i].frames = StackTable::frames_of(frames, stacks[i + 1].cpp);
      seg.blocks[i].context = std::move(stacks[i + 1].context);
    }
    s.segments.push_back(std::move(seg));
  }
  std::sort(
      s.segments.begin(), s.segments.end(),
      [](const SnapshotSegment& a, const SnapshotSegment& b) { return a.address < b.address; });
  s.device_traces.resize(static_cast<std::size_t>(device()) + 1);
  s.device_traces[static_cast<std::size_t>(device())] = snapshot_trace(entries, frames);
  return s;
}

}  // namespace ccalloc::core

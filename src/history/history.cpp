// History recording and snapshots.
#include "history/history.hpp"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "core/common.hpp"
#include "core/rounding.hpp"

namespace ccalloc {

HistoryOptions::Enabled HistoryOptions::parse_enabled(const std::string& s) {
  if (s == "none" || s.empty()) return Enabled::kNone;
  if (s == "state") return Enabled::kState;
  if (s == "all") return Enabled::kAll;
  throw ConfigError("ccalloc: invalid value '" + s +
                    "' for record_history 'enabled': expected none, state or all");
}

HistoryOptions::Context HistoryOptions::parse_context(const std::string& s) {
  if (s == "none" || s.empty()) return Context::kNone;
  if (s == "state") return Context::kState;
  if (s == "alloc") return Context::kAlloc;
  if (s == "all") return Context::kAll;
  throw ConfigError("ccalloc: invalid value '" + s +
                    "' for record_history 'context': expected none, state, alloc or all");
}

HistoryOptions::Stacks HistoryOptions::parse_stacks(const std::string& s) {
  if (s == "none" || s.empty()) return Stacks::kNone;
  if (s == "cpp" || s == "all") return Stacks::kCpp;
  throw ConfigError("ccalloc: invalid value '" + s +
                    "' for record_history 'stacks': expected cpp or none");
}

namespace core {

StackTable& stack_table() {
  static StackTable* const table = new StackTable();  // outlives every allocator
  return *table;
}

thread_local const Origin* OperationContext::current_ = nullptr;
const Origin OperationContext::kNone{};

void ContextSource::set(std::function<ContextHandle()> fn) {
  if (!fn) return;  // the previous callback stays: a racing operation may still call it
  auto kept = std::make_unique<const std::function<ContextHandle()>>(std::move(fn));
  std::lock_guard lock(mutex_);
  current_.store(kept.get(), std::memory_order_release);
  kept_.push_back(std::move(kept));
}

Origin capture_origin(bool cpp, const ContextSource* caller) {
  Origin o;
  if (cpp) o.cpp = stack_table().capture(2);  // capture() skips itself; this and the operation
  if (caller != nullptr) o.context = caller->capture();
  return o;
}


namespace {
struct MetadataTable {
  std::mutex mutex;
  std::vector<std::string> strings{""};  // id 0: none
  std::unordered_map<std::string, std::uint32_t> ids;
};
MetadataTable& metadata_table() {
  static MetadataTable* const table = new MetadataTable();
  return *table;
}
thread_local std::uint32_t t_metadata = 0;
}  // namespace

std::uint32_t intern_metadata(const std::string& s) {
  if (s.empty()) return 0;
  MetadataTable& t = metadata_table();
  std::lock_guard lock(t.mutex);
  const auto [it, inserted] = t.ids.emplace(s, static_cast<std::uint32_t>(t.strings.size()));
  if (inserted) t.strings.push_back(s);
  return it->second;
}

std::string metadata_string(std::uint32_t id) {
  MetadataTable& t = metadata_table();
  std::lock_guard lock(t.mutex);
  return id < t.strings.size() ? t.strings[id] : std::string();
}

std::uint32_t current_metadata() {
  return t_metadata;
}
void set_current_metadata(std::uint32_t id) {
  t_metadata = id;
}

std::vector<SnapshotTraceEntry> snapshot_trace(
    const std::vector<HistoryEntry>& entries,
    const std::unordered_map<StackTable::Id, Frames>& frames) {
  std::vector<SnapshotTraceEntry> trace;
  trace.reserve(entries.size());
  std::unordered_map<std::uint32_t, std::string> metadata;  // looked up once per id
  for (const HistoryEntry& e : entries) {
    SnapshotTraceEntry te;
    te.action = e.action;
    te.addr = e.addr;
    te.size = e.size;
    te.stream = e.stream;
    te.time_us = e.time_us;
    te.seq = e.seq;
    te.frames = StackTable::frames_of(frames, e.stack.cpp);
    te.context = e.stack.context;
    if (e.metadata != 0) {
      auto it = metadata.find(e.metadata);
      if (it == metadata.end())
        it = metadata.emplace(e.metadata, metadata_string(e.metadata)).first;
      te.user_metadata = it->second;
    }
    trace.push_back(std::move(te));
  }
  return trace;
}

void HistoryRing::configure(std::size_t capacity, bool clear) {
  std::vector<HistoryEntry> old;  // destroyed after the lock: dropped contexts go then
  lock();
  std::swap(old, entries_);
  const std::size_t n = old.size();
  capacity_ = std::max<std::size_t>(capacity, 1);
  if (!clear) {
    // Keep the newest entries, oldest first.
    const std::size_t keep = std::min(n, capacity_);
    if (keep < n) overflowed_ = true;
    for (std::size_t i = n - keep; i < n; ++i)
      entries_.push_back(std::move(old[(next_ + i) % n]));
  } else {
    overflowed_ = false;
  }
  next_ = entries_.size() == capacity_ ? 0 : entries_.size();
  unlock();
}

std::vector<HistoryEntry> HistoryRing::entries() const {
  lock();
  std::vector<HistoryEntry> out;
  out.reserve(entries_.size());
  const std::size_t n = entries_.size();
  const std::size_t start = n == capacity_ ? next_ : 0;
  for (std::size_t i = 0; i < n; ++i)
    out.push_back(entries_[(start + i) % n]);
  unlock();
  return out;
}

bool HistoryRing::overflowed() const {
  lock();
  const bool o = overflowed_;
  unlock();
  return o;
}

std::size_t HistoryRing::capacity() const {
  lock();
  const std::size_t c = capacity_;
  unlock();
  return c;
}

HistorySwitches history_switches(const HistoryOptions& options) {
  using O = HistoryOptions;
  HistorySwitches sw;
  const bool on = options.enabled != O::Enabled::kNone;
  sw.cpp = options.stacks == O::Stacks::kCpp;
  sw.caller = static_cast<bool>(options.capture_context);
  const bool stacks = on && (sw.cpp || sw.caller) && options.context != O::Context::kNone;
  sw.history = options.enabled == O::Enabled::kAll;
  sw.stacks_on_blocks = stacks;
  sw.stacks_on_entries = stacks && options.context >= O::Context::kAlloc;
  sw.capture_on_free = stacks && options.context == O::Context::kAll;
  return sw;
}

void HistoryRecorder::configure(const HistoryOptions& options, bool blocks_keep_stacks) {
  using O = HistoryOptions;
  const HistorySwitches sw = history_switches(options);
  const bool on = options.enabled != O::Enabled::kNone;
  history_on = sw.history;
  stacks_on_entries = sw.stacks_on_entries;
  // The callback is in place before any operation can see the switches that ask for it.
  contexts.set(options.capture_context);
  capture_cpp.store(sw.cpp, std::memory_order_relaxed);
  capture_caller.store(sw.caller, std::memory_order_relaxed);
  capture_on_malloc.store(blocks_keep_stacks ? sw.stacks_on_blocks : sw.stacks_on_entries,
                          std::memory_order_relaxed);
  capture_on_free.store(sw.capture_on_free && sw.history, std::memory_order_relaxed);
  // PyTorch keeps one entry unless everything is recorded; stopping clears the history.
  ring.configure(options.enabled == O::Enabled::kAll ? options.max_entries : 1,
                 options.clear || !on);
  if (!on || options.clear) annotations.clear();
}

void HistoryRecorder::annotate(std::string_view name, bool start, int device,
                               std::int64_t now_us) {
  if (!history_on) return;
  annotations.push_back(Annotation{std::string(name), start ? "START" : "END", device, now_us});
}

TraceEntry HistoryRecorder::record(TraceAction action, DevicePtr addr, std::size_t size,
                                   StreamId stream, std::int64_t now_us, const Origin& stack) {
  // Blocks keep their stacks from context "state" on; entries carry them from "alloc" on.
  const Origin& origin = stacks_on_entries ? stack : OperationContext::none();
  if (history_on) {
    ring.push(HistoryEntry{action, addr, size, stream, now_us, origin, current_metadata()});
  }
  const ContextHandle* context = origin.context ? &origin.context : nullptr;
  return TraceEntry{action, addr, size, stream, now_us, context};
}

void HistoryRecorder::fill(Snapshot& s, std::vector<HistoryEntry>& entries) const {
  entries = ring.entries();
  s.allocator_settings.trace_alloc_overflowed = ring.overflowed();
  s.allocator_settings.trace_alloc_max_entries = static_cast<std::int64_t>(ring.capacity());
  s.external_annotations = annotations;
}

}  // namespace core
}  // namespace ccalloc

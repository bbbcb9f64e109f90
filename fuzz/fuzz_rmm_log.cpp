// parse_rmm_log on arbitrary bytes: FormatError is the only acceptable failure. What it
// accepts must format and parse back to the same events (times relative to the first).
#include <string>
#include <vector>

#include "ccalloc/errors.hpp"
#include "fuzz_common.hpp"
#include "io/rmm_log.hpp"

using namespace ccalloc;
using namespace ccalloc::io;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<TraceRecord> records;
  try {
    records = parse_rmm_log(fuzz::as_text(data, size), "fuzz");
  } catch (const FormatError&) {
    return 0;
  }
  std::vector<TraceEntry> entries;
  bool small_times = true;  // differences then stay within what a log can express
  for (const TraceRecord& r : records) {
    entries.push_back(r.entry);
    constexpr std::int64_t kBound = std::int64_t{1} << 52;
    small_times = small_times && r.entry.time_us > -kBound && r.entry.time_us < kBound;
  }
  const std::vector<TraceRecord> back = parse_rmm_log(format_rmm_log(entries), "formatted");
  fuzz::check(back.size() == entries.size(), "events lost in format_rmm_log");
  for (std::size_t i = 0; i < back.size(); ++i) {
    const TraceEntry& a = back[i].entry;
    const TraceEntry& b = entries[i];
    fuzz::check(
        a.action == b.action && a.addr == b.addr && a.size == b.size && a.stream == b.stream,
        "format_rmm_log changed an event");
    if (small_times) {
      fuzz::check(a.time_us == b.time_us - entries.front().time_us,
                  "format_rmm_log changed a time");
    }
  }
  return 0;
}

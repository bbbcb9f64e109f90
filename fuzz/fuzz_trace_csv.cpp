// parse_trace_csv on arbitrary bytes: FormatError is the only acceptable failure. What it
// accepts must format and parse back to the same entries.
#include <string>
#include <vector>

#include "ccalloc/errors.hpp"
#include "fuzz_common.hpp"
#include "io/trace_csv.hpp"

using namespace ccalloc;
using namespace ccalloc::io;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<TraceRecord> records;
  try {
    records = parse_trace_csv(fuzz::as_text(data, size), "fuzz");
  } catch (const FormatError&) {
    return 0;
  }
  std::vector<TraceEntry> entries;
  entries.reserve(records.size());
  for (const TraceRecord& r : records)
    entries.push_back(r.entry);
  const std::vector<TraceRecord> back = parse_trace_csv(format_trace_csv(entries), "formatted");
  fuzz::check(back.size() == entries.size(), "entries lost in format_trace_csv");
  for (std::size_t i = 0; i < back.size(); ++i) {
    const TraceEntry& a = back[i].entry;
    const TraceEntry& b = entries[i];
    fuzz::check(a.action == b.action && a.addr == b.addr && a.size == b.size &&
                    a.stream == b.stream && a.time_us == b.time_us,
                "format_trace_csv changed an entry");
  }
  return 0;
}

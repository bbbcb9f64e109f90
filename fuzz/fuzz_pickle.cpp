// parse_pickle on arbitrary bytes: FormatError is the only acceptable failure. Whatever it
// accepts must survive write_pickle -> parse_pickle unchanged, write_json must produce JSON
// that reads back to the same JSON, and the snapshot schema must convert it or refuse it
// with a FormatError.
#include <optional>
#include <string>
#include <string_view>

#include "ccalloc/errors.hpp"
#include "fuzz_common.hpp"
#include "io/byte_input.hpp"
#include "io/json.hpp"
#include "io/pickle.hpp"
#include "io/snapshot_io.hpp"

using namespace ccalloc;
using namespace ccalloc::io;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  PickleLimits limits;
  limits.max_items = std::size_t{1} << 16;
  limits.max_memo = std::size_t{1} << 14;
  limits.max_string_bytes = std::size_t{1} << 22;
  // Whole and in chunks: the same value, or the same error at the same offset.
  const std::optional<Value> parsed = fuzz::parse_both_ways(
      fuzz::as_text(data, size), [&](std::string_view text) { return parse_pickle(text, "fuzz", limits); },
      [&](ByteInput& in) { return parse_pickle(in, "fuzz", limits); });
  if (!parsed) return 0;
  const Value& v = *parsed;

  // Pickle round trip: the same data (NaN equals NaN).
  const std::string pickled = write_pickle(v);
  const Value back = parse_pickle(pickled, "rewritten");
  fuzz::check(back == v, "parse_pickle(write_pickle(v)) != v");
  fuzz::check(write_pickle(back) == pickled, "write_pickle is not stable");

  // JSON: may refuse NaN, infinities and container keys; otherwise its text is stable.
  try {
    const std::string text = write_json(v);
    const std::string again = write_json(parse_json(text, "json", limits.max_depth));
    fuzz::check(again == text, "write_json(parse_json(write_json(v))) != write_json(v)");
  } catch (const FormatError&) {
  }

  // The snapshot schema: a FormatError, or a snapshot that converts back and forth.
  Snapshot s;
  Value tv;
  try {
    s = snapshot_from_value(v, "fuzz");
    tv = to_value(s);  // Error for a computed size beyond int64
  } catch (const Error&) {
    return 0;
  }
  const Snapshot again = snapshot_from_value(parse_pickle(write_pickle(tv), "tv"), "tv");
  fuzz::check(again.segments.size() == s.segments.size(), "segments lost");
  fuzz::check(again.device_traces.size() == s.device_traces.size(), "traces lost");
  for (std::size_t d = 0; d < s.device_traces.size(); ++d) {
    fuzz::check(trace_records(again, static_cast<int>(d)).size() == s.device_traces[d].size(),
                "trace entries lost");
  }
  fuzz::check(to_value(again) == tv, "to_value(snapshot_from_value(to_value(s))) != to_value(s)");
  return 0;
}

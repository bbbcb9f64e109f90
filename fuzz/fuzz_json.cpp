// parse_json on arbitrary bytes: FormatError is the only acceptable failure. Whatever it
// accepts must come back identical through write_json and through write_pickle.
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
  // Whole and in chunks: the same value, or the same error at the same offset.
  const std::optional<Value> parsed = fuzz::parse_both_ways(
      fuzz::as_text(data, size), [&](std::string_view text) { return parse_json(text, "fuzz", 128); },
      [&](ByteInput& in) { return parse_json(in, "fuzz", 128); });
  if (!parsed) return 0;
  const Value& v = *parsed;
  // A parsed document has no NaN, infinity or non-string key: writing cannot fail.
  const std::string text = write_json(v);
  fuzz::check(parse_json(text, "rewritten", 128) == v, "parse_json(write_json(v)) != v");
  fuzz::check(parse_pickle(write_pickle(v), "pickled") == v, "parse_pickle(write_pickle(v)) != v");
  try {
    const Snapshot s = snapshot_from_value(v, "fuzz");
    (void)write_json(to_value(s));
  } catch (const Error&) {
  }
  return 0;
}

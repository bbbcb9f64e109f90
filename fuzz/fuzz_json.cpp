// parse_json on arbitrary bytes: FormatError is the only acceptable failure. Whatever it
// accepts must come back identical through write_json and through write_pickle.
#include <string>

#include "ccalloc/errors.hpp"
#include "fuzz_common.hpp"
#include "io/json.hpp"
#include "io/pickle.hpp"
#include "io/snapshot_io.hpp"

using namespace ccalloc;
using namespace ccalloc::io;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Value v;
  try {
    v = parse_json(fuzz::as_text(data, size), "fuzz", 128);
  } catch (const FormatError&) {
    return 0;
  }
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

// A pickle walker independent of ccalloc's reader: checks that a pickle ccalloc wrote uses
// only the opcodes PyTorch's viewer reads and well-formed memo references (the snapshot
// file tests and the pickle writer tests share it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>

namespace ccalloc_test {

struct WalkResult {
  std::set<int> opcodes;
  bool ok = true;
  std::string problem;
  std::size_t puts = 0;
  std::size_t gets = 0;
};

// Scans a pickle written by write_pickle: every opcode must be in PyTorch's viewer's set,
// every memo reference must name an index stored before, and STOP must end the data.
inline WalkResult walk_pickle(std::string_view d) {
  WalkResult r;
  std::set<std::uint32_t> memo;
  std::size_t i = 0;
  auto fail = [&](const std::string& why) {
    r.ok = false;
    r.problem = why + " at byte " + std::to_string(i);
    return r;
  };
  auto u = [&](std::size_t at, std::size_t n) {
    std::uint32_t v = 0;
    for (std::size_t k = 0; k < n; ++k)
      v |= std::uint32_t{static_cast<unsigned char>(d[at + k])} << (8 * k);
    return v;
  };
  while (i < d.size()) {
    const auto op = static_cast<unsigned char>(d[i]);
    r.opcodes.insert(op);
    std::size_t arg = 0;
    switch (op) {
      case 0x80:  // PROTO
        if (i != 0 || d[1] != 2) return fail("PROTO 2 must come first");
        arg = 1;
        break;
      case '}':
      case '(':
      case 'u':
      case ']':
      case 'e':
      case ')':
      case 0x85:
      case 0x86:
      case 0x87:
      case 't':
      case 0x88:
      case 0x89:
      case 'N':
        break;
      case 'X':
        arg = 4 + u(i + 1, 4);
        break;
      case 'K':
        arg = 1;
        break;
      case 'M':
        arg = 2;
        break;
      case 'J':
        arg = 4;
        break;
      case 0x8a:  // LONG1
        arg = 1 + static_cast<unsigned char>(d[i + 1]);
        break;
      case 'G':
        arg = 8;
        break;
      case 'q':
        memo.insert(u(i + 1, 1));
        ++r.puts;
        arg = 1;
        break;
      case 'r':
        memo.insert(u(i + 1, 4));
        ++r.puts;
        arg = 4;
        break;
      case 'h':
      case 'j': {
        const std::size_t n = op == 'h' ? 1 : 4;
        if (memo.count(u(i + 1, n)) == 0) return fail("memo reference to an unset index");
        ++r.gets;
        arg = n;
        break;
      }
      case '.':
        if (i + 1 != d.size()) return fail("data after STOP");
        return r;
      default:
        return fail("opcode outside the viewer's set");
    }
    i += 1 + arg;
  }
  return fail("no STOP");
}

}  // namespace ccalloc_test

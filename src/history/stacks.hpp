// C++ call stacks for allocation history: captured cheaply on the hot path as raw return
// addresses, interned so each distinct stack is stored once, and symbolized only when a
// snapshot is taken (function names through the dynamic symbol tables, file:line from
// DWARF where the binary carries it).
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "ccalloc/snapshot.hpp"

namespace ccalloc::core {

class StackTable {
 public:
  using Id = std::uint32_t;  // 0: no stack
  static constexpr int kMaxFrames = 64;

  // Captures the calling thread's stack, skipping `skip` innermost frames (the allocator's
  // own), and returns its interned id.
  Id capture(int skip);
  // Interns a stack given as return addresses (innermost first).
  Id intern(const std::uintptr_t* frames, int count);
  std::vector<std::uintptr_t> addresses(Id id) const;
  std::size_t size() const;

  // Symbolized frames of each id in `ids`; identical ids share one list. Ids not in the
  // table map to null.
  std::unordered_map<Id, Frames> symbolize(const std::vector<Id>& ids) const;
  // The frames of `id` in what symbolize() returned; null for 0 (no stack) or an id it
  // was not asked for.
  static Frames frames_of(const std::unordered_map<Id, Frames>& symbolized, Id id) {
    const auto it = symbolized.find(id);
    return it == symbolized.end() ? nullptr : it->second;
  }

 private:
  struct Hash {
    std::size_t operator()(const std::vector<std::uintptr_t>& v) const;
  };
  mutable std::mutex mutex_;
  std::vector<std::vector<std::uintptr_t>> stacks_;  // id - 1 -> addresses
  std::unordered_map<std::vector<std::uintptr_t>, Id, Hash> ids_;
};

// Where an allocator operation came from (history.hpp): its C++ stack (0: none) and the caller's context (null:
// none).
struct Origin {
  StackTable::Id cpp = 0;
  ContextHandle context;
  explicit operator bool() const { return cpp != 0 || context != nullptr; }
  // Drops both; touches the reference count only when there is a handle (hot path).
  void clear() {
    cpp = 0;
    if (context != nullptr) context.reset();
  }
};

// Symbolizes one return address: "function" (demangled), "file", line (0 if unknown).
// Exposed for tests.
Frame symbolize_address(std::uintptr_t address);

// The unwinder capture() uses: "libunwind" when it loaded, else "backtrace" (glibc).
const char* stack_unwinder();

}  // namespace ccalloc::core

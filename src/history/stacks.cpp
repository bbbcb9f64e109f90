#include "history/stacks.hpp"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>

#if CCALLOC_HAVE_LIBUNWIND
#define UNW_LOCAL_ONLY
#include <libunwind.h>
#endif

#if CCALLOC_HAVE_LIBDW
#include <elfutils/libdwfl.h>
#include <unistd.h>
#endif

namespace ccalloc::core {

std::size_t StackTable::Hash::operator()(const std::vector<std::uintptr_t>& v) const {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const std::uintptr_t a : v)
    h = (h ^ a) * 0x100000001b3ull;
  return static_cast<std::size_t>(h);
}

namespace {

using BacktraceFn = int (*)(void**, int);

int glibc_backtrace(void** buffer, int size) { return ::backtrace(buffer, size); }

#if CCALLOC_HAVE_LIBUNWIND
#define CCALLOC_STRINGIFY_(x) #x
#define CCALLOC_STRINGIFY(x) CCALLOC_STRINGIFY_(x)
#endif

// libunwind caches each code address's unwind rule and walks stacks about ten times faster
// than glibc's backtrace(). It is loaded privately (RTLD_LOCAL) rather than linked: the
// libunwind.so that pkg-config names also defines _Unwind_RaiseException and friends, and
// linking it would route every C++ exception of the host program through its unwinder.
// Without it, or where it fails to load, glibc's backtrace() does the work.
BacktraceFn resolve_backtrace() {
#if CCALLOC_HAVE_LIBUNWIND
  for (const char* soname : {"libunwind.so.8", "libunwind.so"}) {
    void* handle = ::dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) continue;
    // unw_backtrace is a macro naming the architecture's local-only entry point.
    if (void* fn = ::dlsym(handle, CCALLOC_STRINGIFY(unw_backtrace))) {
      return reinterpret_cast<BacktraceFn>(fn);
    }
    ::dlclose(handle);
  }
#endif
  return &glibc_backtrace;
}

BacktraceFn backtrace_fn() {
  static const BacktraceFn fn = resolve_backtrace();
  return fn;
}

}  // namespace

const char* stack_unwinder() {
  return backtrace_fn() == &glibc_backtrace ? "backtrace" : "libunwind";
}

StackTable::Id StackTable::capture(int skip) {
  void* raw[kMaxFrames + 8];
  const int n = backtrace_fn()(raw, kMaxFrames + 8);
  const int first = std::min(n, skip + 1);  // +1: this function
  std::uintptr_t frames[kMaxFrames + 8];
  int count = 0;
  for (int i = first; i < n && count < kMaxFrames; ++i) {
    frames[count++] = reinterpret_cast<std::uintptr_t>(raw[i]);
  }
  return intern(frames, count);
}

StackTable::Id StackTable::intern(const std::uintptr_t* frames, int count) {
  std::vector<std::uintptr_t> key(frames, frames + count);
  std::lock_guard lock(mutex_);
  const auto it = ids_.find(key);
  if (it != ids_.end()) return it->second;
  stacks_.push_back(key);
  const auto id = static_cast<Id>(stacks_.size());
  ids_.emplace(std::move(key), id);
  return id;
}

std::vector<std::uintptr_t> StackTable::addresses(Id id) const {
  std::lock_guard lock(mutex_);
  if (id == 0 || id > stacks_.size()) return {};
  return stacks_[id - 1];
}

std::size_t StackTable::size() const {
  std::lock_guard lock(mutex_);
  return stacks_.size();
}

namespace {

std::string demangle(const char* name) {
  if (name == nullptr) return {};
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> out(
      abi::__cxa_demangle(name, nullptr, nullptr, &status), &std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

#if CCALLOC_HAVE_LIBDW
// One libdwfl session over this process's modules, reused across calls.
class Dwarf {
 public:
  Dwarf() {
    callbacks_.find_elf = dwfl_linux_proc_find_elf;
    callbacks_.find_debuginfo = dwfl_standard_find_debuginfo;
    dwfl_ = dwfl_begin(&callbacks_);
    if (dwfl_ != nullptr) {
      dwfl_report_begin(dwfl_);
      if (dwfl_linux_proc_report(dwfl_, getpid()) != 0 ||
          dwfl_report_end(dwfl_, nullptr, nullptr) != 0) {
        dwfl_end(dwfl_);
        dwfl_ = nullptr;
      }
    }
  }
  ~Dwarf() {
    if (dwfl_ != nullptr) dwfl_end(dwfl_);
  }
  Dwarf(const Dwarf&) = delete;
  Dwarf& operator=(const Dwarf&) = delete;

  // Fills what DWARF and the symbol table know about `pc`; returns false if nothing.
  bool lookup(std::uintptr_t pc, Frame& f) const {
    if (dwfl_ == nullptr) return false;
    Dwfl_Module* module = dwfl_addrmodule(dwfl_, pc);
    if (module == nullptr) return false;
    if (const char* name = dwfl_module_addrname(module, pc)) f.name = demangle(name);
    if (Dwfl_Line* line = dwfl_module_getsrc(module, pc)) {
      int lineno = 0;
      if (const char* file = dwfl_lineinfo(line, nullptr, &lineno, nullptr, nullptr, nullptr)) {
        f.filename = file;
        f.line = lineno;
      }
    }
    return !f.name.empty();
  }

 private:
  Dwfl_Callbacks callbacks_{};
  Dwfl* dwfl_ = nullptr;
};
#endif

// Symbolizes return addresses; one session per snapshot, so modules loaded since the last
// one are seen.
class Symbolizer {
 public:
  Frame lookup(std::uintptr_t address) const {
    // A return address points after the call: look up the call instruction itself.
    const std::uintptr_t pc = address > 0 ? address - 1 : address;
    Frame f;
#if CCALLOC_HAVE_LIBDW
    if (dwarf_.lookup(pc, f) && !f.filename.empty()) return f;
#endif
    Dl_info info{};
    if (::dladdr(reinterpret_cast<void*>(pc), &info) != 0) {
      if (f.name.empty() && info.dli_sname != nullptr) f.name = demangle(info.dli_sname);
      if (f.filename.empty() && info.dli_fname != nullptr) {
        // No line information: the object file, and the offset in it as the "line".
        f.filename = info.dli_fname;
        f.line = static_cast<std::int64_t>(pc - reinterpret_cast<std::uintptr_t>(info.dli_fbase));
      }
    }
    if (f.name.empty()) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(address));
      f.name = buf;
    }
    return f;
  }

 private:
#if CCALLOC_HAVE_LIBDW
  Dwarf dwarf_;
#endif
};

}  // namespace

Frame symbolize_address(std::uintptr_t address) {
  return Symbolizer().lookup(address);
}

std::unordered_map<StackTable::Id, Frames> StackTable::symbolize(const std::vector<Id>& ids) const {
  std::unordered_map<Id, Frames> out;
  if (ids.empty()) return out;
  const Symbolizer symbolizer;
  std::unordered_map<std::uintptr_t, Frame> frames;  // each address symbolized once
  for (const Id id : ids) {
    if (id == 0 || out.count(id) != 0) continue;
    const std::vector<std::uintptr_t> addrs = addresses(id);
    if (addrs.empty()) {
      out.emplace(id, nullptr);
      continue;
    }
    auto list = std::make_shared<std::vector<Frame>>();
    list->reserve(addrs.size());
    for (const std::uintptr_t a : addrs) {
      auto it = frames.find(a);
      if (it == frames.end()) it = frames.emplace(a, symbolizer.lookup(a)).first;
      list->push_back(it->second);
    }
    out.emplace(id, std::move(list));
  }
  return out;
}

}  // namespace ccalloc::core

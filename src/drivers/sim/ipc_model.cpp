// The simulated GPU's model of sharing memory between processes (cuMemExportToShareableHandle
// / cuMemImportFromShareableHandle, cudaIpcGetMemHandle / cudaIpcOpenMemHandle /
// cudaIpcCloseMemHandle) and of memory contents.
//
// Every SimDriver of the process shares one registry of exported handles, so two SimDrivers
// stand for two processes on one device. An entry names the exporting process (its pid),
// the kind, the size and the contents. A POSIX file descriptor is a number unique in the
// process; a fabric handle and an allocation handle are 64 bytes: a tag and the entry's
// number. The exporter's release_physical (closing its descriptors) or free removes its
// entries; memory already imported stays, because importer and exporter share its Contents.
//
// Invariants, all under mutex_ (the registry under its own mutex, taken after mutex_):
//   every token in a Physical::exports or allocation_exports_ names a registry entry of
//   this driver's memory, with the same Contents;
//   imported physical allocations are not in physical_bytes_; opened_ ranges are disjoint
//   from every other range (first_fit avoids them).
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "drivers/sim/sim_common.hpp"

namespace ccalloc::sim {

struct SimDriver::Contents {
  explicit Contents(std::size_t n) : bytes(n) {}
  std::mutex mutex;  // two drivers may touch one Contents
  std::vector<unsigned char> bytes;
};

namespace {

enum class EntryKind { kPosixFd, kFabric, kAllocation };

struct Entry {
  EntryKind kind = EntryKind::kPosixFd;
  int pid = 0;
  std::size_t bytes = 0;
  std::shared_ptr<void> contents;  // a SimDriver::Contents
};

struct Registry {
  std::mutex mutex;
  std::map<std::uint64_t, Entry> entries;
  std::uint64_t next = 3;  // descriptors 0-2 are the standard streams
};

Registry& registry() {
  static Registry r;
  return r;
}

constexpr char kFabricTag[8] = {'s', 'i', 'm', 'f', 'a', 'b', 'r', 0};
constexpr char kAllocationTag[8] = {'s', 'i', 'm', 'i', 'p', 'c', 'm', 0};

std::string tagged(const char (&tag)[8], std::uint64_t token) {
  std::string out(64, '\0');
  std::memcpy(out.data(), tag, sizeof tag);
  std::memcpy(out.data() + 8, &token, sizeof token);
  return out;
}

const char* kind_name(EntryKind k) {
  switch (k) {
    case EntryKind::kPosixFd: return "POSIX file descriptor";
    case EntryKind::kFabric: return "fabric handle";
    case EntryKind::kAllocation: return "allocation handle";
  }
  return "handle";
}

std::uint64_t add_entry(Entry e) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const std::uint64_t token = r.next++;
  r.entries.emplace(token, std::move(e));
  return token;
}

}  // namespace

void SimDriver::set_exportable_kinds(unsigned kinds) {
  std::lock_guard lock(mutex_);
  exportable_kinds_ = kinds;
}

unsigned SimDriver::exportable_kinds() const {
  std::lock_guard lock(mutex_);
  return exportable_kinds_;
}

std::string SimDriver::export_physical(PhysicalHandle handle, ShareKind kind) {
  std::lock_guard lock(mutex_);
  const std::string what = std::string("export_physical of handle ") + std::to_string(handle) +
                           " as a " +
                           kind_name(kind == ShareKind::kPosixFd ? EntryKind::kPosixFd
                                                                 : EntryKind::kFabric);
  const auto it = physical_.find(handle);
  if (it == physical_.end()) {
    fail(what + ": no such physical allocation (never created, or already released)");
  }
  Physical& p = it->second;
  if (p.imported) fail(what + ": it was imported from another process");
  if ((p.exportable & share_kind_bit(kind)) == 0) {
    fail(what + ": it was not created exportable as that kind (set_exportable_kinds)");
  }
  if (p.contents == nullptr) p.contents = std::make_shared<Contents>(p.bytes);
  const EntryKind ek = kind == ShareKind::kPosixFd ? EntryKind::kPosixFd : EntryKind::kFabric;
  // As the CUDA driver, a handle exported twice as a descriptor gives the same descriptor.
  {
    Registry& r = registry();
    std::lock_guard rlock(r.mutex);
    for (const std::uint64_t t : p.exports) {
      if (r.entries.at(t).kind == ek) {
        if (ek == EntryKind::kFabric) return tagged(kFabricTag, t);
        const auto fd = static_cast<std::int32_t>(t);
        return std::string(reinterpret_cast<const char*>(&fd), sizeof fd);
      }
    }
  }
  const std::uint64_t token = add_entry(Entry{ek, static_cast<int>(::getpid()), p.bytes, p.contents});
  p.exports.push_back(token);
  if (ek == EntryKind::kFabric) return tagged(kFabricTag, token);
  const auto fd = static_cast<std::int32_t>(token);
  return std::string(reinterpret_cast<const char*>(&fd), sizeof fd);
}

PhysicalHandle SimDriver::import_physical(std::string_view exported, ShareKind kind, int pid,
                                          std::size_t bytes) {
  const EntryKind ek = kind == ShareKind::kPosixFd ? EntryKind::kPosixFd : EntryKind::kFabric;
  std::uint64_t token = 0;
  std::string name;
  if (exported.size() != share_kind_bytes(kind)) {
    fail(std::string("import_physical of a ") + kind_name(ek) + " of " +
         bytes_str(exported.size()) + ": expected " + bytes_str(share_kind_bytes(kind)));
  }
  if (ek == EntryKind::kPosixFd) {
    std::int32_t fd = 0;
    std::memcpy(&fd, exported.data(), sizeof fd);
    token = static_cast<std::uint64_t>(static_cast<std::uint32_t>(fd));
    name = "POSIX file descriptor " + std::to_string(fd);
  } else {
    if (std::memcmp(exported.data(), kFabricTag, sizeof kFabricTag) != 0) {
      fail("import_physical of a fabric handle that no simulated GPU made");
    }
    std::memcpy(&token, exported.data() + 8, sizeof token);
    name = "fabric handle " + std::to_string(token);
  }
  const std::string what =
      "import_physical of " + name + " of process " + std::to_string(pid) + " (" + bytes_str(bytes) + ")";
  std::shared_ptr<void> contents;
  {
    Registry& r = registry();
    std::lock_guard rlock(r.mutex);
    const auto it = r.entries.find(token);
    if (it == r.entries.end() || it->second.kind != ek) {
      fail(what + ": no such exported handle (never exported, or released by its exporter)");
    }
    if (it->second.pid != pid) {
      fail(what + ": it was exported by process " + std::to_string(it->second.pid));
    }
    if (it->second.bytes != bytes) {
      fail(what + ": the exported allocation has " + bytes_str(it->second.bytes));
    }
    contents = it->second.contents;
  }
  std::lock_guard lock(mutex_);
  const PhysicalHandle handle = next_handle_++;
  Physical p;
  p.bytes = bytes;
  p.imported = true;
  p.contents = std::static_pointer_cast<Contents>(contents);
  physical_.emplace(handle, std::move(p));
  return handle;
}

std::string SimDriver::export_allocation(DevicePtr base) {
  std::lock_guard lock(mutex_);
  const auto it = live_.find(base);
  if (it == live_.end()) {
    fail("export_allocation of " + hex_address(base) +
         ": it is not the start of a live device allocation");
  }
  const auto known = allocation_exports_.find(base);
  if (known != allocation_exports_.end()) return tagged(kAllocationTag, known->second);
  auto& contents = allocation_contents_[base];
  if (contents == nullptr) contents = std::make_shared<Contents>(it->second);
  const std::uint64_t token =
      add_entry(Entry{EntryKind::kAllocation, static_cast<int>(::getpid()), it->second, contents});
  allocation_exports_.emplace(base, token);
  return tagged(kAllocationTag, token);
}

DevicePtr SimDriver::open_allocation(std::string_view exported) {
  if (exported.size() != kAllocationHandleBytes ||
      std::memcmp(exported.data(), kAllocationTag, sizeof kAllocationTag) != 0) {
    fail("open_allocation of " + bytes_str(exported.size()) +
         " that are not an allocation handle of a simulated GPU");
  }
  std::uint64_t token = 0;
  std::memcpy(&token, exported.data() + 8, sizeof token);
  Entry entry;
  {
    Registry& r = registry();
    std::lock_guard rlock(r.mutex);
    const auto it = r.entries.find(token);
    if (it == r.entries.end() || it->second.kind != EntryKind::kAllocation) {
      fail("open_allocation of allocation handle " + std::to_string(token) +
           ": no such exported allocation (never exported, or freed by its exporter)");
    }
    entry = it->second;
  }
  std::lock_guard lock(mutex_);
  const DevicePtr addr =
      first_fit(options_.vm_base_address, entry.bytes, options_.vm_granularity);
  opened_.emplace(addr, Opened{entry.bytes, std::static_pointer_cast<Contents>(entry.contents)});
  return addr;
}

void SimDriver::close_allocation(DevicePtr ptr) {
  std::lock_guard lock(mutex_);
  if (opened_.erase(ptr) == 0) {
    fail("close_allocation of " + hex_address(ptr) +
         ": no allocation of another process is open there");
  }
}

void SimDriver::forget_exports(std::vector<std::uint64_t>& tokens) {
  if (tokens.empty()) return;
  Registry& r = registry();
  std::lock_guard rlock(r.mutex);
  for (const std::uint64_t t : tokens)
    r.entries.erase(t);
  tokens.clear();
}

void SimDriver::forget_allocation(DevicePtr base) {
  allocation_contents_.erase(base);
  const auto it = allocation_exports_.find(base);
  if (it == allocation_exports_.end()) return;
  std::vector<std::uint64_t> tokens{it->second};
  allocation_exports_.erase(it);
  forget_exports(tokens);
}

std::size_t SimDriver::imported_handles() const {
  std::lock_guard lock(mutex_);
  return static_cast<std::size_t>(std::count_if(
      physical_.begin(), physical_.end(), [](const auto& e) { return e.second.imported; }));
}

// The region holding `ptr`: a mapping, a device allocation or an opened allocation. Sets
// `offset` to ptr's offset in the contents; returns them (made on first use) and the bytes
// of the region from ptr on, or {nullptr, 0}.
std::pair<SimDriver::Contents*, std::size_t> SimDriver::contents_at(DevicePtr ptr,
                                                                    std::size_t& offset) {
  const auto containing = [ptr](auto& map, auto size_of) {
    auto it = map.upper_bound(ptr);
    if (it == map.begin()) return map.end();
    --it;
    return ptr < it->first + size_of(it->second) ? it : map.end();
  };
  if (auto m = containing(mappings_, [](const Mapping& x) { return x.bytes; });
      m != mappings_.end()) {
    Physical& p = physical_.at(m->second.handle);
    if (p.contents == nullptr) p.contents = std::make_shared<Contents>(p.bytes);
    offset = m->second.offset + (ptr - m->first);
    return {p.contents.get(), m->first + m->second.bytes - ptr};
  }
  if (auto a = containing(live_, plain_size); a != live_.end()) {
    auto& c = allocation_contents_[a->first];
    if (c == nullptr) c = std::make_shared<Contents>(a->second);
    offset = ptr - a->first;
    return {c.get(), a->first + a->second - ptr};
  }
  if (auto o = containing(opened_, [](const Opened& x) { return x.bytes; }); o != opened_.end()) {
    offset = ptr - o->first;
    return {o->second.contents.get(), o->first + o->second.bytes - ptr};
  }
  return {nullptr, 0};
}

void SimDriver::write(DevicePtr ptr, const void* data, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const auto* from = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    std::size_t offset = 0;
    const auto [c, room] = contents_at(ptr, offset);
    if (c == nullptr)
      fail("write of " + bytes_str(bytes) + " at " + hex_address(ptr) + ": not device memory");
    const std::size_t n = std::min(bytes, room);
    std::lock_guard clock(c->mutex);
    std::memcpy(c->bytes.data() + offset, from, n);
    ptr += n;
    from += n;
    bytes -= n;
  }
}

// Reading may create empty contents, which is no observable change.
void SimDriver::read(DevicePtr ptr, void* data, std::size_t bytes) const {
  auto& self = const_cast<SimDriver&>(*this);  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  std::lock_guard lock(mutex_);
  auto* to = static_cast<unsigned char*>(data);
  while (bytes > 0) {
    std::size_t offset = 0;
    const auto [c, room] = self.contents_at(ptr, offset);
    if (c == nullptr)
      fail("read of " + bytes_str(bytes) + " at " + hex_address(ptr) + ": not device memory");
    const std::size_t n = std::min(bytes, room);
    std::lock_guard clock(c->mutex);
    std::memcpy(to, c->bytes.data() + offset, n);
    ptr += n;
    to += n;
    bytes -= n;
  }
}

}  // namespace ccalloc::sim

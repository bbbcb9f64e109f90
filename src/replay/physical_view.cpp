#include "replay/physical_view.hpp"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>
#include <tuple>

#include "core/format.hpp"

namespace ccalloc::replay {
namespace {

constexpr std::size_t kMaxProblems = 20;  // a broken file names its first problems only

void problem(PhysicalView& v, const std::string& text) {
  if (v.problems.size() < kMaxProblems) v.problems.push_back(text);
}

std::string piece_name(PhysicalHandle h, std::uint64_t piece) {
  return "piece " + std::to_string(piece) + " of handle " + std::to_string(h);
}

// Sizes as PyTorch's _memory_viz and `ccalloc summary` print them ("3.3GiB").
std::string size_text(double n) {
  static const char* const kUnits[] = {"", "Ki", "Mi", "Gi", "Ti", "Pi"};
  for (const char* unit : kUnits) {
    if (n < 1024.0) {
      char buf[48];
      std::snprintf(buf, sizeof buf, "%3.1f%sB", n, unit);
      return buf;
    }
    n /= 1024.0;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.1fEiB", n);
  return buf;
}

// A run of pieces [first, end) of one handle that backs pages (live) or none (spare).
struct Claim {
  PhysicalHandle handle;
  std::uint64_t first;
  std::uint64_t end;
  bool spare;
  DevicePtr page;  // the first page it backs (live)
};

}  // namespace

std::optional<PhysicalView> physical_view(const Snapshot& s, int device) {
  const PhysicalMemory* p = s.physical_of(device);
  if (p == nullptr) return std::nullopt;
  PhysicalView v;
  v.device = device;
  v.piece_size = p->piece_size;
  const std::size_t g = p->piece_size;
  if (g == 0) {
    problem(v, "the piece size is 0");
    return v;
  }

  std::map<PhysicalHandle, std::uint32_t> pieces_of;
  for (const PhysicalHandleInfo& h : p->handles) {
    if (!pieces_of.emplace(h.handle, h.pieces).second) {
      problem(v, "handle " + std::to_string(h.handle) + " is listed twice");
    }
  }
  v.handles = p->handles.size();
  v.held_bytes = p->held_bytes();
  v.spare_bytes = p->spare_bytes();
  v.spare_pieces = g > 0 ? v.spare_bytes / g : 0;

  std::vector<Claim> claims;
  const auto claim = [&](const PieceRun& r, bool spare, DevicePtr page) {
    const auto h = pieces_of.find(r.handle);
    const std::uint64_t end = std::uint64_t{r.first} + r.count;
    if (h == pieces_of.end()) {
      problem(v, piece_name(r.handle, r.first) + " belongs to no handle held");
    } else if (end > h->second) {
      problem(v, piece_name(r.handle, end - 1) + " is past the handle's " +
                     std::to_string(h->second) + " pieces");
    }
    claims.push_back(Claim{r.handle, r.first, end, spare, page});
  };
  for (const PieceRun& r : p->spare)
    claim(r, true, 0);

  // Ranges by address, and the segments of each.
  for (const AddressRange& r : p->ranges) {
    RangeView& rv = v.ranges.emplace_back();
    rv.address = r.address;
    rv.size = r.size;
    rv.frontier = r.frontier;
    rv.stream = r.stream;
    rv.is_small = r.is_small;
    for (const DeadPages& d : r.dead) {
      rv.dead_pages += d.pieces.count;
      if (d.address < r.address ||
          d.address + std::size_t{d.pieces.count} * g > r.address + r.frontier) {
        problem(v, "dead pages at " + hex_address(d.address) + " lie outside their range's pages");
      }
    }
  }
  std::sort(v.ranges.begin(), v.ranges.end(),
            [](const RangeView& a, const RangeView& b) { return a.address < b.address; });
  for (const SnapshotSegment& seg : s.segments) {
    if (seg.device != device) continue;
    v.segment_bytes += seg.total_size;
    auto it = std::upper_bound(v.ranges.begin(), v.ranges.end(), seg.address,
                               [](DevicePtr a, const RangeView& r) { return a < r.address; });
    RangeView* rv = nullptr;
    if (it != v.ranges.begin()) {
      RangeView& r = *std::prev(it);
      if (seg.address + seg.total_size <= r.address + r.frontier) rv = &r;
    }
    if (rv == nullptr) {
      problem(v, "the segment at " + hex_address(seg.address) + " lies in no range's pages");
    }
    std::uint64_t backed = 0;
    DevicePtr page = seg.address;
    for (const PieceRun& r : seg.pieces) {
      claim(r, false, page);
      backed += r.count;
      page += std::size_t{r.count} * g;
    }
    if (backed * g != seg.total_size) {
      problem(v, "the segment at " + hex_address(seg.address) + " has " + std::to_string(backed) +
                     " pieces for " + std::to_string(seg.total_size) + " bytes");
    }
    if (rv == nullptr) continue;
    ++rv->segments;
    rv->live_pages += seg.total_size / g;
    for (const SnapshotBlock& b : seg.blocks) {
      if (b.state == BlockState::kInactive) {
        rv->free_bytes += b.size;
        rv->largest_free = std::max(rv->largest_free, b.size);
      } else {
        rv->allocated_bytes += b.size;
      }
    }
  }
  for (RangeView& r : v.ranges) {
    const std::size_t pages = r.frontier / g;
    if (r.live_pages + r.dead_pages > pages) {
      problem(
          v, "the range at " + hex_address(r.address) + " has more live and dead pages than pages");
    } else {
      r.unmapped_pages = pages - r.live_pages - r.dead_pages;
    }
    r.mapped_bytes = (r.live_pages + r.dead_pages) * g;
    r.physical_bytes = r.live_pages * g;
    r.fragmentation = r.free_bytes > 0 ? 1.0 - static_cast<double>(r.largest_free) /
                                                   static_cast<double>(r.free_bytes)
                                       : 0.0;
    v.dead_pages += r.dead_pages;
  }

  // Each piece backs one page at most, or is spare. A run may span a whole handle of many
  // pieces and hold several shorter runs, so each run is checked against the
  // furthest-reaching earlier run of its handle, and a page is named for the piece itself.
  // On a tie the spare run comes first, so that the messages do not depend on the sort.
  std::sort(claims.begin(), claims.end(), [](const Claim& a, const Claim& b) {
    return std::tie(a.handle, a.first, b.spare, a.page) <
           std::tie(b.handle, b.first, a.spare, b.page);
  });
  const auto where = [&](const Claim& c, std::uint64_t piece) {
    return c.spare ? std::string("spare")
                   : "behind the page at " + hex_address(c.page + (piece - c.first) * g);
  };
  const Claim* reach = nullptr;  // of the runs so far of this handle, the one ending last
  for (const Claim& c : claims) {
    if (reach != nullptr && reach->handle == c.handle && c.first < reach->end) {
      problem(v, piece_name(c.handle, c.first) + " is both " + where(*reach, c.first) + " and " +
                     where(c, c.first));
    }
    if (reach == nullptr || reach->handle != c.handle || c.end > reach->end) reach = &c;
  }
  if (v.segment_bytes + v.spare_bytes != v.held_bytes) {
    problem(v, "the segments (" + std::to_string(v.segment_bytes) + " bytes) and spare pieces (" +
                   std::to_string(v.spare_bytes) + ") do not add up to the " +
                   std::to_string(v.held_bytes) + " bytes of the handles");
  }
  return v;
}

std::string physical_summary(const PhysicalView& v) {
  std::string out;
  char line[320];
  std::snprintf(line, sizeof line,
                "physical memory (stitching policy): %zu handles of %s pieces hold %s = %s in "
                "segments + %s spare\n",
                v.handles, size_text(static_cast<double>(v.piece_size)).c_str(),
                size_text(static_cast<double>(v.held_bytes)).c_str(),
                size_text(static_cast<double>(v.segment_bytes)).c_str(),
                size_text(static_cast<double>(v.spare_bytes)).c_str());
  out += line;
  out +=
      "range               type   stream      mapped      live pages  dead pages  "
      "unmapped    free        largest free  fragmentation\n";
  for (const RangeView& r : v.ranges) {
    std::snprintf(
        line, sizeof line,
        "0x%-16llx  %-5s  %-10llu  %-10s  %-10zu  %-10zu  %-10zu  %-10s  %-12s  %5.1f %%\n",
        static_cast<unsigned long long>(r.address), r.is_small ? "small" : "large",
        static_cast<unsigned long long>(r.stream),
        size_text(static_cast<double>(r.mapped_bytes)).c_str(), r.live_pages, r.dead_pages,
        r.unmapped_pages, size_text(static_cast<double>(r.free_bytes)).c_str(),
        size_text(static_cast<double>(r.largest_free)).c_str(), 100.0 * r.fragmentation);
    out += line;
  }
  std::snprintf(line, sizeof line, "spare pieces: %zu (%s)\ndead pages: %zu\n", v.spare_pieces,
                size_text(static_cast<double>(v.spare_bytes)).c_str(), v.dead_pages);
  out += line;
  for (const std::string& p : v.problems)
    out += "inconsistent: " + p + "\n";
  return out;
}

}  // namespace ccalloc::replay

// render_contexts (include/ccalloc/snapshot.hpp): a snapshot's caller contexts rendered into
// frames. Apart from the history so that the snapshot writers (and the file-reader fuzz
// targets that build them alone) need nothing else of the engine.
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ccalloc/snapshot.hpp"

namespace ccalloc {

void render_contexts(Snapshot& s, const ContextFrames& render) {
  if (!render) return;
  // One list per (C++ stack list, handle) pair; each handle rendered once.
  std::unordered_map<const void*, std::vector<Frame>> rendered;
  std::map<std::pair<const void*, const void*>, Frames> combined;
  const auto frames_of = [&](const Frames& cpp, const ContextHandle& context) -> Frames {
    if (!context) return cpp;
    auto r = rendered.find(context.get());
    if (r == rendered.end()) r = rendered.emplace(context.get(), render(context)).first;
    if (r->second.empty()) return cpp;
    const auto key = std::make_pair(static_cast<const void*>(cpp.get()), context.get());
    auto c = combined.find(key);
    if (c == combined.end()) {
      auto list = std::make_shared<std::vector<Frame>>();
      if (cpp) list->insert(list->end(), cpp->begin(), cpp->end());
      list->insert(list->end(), r->second.begin(), r->second.end());
      c = combined.emplace(key, std::move(list)).first;
    }
    return c->second;
  };
  for (SnapshotSegment& seg : s.segments) {
    seg.frames = frames_of(seg.frames, seg.context);
    for (SnapshotBlock& b : seg.blocks)
      b.frames = frames_of(b.frames, b.context);
  }
  for (auto& trace : s.device_traces) {
    for (SnapshotTraceEntry& e : trace)
      e.frames = frames_of(e.frames, e.context);
  }
}

}  // namespace ccalloc

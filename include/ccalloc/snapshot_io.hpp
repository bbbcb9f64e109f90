// Snapshot files in PyTorch's schema (what torch.cuda.memory._snapshot() returns and
// pytorch.org/memory_viz reads): pickle or JSON, plain or gzip. Link ccalloc::ccalloc.
#pragma once

#include <string>

#include "ccalloc/snapshot.hpp"

namespace ccalloc::io {

// Reads a snapshot file: pickle or JSON (detected from the content), gzip or plain, PyTorch's
// own snapshots included. Throws FormatError naming the file, the byte offset or the
// missing key, and Error when the file cannot be read or written.
Snapshot read_snapshot(const std::string& path);
// Writes JSON for a path ending in ".json" or ".json.gz", else pickle; gzip-compressed
// when the path ends in ".gz".
void write_snapshot(const std::string& path, const Snapshot& s);
// As above, with each caller context rendered into frames by `frames` (render_contexts in
// snapshot.hpp), so the viewer and ccalloc's tools show the caller's frames.
void write_snapshot(const std::string& path, const Snapshot& s, const ContextFrames& frames);

}  // namespace ccalloc::io

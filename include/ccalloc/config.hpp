// Allocator configuration in PyTorch's grammar:
//
//   [preset,]key:value(,key:value)*     value := token | [k:v,k:v,...]
//
// read from CCALLOC_CONF, with the keys of PyTorch's variable (PYTORCH_CUDA_ALLOC_CONF,
// else PYTORCH_ALLOC_CONF) applied on top (from_environment). Whitespace
// is ignored; booleans are exactly True/False. An optional bare preset name comes first:
// `pytorch` is PyTorch's native behaviour exactly (also after ccalloc's own defaults
// change); `ccalloc` (the default) is ccalloc's recommended behaviour, today PyTorch's
// policy; `stitch_segments:True` selects the stitching policy on virtual memory. Keys given
// after the preset override it.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ccalloc {

inline constexpr std::size_t kMiB = 1024 * 1024;

// Which implementation serves the allocator (the config key `backend`): the native caching
// engine or the device's stream-ordered pool.
enum class BackendKind { kNative, kCudaMallocAsync };

struct Config {
  // Number of power-of-two intervals of the roundup table: [1 MiB, 2 MiB) ... [32 GiB, inf).
  static constexpr int kRoundupIntervals = 16;

  std::string preset = "ccalloc";
  BackendKind backend = BackendKind::kNative;
  // Blocks of at least this size are "oversize": never split, never given to smaller
  // requests, releasable by the OOM ladder. SIZE_MAX means unlimited.
  std::size_t max_split_size = SIZE_MAX;
  // A request >= max_split_size may take a cached block only if block < request + this.
  std::size_t max_non_split_rounding_size = 20 * kMiB;
  // Segment size for 1-10 MiB requests.
  std::size_t large_segment_size = 20 * kMiB;
  // Divisions per power-of-two interval for request rounding; 0 or 1 means 512 B rounding.
  std::array<std::size_t, kRoundupIntervals> roundup_power2_divisions{};
  // Age-based release of cached segments once reserved memory exceeds this fraction of the
  // memory limit (the per-process fraction if set, else device capacity). 0 disables.
  double garbage_collection_threshold = 0.0;
  // Segments on CUDA virtual memory that grow by pages instead of new cudaMalloc segments.
  // On by default in the `ccalloc` preset (off in `pytorch`, as in PyTorch). Under the
  // stitching policy below it applies to the private pools, which that policy leaves to
  // PyTorch's rules (docs/ccalloc-policy.md).
  bool expandable_segments = true;
  // The `ccalloc` policy (src/stitch/backend.hpp): physical memory in pieces of the
  // mapping granularity, stitched into the address ranges that need them, for every
  // default pool; private pools beside it. On by default in the `ccalloc` preset
  // (`stitch_segments:False` gives PyTorch's policy on expandable segments). The native
  // backend only; `uncached` and `backend:cudaMallocAsync` take precedence.
  bool stitch_segments = true;
  // Under the stitching policy: a stream short of memory may take another stream's freed
  // pages while that stream's GPU work may still reach their frees, and its own work then
  // waits on the device (cudaStreamWaitEvent) for the fence after them. False: only pages
  // whose frees the GPU has passed (a completed fence) or an idle stream's are taken.
  // Trades some overlap of the streams for memory (docs/ccalloc-policy.md, rule 9).
  bool stream_borrow_wait = true;
  // Under the stitching policy: the size of the physical handles new memory is created in
  // (whole pages, one at the least). 0, the default: sized by the room left under the limit,
  // from 64 MiB with 128 GiB or more free down to one 2 MiB page in the last 8 GiB
  // (docs/ccalloc-policy.md, rule 3.3). A fixed size trades memory near the limit for fewer
  // creations and mappings (larger) or the reverse.
  std::size_t stitch_handle_size = 0;
  // Address space reserved for each expandable segment: a fraction of device memory, or an
  // absolute size; at most (and by default) 9/8 of device memory. 0: the default.
  double expandable_segments_reserve_fraction = 0.0;
  std::size_t expandable_segments_reserve_bytes = 0;
  // Accepted for compatibility. ccalloc holds only the calling stream's arena lock around a
  // device allocation, so other streams are never blocked by it.
  bool release_lock_on_cudamalloc = false;
  // Reserved memory is capped at this fraction of device capacity (1.0 = no cap).
  double per_process_memory_fraction = 1.0;
  // Accepted for compatibility: frees of blocks used on other streams during capture always
  // wait until no capture is underway (docs/design.md#private-pools).
  bool graph_capture_record_stream_reuse = false;
  // Pinned-host allocator options: accepted and reported, not used (no host allocator).
  bool pinned_use_cuda_host_register = false;
  std::size_t pinned_num_register_threads = 1;
  bool pinned_use_background_threads = false;
  std::size_t pinned_reserve_segment_size_mb = 0;
  // Every malloc is a device allocation and every free a device free (as
  // PYTORCH_NO_CUDA_MEMORY_CACHING=1): no cache, no stats, no trace entries.
  bool uncached = false;

  // The raw string this config was parsed from ("" for defaults).
  std::string source;

  // Parses a config string. Throws ConfigError naming the key, the value, the offset and
  // the accepted form.
  static Config parse(std::string_view text);
  // The config in force for a new allocator: CCALLOC_CONF (the preset and any keys), then
  // the keys of PyTorch's variable on top of it (PYTORCH_CUDA_ALLOC_CONF if set, else
  // PYTORCH_ALLOC_CONF: the one PyTorch reads), so a key set in both takes PyTorch's value.
  // Only CCALLOC_CONF may name a preset where both are set. `uncached` is also set by
  // CCALLOC_NO_CACHING=1 or PYTORCH_NO_CUDA_MEMORY_CACHING=1. Throws ConfigError naming the
  // variable, the key and the offset.
  static Config from_environment();

  // Divisions that apply to a request of `size` bytes (the table lookup of
  // docs/pytorch-behaviour.md §1.4): floor(log2(size)) - 20, clamped to the table; sizes
  // below 2 MiB (and 0) use entry 0.
  std::size_t roundup_divisions_for(std::size_t size) const {
    const int log2 = static_cast<int>(std::bit_width(size)) - 1;
    const int index = std::clamp(log2 - 20, 0, kRoundupIntervals - 1);
    return roundup_power2_divisions[static_cast<std::size_t>(index)];
  }
  // Canonical string of every setting, parseable by parse().
  std::string to_string() const;

  bool operator==(const Config&) const = default;
};

}  // namespace ccalloc

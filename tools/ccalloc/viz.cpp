#include "viz.hpp"

#include <chrono>
#include <fstream>
#include <iostream>

#include "ccalloc/errors.hpp"
#include "ccalloc/stats.hpp"
#include "io/snapshot_io.hpp"
#include "io/trace_file.hpp"
#include "replay/replay.hpp"
#include "viz/page.hpp"
#include "viz/what_if.hpp"

namespace ccalloc::cli {
namespace {

std::string base_name(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool has_expandable_rows(const std::vector<io::TraceRecord>& trace) {
  for (const io::TraceRecord& r : trace) {
    if (r.entry.action == TraceAction::kSegmentMap ||
        r.entry.action == TraceAction::kSegmentUnmap) {
      return true;
    }
  }
  return false;
}

}  // namespace

CLI::App* add_viz_command(CLI::App& app, VizArgs& args) {
  CLI::App* viz = app.add_subcommand(
      "viz", "Write an interactive memory viewer (one self-contained HTML file, works offline)");
  viz->add_option("file", args.file,
                  "Snapshot (pickle or JSON, PyTorch's or ccalloc's), trace CSV or RMM log; "
                  "plain or gzip")
      ->required();
  viz->add_option("-o,--output", args.out, "The HTML file to write")->required();
  viz->add_option("--device", args.device, "Device to show (default: the longest trace)");
  viz->add_option("--conf", args.conf,
                  "Trace files only: config to replay under (default: pytorch, with "
                  "expandable_segments:True when the trace maps pages)");
  viz->add_option("--capacity", args.capacity,
                  "Trace files only: simulated device memory (default 141GiB); a smaller one "
                  "shows where the trace would run out of memory");
  viz->add_option("--title", args.title, "Title shown in the page (default: the file name)");
  viz->add_flag("--no-what-if", args.no_what_if,
                "Skip replaying an OOMing trace under other configs");
  return viz;
}

int run_viz(const VizArgs& args) {
  const auto started = std::chrono::steady_clock::now();
  const io::FileKind kind = io::detect_kind(args.file);
  const bool snapshot =
      kind == io::FileKind::kSnapshotPickle || kind == io::FileKind::kSnapshotJson;
  viz::PageOptions options;
  options.title = args.title.empty() ? base_name(args.file) : args.title;
  options.device = args.device;
  options.what_if = !args.no_what_if;

  Snapshot s;
  if (snapshot) {
    if (!args.conf.empty() || !args.capacity.empty()) {
      throw Error("viz: --conf and --capacity apply to trace files, which are replayed; " +
                  args.file + " is a snapshot and is shown as recorded");
    }
    s = io::read_snapshot(args.file);
    options.source = std::string(io::to_string(kind)) + ", as recorded";
  } else {
    // A trace has no segments or blocks: replaying it with PyTorch's policy and the trace's
    // own device addresses rebuilds them exactly (the recorded allocator's decisions).
    const auto trace = io::read_any_trace(args.file, args.device < 0 ? 0 : args.device);
    replay::Options replay;
    replay.conf = !args.conf.empty()           ? args.conf
                  : has_expandable_rows(trace) ? "pytorch,expandable_segments:True"
                                               : "pytorch";
    replay.capacity = replay::parse_size(args.capacity.empty() ? "141GiB" : args.capacity);
    replay.address_oracle = true;
    replay::Result result;
    try {
      s = viz::replay_with_history(trace, replay, &result);
    } catch (const FormatError& e) {
      throw FormatError(args.file + ": " + e.what());
    }
    options.device = -1;  // the replay's single simulated device
    options.conf = replay.conf;
    options.capacity = replay.capacity;
    options.stats = result.stats;
    options.source = std::string(io::to_string(kind)) + ", replayed on a simulated GPU of " +
                     format_size(replay.capacity) + " under \"" + replay.conf + "\"";
  }

  const std::string html = viz::render_page(s, options);
  std::ofstream out(args.out, std::ios::binary | std::ios::trunc);
  out.write(html.data(), static_cast<std::streamsize>(html.size()));
  out.close();
  if (!out) throw Error("viz: cannot write " + args.out);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::cout << "wrote " << args.out << " (" << format_size(html.size()) << ") in "
            << static_cast<int>(seconds * 1000) << " ms; open it in a browser\n";
  return 0;
}

}  // namespace ccalloc::cli

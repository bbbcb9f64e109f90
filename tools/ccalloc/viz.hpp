// `ccalloc viz`: writes the interactive memory viewer for a snapshot or a trace as one
// self-contained HTML file (viz/page.hpp).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace ccalloc::cli {

struct VizArgs {
  std::string file;
  std::string out;
  int device = -1;  // -1: the device with the longest trace
  std::string conf;
  std::string capacity;
  std::string title;
  bool no_what_if = false;
};

// Registers the `viz` subcommand, filling `args` when it is parsed.
CLI::App* add_viz_command(CLI::App& app, VizArgs& args);

// Runs it: prints what it wrote, returns the exit code; throws ccalloc::Error on bad input.
int run_viz(const VizArgs& args);

}  // namespace ccalloc::cli

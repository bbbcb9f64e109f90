#!/usr/bin/env bash
# Installs this build tree into a fresh prefix, then builds and runs two programs against
# the installed files only: tests/install/consumer (CMake, find_package(ccalloc CONFIG)) and
# tests/install/c_consumer (a C program, compiler flags from pkg-config).
#   install_test.sh BUILD_DIR WORK_DIR VERSION CXX_COMPILER C_COMPILER [SANITIZERS]
# SANITIZERS (e.g. address,undefined) is the build's CCALLOC_SANITIZE: instrumented libraries
# need the consumers compiled and linked with the same -fsanitize flags.
set -euo pipefail
build=$1 work=$2 version=$3 cxx=$4 cc=$5 sanitize=${6:-}
san_flags=""
if [ -n "$sanitize" ]; then san_flags="-fsanitize=$sanitize"; fi
here=$(cd "$(dirname "$0")" && pwd)
prefix=$work/prefix
rm -rf "$work"
mkdir -p "$work"

step() { echo "== $*"; }
run_logged() {  # runs a command; shows its output only when it fails
  local log=$work/$1; shift
  if ! "$@" >"$log" 2>&1; then cat "$log"; echo "install_test: failed: $*" >&2; exit 1; fi
}

step "cmake --install $build --prefix $prefix"
run_logged install.log cmake --install "$build" --prefix "$prefix"
(cd "$prefix" && find . -type f -o -type l | sort)

step "CMake consumer (find_package(ccalloc CONFIG REQUIRED))"
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
run_logged consumer-configure.log cmake -S "$here/consumer" -B "$work/consumer" \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" "${launcher[@]}" \
  -DCMAKE_CXX_FLAGS="$san_flags" -DCMAKE_EXE_LINKER_FLAGS="$san_flags"
run_logged consumer-build.log cmake --build "$work/consumer"
"$work/consumer/consumer" "$work/snapshot.pickle.gz"

step "pkg-config consumer (C, libccalloc.so)"
pc_dir=$(dirname "$(find "$prefix" -name ccalloc.pc | head -1)")
export PKG_CONFIG_PATH=$pc_dir
pc_version=$(pkg-config --modversion ccalloc)
if [ "$pc_version" != "$version" ]; then
  echo "install_test: ccalloc.pc has version '$pc_version', expected '$version'" >&2
  exit 1
fi
libdir=$(pkg-config --variable=libdir ccalloc)
# shellcheck disable=SC2046  # pkg-config's flags are separate words
# shellcheck disable=SC2086  # no flags, or one
"$cc" -std=c11 -Wall -Wextra -Werror $san_flags -o "$work/c_consumer" "$here/c_consumer/main.c" \
  $(pkg-config --cflags --libs ccalloc) -Wl,-rpath,"$libdir"
"$work/c_consumer" "$version"

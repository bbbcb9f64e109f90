#!/usr/bin/env bash
# Memory and time of `ccalloc replay` on hostile and large inputs (a benchmark, not a test).
#   bench/replay_memory.sh [path/to/ccalloc]     (default build/plain/bin/ccalloc)
# Prints one table:
#   zeros.gz        4 GB of zeros gzipped (~4 MB): must fail fast in little memory.
#   baseline        a 3-row gzip trace: the process's fixed footprint (binary, libraries,
#                   zlib and the reader's buffers).
#   live-N          N allocations live at once, then freed: gives the bytes one live
#                   allocation costs the replay (allocator block, maps, replay's address map).
#   <largest trace> the bundled trace with the most entries.
#   <snapshot>      the largest bundled snapshot (X.pickle.gz) replayed as a trace, next to
#                   the CSV of the same trace (X.csv.gz): the snapshot is parsed as it is
#                   read and its entries are not kept, so its extra memory over the CSV is
#                   the rest of the snapshot (segments) and the parser's memo.
# "live state" of a trace = its peak number of live allocations x the per-allocation bytes
# measured by live-N; the ratio compares the trace's replay memory above the baseline with
# that estimate. A reader that held the whole file would add entries x ~48 bytes (a
# TraceRecord) on top, which the last column shows for scale.
set -euo pipefail
cd "$(dirname "$0")/.."
cli=${1:-build/plain/bin/ccalloc}
[ -x "$cli" ] || { echo "bench/replay_memory.sh: $cli not built (target ccalloc_cli)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Runs the replay; sets secs and rss_kb. The replay's own failure is expected for zeros.gz.
measure() {
  /usr/bin/time -f '%e %M' -o "$work/time" "$cli" replay "$1" >/dev/null 2>"$work/err" || true
  # GNU time puts "Command exited with non-zero status" first when the replay fails.
  read -r secs rss_kb < <(tail -n 1 "$work/time")
}

head -c 4000000000 /dev/zero | gzip -9 >"$work/zeros.gz"
printf 'action,addr,size,stream,time_us\nalloc,4096,512,0,0\nfree_requested,4096,512,0,1\nfree_completed,4096,512,0,1\n' \
  | gzip >"$work/baseline.csv.gz"
n=200000
awk -v n=$n 'BEGIN {
  print "action,addr,size,stream,time_us"
  for (i = 0; i < n; i++) printf "alloc,%d,512,0,%d\n", 4096 + i * 512, i
  for (i = 0; i < n; i++) {
    printf "free_requested,%d,512,0,%d\n", 4096 + i * 512, n + i
    printf "free_completed,%d,512,0,%d\n", 4096 + i * 512, n + i
  }
}' | gzip >"$work/live.csv.gz"

largest=""
largest_entries=0
for f in data/traces/*.csv.gz; do
  e=$(($(zcat "$f" | wc -l) - 1))
  if [ "$e" -gt "$largest_entries" ]; then largest=$f; largest_entries=$e; fi
done
peak_live=$(zcat "$largest" | awk -F, 'NR > 1 {
  if ($1 == "alloc") { live++; if (live > peak) peak = live }
  else if ($1 == "free_completed") live--
} END { print peak }')

printf '%-34s %10s %8s %12s %12s %12s\n' input entries secs max_rss_MiB live_MiB ratio
measure "$work/zeros.gz"
printf '%-34s %10s %8s %12.1f %12s %12s\n' "zeros.gz ($(($(stat -c %s "$work/zeros.gz") / 1000)) kB)" - \
  "$secs" "$(echo "$rss_kb / 1024" | bc -l)" - -
echo "    -> $(head -c 160 "$work/err")"
measure "$work/baseline.csv.gz"
base_kb=$rss_kb
printf '%-34s %10s %8s %12.1f %12s %12s\n' baseline 3 "$secs" "$(echo "$base_kb / 1024" | bc -l)" - -
measure "$work/live.csv.gz"
per_alloc=$(echo "($rss_kb - $base_kb) * 1024 / $n" | bc -l)
printf '%-34s %10s %8s %12.1f %12.1f %12s\n' "live-$n ($(printf %.0f "$per_alloc") B/alloc)" $((3 * n)) \
  "$secs" "$(echo "$rss_kb / 1024" | bc -l)" "$(echo "($rss_kb - $base_kb) / 1024" | bc -l)" 1.00
measure "$largest"
live_mib=$(echo "$peak_live * $per_alloc / 1048576" | bc -l)
above=$(echo "($rss_kb - $base_kb) / 1024" | bc -l)
printf '%-34s %10s %8s %12.1f %12.1f %12.2f\n' "$(basename "$largest") (peak $peak_live live)" \
  "$largest_entries" "$secs" "$(echo "$rss_kb / 1024" | bc -l)" "$live_mib" \
  "$(echo "$above / $live_mib" | bc -l)"
snapshot=""
for f in data/traces/*.pickle.gz; do
  [ -f "${f%.pickle.gz}.csv.gz" ] || continue
  if [ -z "$snapshot" ] || [ "$(stat -c %s "$f")" -gt "$(stat -c %s "$snapshot")" ]; then snapshot=$f; fi
done
if [ -n "$snapshot" ]; then
  same_csv=${snapshot%.pickle.gz}.csv.gz
  snap_entries=$(($(zcat "$same_csv" | wc -l) - 1))
  measure "$same_csv"
  csv_kb=$rss_kb
  printf '%-34s %10s %8s %12.1f %12s %12s\n' "$(basename "$same_csv")" "$snap_entries" "$secs" \
    "$(echo "$csv_kb / 1024" | bc -l)" - -
  measure "$snapshot"
  printf '%-34s %10s %8s %12.1f %12s %12s\n' "$(basename "$snapshot") (same trace)" \
    "$snap_entries" "$secs" "$(echo "$rss_kb / 1024" | bc -l)" - -
  printf '    -> snapshot replay uses %.1f MiB more than the CSV replay of the same trace\n' \
    "$(echo "($rss_kb - $csv_kb) / 1024" | bc -l)"
fi
printf '\nratio = (max RSS - baseline RSS) / (peak live allocations x B/alloc); a whole-file\n'
printf 'reader would also hold %d entries x 48 B = %.1f MiB.\n' "$largest_entries" \
  "$(echo "$largest_entries * 48 / 1048576" | bc -l)"

#!/usr/bin/env bash
# make demo: stallfreed on a temporary socket, the GPT trainer's demo preset (~21M parameters)
# as 2 TSP ranks in zenflow mode on the generated corpus, the summary and the plot, then the
# daemon's stats; the daemon is stopped at the end (or on Ctrl-C).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/stallfree-demo-XXXXXX)
out=${DEMO_OUT:-demo-out}
sock="$dir/stallfreed.sock"
./bazel-bin/server/stallfreed --socket "$sock" --log_level warning --state_dir "$dir/state" \
  2>"$dir/daemon.log" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
echo "== stallfreed on $sock (pid $daemon)"
./bazel-bin/trainer/trainer --socket "$sock" --preset demo --nproc 2 --mode zenflow \
  --steps "${DEMO_STEPS:-50}" --batch 8 --eval_every 10 --lr 2e-3 --out_dir "$out" --run_name demo "$@"
echo
echo "== stallfreectl stats"
./bazel-bin/client/stallfreectl --socket "$sock" stats
kill -TERM $daemon; wait $daemon; echo "== stallfreed exited with status $?"
trap 'rm -rf "$dir"' EXIT
echo "metrics, summary and plot: $out/ (metrics.csv, summary.json, train.png)"

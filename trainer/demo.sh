#!/usr/bin/env bash
# make demo: a daemon on a temporary socket, the synthetic trainer against it, then the stats.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/stallfree-demo-XXXXXX)
sock="$dir/stallfreed.sock"
./bazel-bin/server/stallfreed --socket "$sock" --log_level warning 2>"$dir/daemon.log" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
echo "== stallfreed on $sock (pid $daemon)"
./bazel-bin/trainer/synthetic_trainer --socket "$sock" "$@"
echo
echo "== stallfreectl stats"
./bazel-bin/client/stallfreectl --socket "$sock" stats
kill -TERM $daemon; wait $daemon; echo "== stallfreed exited with status $?"
trap 'rm -rf "$dir"' EXIT

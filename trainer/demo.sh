#!/usr/bin/env bash
# make demo: a GPT (the demo preset at 6 layers: 10.9M parameters, 2 TSP ranks, the generated
# corpus) trained three times on the same data with the same recipe, once per optimizer mode:
# no-offload (AdamW on the "device"), sync-offload (ZeRO-Offload: every step waits for the
# daemon's AdamW) and zenflow (the engine's defaults but a 20-step exact warm-up: its default,
# 100, is longer than the whole demo), all against one stallfreed on a temporary socket. Then
# offload_modeled_bench --quick (the three modes' step times of a 0.11B model on a modeled H100 +
# PCIe device against a real daemon: MODELED, not measured on a GPU), and compare_runs: one plot
# (the loss curves on top of each other, also from the warm-up's end on; the measured step times
# side by side; the modeled ones in their own panel) and a short text comparison. The daemon is
# stopped at the end (or on Ctrl-C).
#
# DEMO_STEPS (default 40) steps per run; DEMO_OUT (default demo-out) the output folder;
# DEMO_MODELED=0 leaves the modeled benchmark out. Arguments are passed to every trainer run.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${DEMO_STEPS:-40}
out=${DEMO_OUT:-demo-out}
warmup=20  # zenflow's exact warm-up (synchronous AdamW on every column), then ZenFlow's rounds
modes=(no-offload sync-offload zenflow)
# The recipe: a 10-step linear lr warm-up to 1e-3, cosine decay to 1e-4, gradients clipped to
# norm 1, 8 sequences of 128 bytes a step. At lr 2e-3 (the demo before) the loss jumped from 3.25
# to 4.55 at step 9 (gradient norm 136) in every mode: the recipe's, not the offload's.
recipe=(--preset demo --layers 6 --nproc 2 --batch 8 --steps "$steps" --lr 1e-3 --lr_warmup 10
        --clip 1 --seed 1 --eval_every 20 --quiet)
dir=$(mktemp -d /tmp/stallfree-demo-XXXXXX)
sock="$dir/stallfreed.sock"
start=$SECONDS
./bazel-bin/server/stallfreed --socket "$sock" --log_level warning --state_dir "$dir/state" \
  2>"$dir/daemon.log" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
echo "== stallfreed on $sock (pid $daemon)"
mkdir -p "$out"
declare -A what=(
  [no-offload]="AdamW in place on the \"device\", no daemon"
  [sync-offload]="ZeRO-Offload: all gradients to stallfreed every step, which waits for its AdamW"
  [zenflow]="the top 10% of each weight's columns updated on the device at once, the rest by
  stallfreed in the background, one round late; exact AdamW for the first $warmup steps")
for mode in "${modes[@]}"; do
  echo
  echo "== $mode ($(( SECONDS - start )) s so far): ${what[$mode]}"
  extra=()
  if [ "$mode" = zenflow ]; then extra=(--engine_warmup "$warmup"); fi
  ./bazel-bin/trainer/trainer --socket "$sock" --mode "$mode" "${recipe[@]}" "${extra[@]}" \
    --out_dir "$out/$mode" --run_name "demo-$mode" "$@"
done
echo
echo "== stallfreectl stats (the sync-offload and zenflow runs' sessions)"
./bazel-bin/client/stallfreectl --socket "$sock" stats
kill -TERM $daemon; wait $daemon; echo "== stallfreed exited with status $?"
trap 'rm -rf "$dir"' EXIT

modeled_args=()
if [ "${DEMO_MODELED:-1}" != 0 ]; then
  echo
  echo "== offload_modeled_bench --quick: the three modes' step times of a 0.11B GPT on a" \
       "MODELED H100 + PCIe Gen5 device, the daemon doing its real work here" \
       "($(( SECONDS - start )) s so far; output in $out/modeled_bench.txt)"
  if ./bazel-bin/bench/offload_modeled_bench --quick >"$out/modeled_bench.txt" 2>&1; then
    modeled_args=(--modeled "$out/modeled_bench.txt" --modeled_title
                  "0.11B GPT, modeled H100 + PCIe Gen5, real daemon (offload_modeled_bench)")
  else
    echo "(the modeled benchmark failed; see $out/modeled_bench.txt: the plot shows the measured" \
         "step times only)"
  fi
fi

marks=()
if [ "$warmup" -lt "$steps" ]; then
  marks=(--marks "$warmup=zenflow: exact AdamW"$'\n'"up to step $warmup,"$'\n'"ZenFlow after"
         --zoom_from "$warmup")
fi
echo
echo "== comparison: the same data and recipe, $steps steps each (2 TSP ranks on this machine's" \
     "CPU: the \"device\" and the daemon share its cores, and other processes' load shows in" \
     "the step times; load average now: $(cut -d' ' -f1-3 /proc/loadavg))"
./bazel-bin/trainer/compare_runs --png "$out/train.png" --baseline no-offload \
  --title "make demo: a 10.9M-parameter GPT, 2 TSP ranks, $steps steps per mode, the same data" \
  "${marks[@]}" "${modeled_args[@]}" \
  zenflow="$out/zenflow/metrics.csv" no-offload="$out/no-offload/metrics.csv" \
  sync-offload="$out/sync-offload/metrics.csv"
echo "each run's metrics, summary and plot: $out/<mode>/ (metrics.csv, summary.json, train.png)"
echo "== demo done in $(( SECONDS - start )) s"

#!/usr/bin/env bash
# stallfreectl against a real daemon: health, stats, sessions and checkpoints in both formats,
# delete-checkpoint, what another uid sees (as uid 65534, when run as root), and the errors a user
# gets for no daemon or a bad command.
set -euo pipefail
daemon=server/stallfreed
ctl=client/stallfreectl
holder=testing/session_holder
dir=$(mktemp -d /tmp/stallfree-ctl-XXXXXX)
sock="$dir/d.sock"
cleanup() { kill -9 "${hpid:-}" "${dpid:-}" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

out=$($ctl --socket "$sock" health 2>&1) && fail "health without a daemon succeeded"
grep -q "no stallfreed is listening on $sock" <<<"$out" || fail "no-daemon error: $out"
$ctl --help | grep -q -- "--socket" || fail "--help lacks --socket"
$daemon --help | grep -q -- "--pinned_mib" || fail "stallfreed --help lacks --pinned_mib"
$daemon --bogus >/dev/null 2>&1 && fail "stallfreed accepted an unknown flag"
$ctl --socket "$sock" frobnicate >/dev/null 2>&1 && fail "unknown command accepted"

$daemon --socket "$sock" --log_level warning --state_dir "$dir/state" 2>"$dir/log" &
dpid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
[ "$($ctl --socket "$sock" health)" = "SERVING  $sock" ] || fail "health"
$ctl --socket "$sock" -o json health | grep -q '"status": "SERVING"' || fail "json health"

$holder "$sock" 1000 > "$dir/holder.out" &
hpid=$!
for _ in $(seq 100); do grep -q ready "$dir/holder.out" 2>/dev/null && break; sleep 0.05; done
table=$($ctl --socket "$sock" sessions)
grep -Eq "^1 +holder +7 +$hpid " <<<"$table" || fail "sessions table: $table"
json=$($ctl --socket "$sock" -o json sessions)
grep -q '"name": "holder"' <<<"$json" || fail "sessions json: $json"
grep -q '"param_elements": "1000"' <<<"$json" || fail "sessions json elements: $json"
stats=$($ctl --socket "$sock" -o json stats)
grep -q '"sessions": "1"' <<<"$stats" || fail "stats json: $stats"
$ctl --socket "$sock" stats | grep -Eq "^sessions +1 " || fail "stats table"
[ -d "$dir/state" ] || fail "--state_dir was not created"
ckpt=$($ctl --socket "$sock" checkpoints)
grep -q "state directory $dir/state" <<<"$ckpt" || fail "checkpoints table: $ckpt"
me=$(id -u)
mkdir -p -m 0700 "$dir/state/$me"
printf 'SFCKPT1\n' > "$dir/state/$me/broken.sfckpt"
printf 'SFCKPT1\n' > "$dir/state/legacy.sfckpt"   # stallfreed 0.1.0's flat layout: no owner
ckpt=$($ctl --socket "$sock" checkpoints)
grep -Eq "^$me +broken +.*unusable: .*truncated" <<<"$ckpt" || fail "broken checkpoint: $ckpt"
$ctl --socket "$sock" -o json checkpoints | grep -q '"tag": "broken"' || fail "json checkpoints"
if [ "$me" = 0 ]; then
  grep -Eq "^0 +legacy +.*unusable: no owner" <<<"$ckpt" || fail "legacy checkpoint: $ckpt"
fi
$ctl --socket "$sock" delete-checkpoint broken | grep -q "deleted checkpoint broken" ||
  fail "delete-checkpoint"
[ ! -e "$dir/state/$me/broken.sfckpt" ] || fail "delete-checkpoint left the file"
out=$($ctl --socket "$sock" delete-checkpoint broken 2>&1) && fail "second delete succeeded"
grep -q "NOT_FOUND" <<<"$out" || fail "second delete: $out"
$ctl --socket "$sock" delete-checkpoint ../x >/dev/null 2>&1 && fail "path-like tag accepted"
$ctl --socket "$sock" delete-checkpoint >/dev/null 2>&1 && fail "delete-checkpoint without a tag"

# Another uid sees none of root's sessions or checkpoints, and cannot delete them.
if [ "$me" = 0 ] && command -v setpriv >/dev/null; then
  chmod 0755 "$dir"
  printf 'SFCKPT1\n' > "$dir/state/0/mine.sfckpt"
  nobody() { setpriv --reuid 65534 --regid 65534 --clear-groups "$@"; }
  t=$(nobody $ctl --socket "$sock" sessions) || fail "sessions as 65534"
  [ "$(wc -l <<<"$t")" = 1 ] || fail "uid 65534 sees root's session: $t"
  t=$(nobody $ctl --socket "$sock" checkpoints) || fail "checkpoints as 65534"
  grep -q "mine\|legacy" <<<"$t" && fail "uid 65534 sees root's checkpoints: $t"
  out=$(nobody $ctl --socket "$sock" delete-checkpoint mine 2>&1) && fail "65534 deleted mine"
  grep -q "NOT_FOUND" <<<"$out" || fail "65534's delete: $out"
  [ -e "$dir/state/0/mine.sfckpt" ] || fail "root's checkpoint is gone"
fi

# A trainer in its own pid namespace (as in a container without hostPID) names a pid the daemon
# cannot resolve; it still opens, attaches, and is then listed with the kernel's pid.
if [ "$me" = 0 ] && unshare --pid --fork --mount-proc true 2>/dev/null; then
  unshare --pid --fork --mount-proc $holder "$sock" 123 > "$dir/ns.out" &
  nspid=$!
  for _ in $(seq 100); do grep -q ready "$dir/ns.out" 2>/dev/null && break; sleep 0.05; done
  grep -q ready "$dir/ns.out" || fail "a session from another pid namespace did not open"
  nsid=$(awk '/ready/ {print $2}' "$dir/ns.out")
  row=$($ctl --socket "$sock" sessions | awk -v id="$nsid" '$1 == id')
  hostpid=$(pgrep -f "^$holder $sock 123$" | head -1)
  [ -n "$row" ] && [ "$(awk '{print $4}' <<<"$row")" = "$hostpid" ] ||
    fail "the namespaced session's pid: '$row', host pid $hostpid"
  kill -9 $nspid 2>/dev/null || true
  pkill -9 -f "^$holder $sock 123$" || true
fi

sid=$(awk '/ready/ {print $2}' "$dir/holder.out")
# top: without a terminal, --iterations refreshes of rates and sessions; in tmux, a live screen
# that q ends. metrics: the Prometheus text, for root and the daemon's uid only.
out=$($ctl --socket "$sock" --watch 0.1 --iterations 2 top)
[ "$(grep -c "^pushes/s" <<<"$out")" = 2 ] || fail "top --iterations 2: $out"
grep -Eq "^$sid +holder +7 " <<<"$out" || fail "top lacks the holder's session: $out"
if command -v tmux >/dev/null; then
  tmux -L sftest new-session -d -s top -x 150 -y 30 "$PWD/$ctl --socket $sock --watch 0.2 top"
  for _ in $(seq 50); do
    screen=$(tmux -L sftest capture-pane -p -t top 2>/dev/null || true)
    grep -q "holder" <<<"$screen" && break
    sleep 0.1
  done
  grep -q "pushes/s" <<<"$screen" && grep -q "(q to quit)" <<<"$screen" ||
    fail "top in tmux: $screen"
  grep -Eq "^$sid +holder" <<<"$screen" || fail "top in tmux lacks the session: $screen"
  tmux -L sftest send-keys -t top q
  for _ in $(seq 50); do tmux -L sftest has-session -t top 2>/dev/null || break; sleep 0.1; done
  tmux -L sftest has-session -t top 2>/dev/null && { tmux -L sftest kill-server; fail "q did not end top"; }
  tmux -L sftest kill-server 2>/dev/null || true
fi
metrics=$($ctl --socket "$sock" metrics)
grep -q "^stallfree_build_info{" <<<"$metrics" || fail "stallfreectl metrics: $metrics"
if [ "$me" = 0 ] && command -v setpriv >/dev/null; then
  out=$(nobody $ctl --socket "$sock" metrics 2>&1) && fail "uid 65534 got the metrics"
  grep -q "PERMISSION_DENIED" <<<"$out" || fail "65534's metrics: $out"
fi

# stats --watch prints every interval, --iterations times.
n=$($ctl --socket "$sock" --watch 0.1 --iterations 3 stats | grep -c "^version ")
[ "$n" = 3 ] || fail "stats --watch 0.1 --iterations 3 printed $n times"
$ctl --socket "$sock" --watch 0.1 health >/dev/null 2>&1 && fail "--watch accepted with health"

# close: another uid cannot close root's session (it cannot see it); root closes it; the
# holder's session is then gone, and a bad id is refused.
if [ "$me" = 0 ] && command -v setpriv >/dev/null; then
  out=$(nobody $ctl --socket "$sock" close "$sid" 2>&1) && fail "uid 65534 closed root's session"
  grep -q "NOT_FOUND" <<<"$out" || fail "65534's close: $out"
fi
$ctl --socket "$sock" close "$sid" | grep -q "closed session $sid" || fail "close"
$ctl --socket "$sock" sessions | grep -Eq "^$sid +holder" && fail "the closed session is listed"
$ctl --socket "$sock" close "$sid" >/dev/null 2>&1 && fail "closing it twice succeeded"
$ctl --socket "$sock" close abc >/dev/null 2>&1 && fail "close abc accepted"

kill -TERM $dpid
wait $dpid || fail "daemon exit status $?"
dpid=

# --log_format json: every line of the daemon's log is one JSON object.
$daemon --socket "$dir/j.sock" --state_dir "$dir/state" --log_format json 2>"$dir/json.log" &
dpid=$!
for _ in $(seq 100); do [ -S "$dir/j.sock" ] && break; sleep 0.05; done
kill -TERM $dpid
wait $dpid || fail "json daemon exit status $?"
dpid=
/usr/bin/python3 - "$dir/json.log" <<'PY' || fail "json log: $(cat "$dir/json.log")"
import json, sys
lines = open(sys.argv[1]).read().splitlines()
assert len(lines) >= 3, lines
for l in lines:
    o = json.loads(l)
    assert set(o) == {"time", "level", "file", "line", "message"}, o
assert any(json.loads(l)["message"].startswith("stallfreed serving on unix:") for l in lines)
assert json.loads(lines[-1])["message"] == "stallfreed stopped", lines[-1]
PY
$daemon --log_format yaml >/dev/null 2>&1 && fail "--log_format yaml accepted"
echo PASS

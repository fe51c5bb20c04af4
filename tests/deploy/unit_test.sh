#!/usr/bin/env bash
# deploy/stallfreed.service: `systemd-analyze verify` finds nothing in it (with ExecStart pointed
# at the built stallfreed, since verify checks the executable), while a copy with one broken
# setting gets a complaint (so the check can fail); and the unit is what stallfreed expects:
# Type=notify with a watchdog, its socket inside its RuntimeDirectory, checkpoints in its
# StateDirectory.
set -euo pipefail
unit=deploy/stallfreed.service
daemon=$PWD/server/stallfreed
dir=$(mktemp -d /tmp/stallfree-unit-XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
command -v systemd-analyze >/dev/null || fail "systemd-analyze is missing (make deps installs systemd)"

sed "s|/usr/local/bin/stallfreed|$daemon|" "$unit" > "$dir/stallfreed.service"
out=$(systemd-analyze verify "$dir/stallfreed.service" 2>&1) || fail "verify failed: $out"
[ -z "$out" ] || fail "verify complained: $out"

sed 's|^Type=notify$|Type=notifyy|' "$dir/stallfreed.service" > "$dir/broken.service"
out=$(systemd-analyze verify "$dir/broken.service" 2>&1) || true
grep -q "Failed to parse service type" <<<"$out" || fail "a broken unit passed verify: $out"

grep -qx "Type=notify" "$unit" || fail "not Type=notify"
grep -Eqx "WatchdogSec=[0-9]+" "$unit" || fail "no WatchdogSec"
grep -qx "RuntimeDirectory=stallfree" "$unit" || fail "RuntimeDirectory"
grep -q -- "--socket /run/stallfree/stallfreed.sock" "$unit" || fail "the socket is not in /run/stallfree"
grep -qx "StateDirectory=stallfree" "$unit" || fail "StateDirectory"
grep -qx "NoNewPrivileges=yes" "$unit" || fail "NoNewPrivileges"
grep -qx "ProtectSystem=strict" "$unit" || fail "ProtectSystem=strict"
grep -q -- "--metrics_address 127.0.0.1:9464" "$unit" || fail "the unit does not turn metrics on"
# Every flag in ExecStart is one stallfreed knows.
for f in $(sed -n '/^ExecStart=/,/[^\\]$/p' "$unit" | grep -o -- '--[a-z_]*'); do
  "$daemon" --help 2>&1 | grep -q -- "$f" || fail "ExecStart uses $f, which stallfreed does not know"
done
echo PASS

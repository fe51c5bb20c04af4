#!/usr/bin/env python3
"""stallfreed's Prometheus endpoint against the real tools (run from the runfiles root):

1. a daemon with --metrics_address 127.0.0.1:0 serves /metrics; `promtool check metrics` finds
   no problem in a scrape taken while a session is open and after a trainer ran;
2. the numbers are the daemon's: the push counter equals GetStats' (stallfreectl), the update
   histogram counted the trainer's updates, a session's series appear while it is open and go
   when it is reclaimed, a refused request is counted by method and code;
3. a real Prometheus server (Debian's, on loopback, 1 s scrape interval, a temporary storage
   directory) scrapes the daemon while a trainer runs, and a query through its HTTP API returns
   the push counter that the daemon reports.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

DAEMON = "server/stallfreed"
CTL = "client/stallfreectl"
TRAINER = "trainer/trainer"
HOLDER = "testing/session_holder"


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def value(text, series):
    """The value of one series line (name{labels} exactly as rendered), or None."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def wait_for(pred, seconds, what):
    end = time.time() + seconds
    while time.time() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    fail("timed out waiting for " + what)


def main():
    tmp = tempfile.mkdtemp(prefix="stallfree-metrics-")
    procs = []
    try:
        sock = os.path.join(tmp, "d.sock")
        log = open(os.path.join(tmp, "daemon.log"), "w")
        daemon = subprocess.Popen([DAEMON, "--socket", sock, "--state_dir", tmp + "/state",
                                   "--metrics_address", "127.0.0.1:0", "--threads", "2"],
                                  stderr=log)
        procs.append(daemon)

        def port():
            m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics",
                          open(log.name).read())
            return m and int(m.group(1))
        url = "http://127.0.0.1:%d/metrics" % wait_for(port, 20, "the metrics line in the log")

        # 1-2: a session open; a refused request; a trainer run.
        holder = subprocess.Popen([HOLDER, sock, "1000"], stdout=subprocess.PIPE, text=True)
        procs.append(holder)
        ready = holder.stdout.readline().split()
        if not ready or ready[0] != "ready":
            fail("session_holder did not start: %r" % ready)
        sid = ready[1]
        r = subprocess.run([CTL, "--socket", sock, "delete-checkpoint", "nothing"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            fail("deleting a missing checkpoint succeeded")
        run = subprocess.run([TRAINER, "--preset", "tiny", "--quiet", "--steps", "12",
                              "--socket", sock, "--out_dir", tmp + "/run1", "--eval_every", "0"],
                             capture_output=True, text=True)
        if run.returncode != 0:
            fail("trainer: " + run.stdout + run.stderr)
        text = get(url)
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                              text=True)
        if lint.returncode != 0 or lint.stdout.strip() or lint.stderr.strip():
            fail("promtool check metrics: %s%s" % (lint.stdout, lint.stderr))
        stats = json.loads(subprocess.run([CTL, "--socket", sock, "-o", "json", "stats"],
                                          capture_output=True, text=True, check=True).stdout)
        pushes = value(text, "stallfree_pushes_total")
        if pushes is None or pushes <= 0 or pushes != float(stats["pushes"]):
            fail("stallfree_pushes_total %r, GetStats says %r" % (pushes, stats["pushes"]))
        updates = value(text, "stallfree_update_duration_seconds_count")
        if updates is None or updates != float(stats["updates"]) or updates <= 0:
            fail("update histogram count %r, GetStats updates %r" % (updates, stats["updates"]))
        holder_series = ('stallfree_session_pinned_bytes{session="%s",name="holder",rank="7"}'
                         % sid)
        if not value(text, holder_series):
            fail("no series for the open session: " + holder_series)
        refused = ('stallfree_rejected_requests_total{method="DeleteCheckpoint",'
                   'code="NOT_FOUND"}')
        if value(text, refused) != 1:
            fail("the refused DeleteCheckpoint is not counted once: %r" % value(text, refused))
        if value(text, "stallfree_build_info{version=\"stallfreed 0.1.0\",optimizer_kernel=\"%s\"}"
                 % re.search(r'optimizer_kernel="([^"]+)"', text).group(1)) != 1:
            fail("stallfree_build_info")
        for name in ("process_resident_memory_bytes", "process_open_fds",
                     "stallfree_process_threads", "stallfree_pinned_bytes"):
            if not value(text, name):
                fail(name + " missing or zero")
        # The session's series go with it.
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        wait_for(lambda: value(get(url), holder_series) is None, 20,
                 "the reclaimed session's series to go")

        # 3: a real Prometheus scrapes it while a trainer runs.
        prom_port = free_port()
        cfg = os.path.join(tmp, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: stallfreed\n    static_configs:\n"
                    "      - targets: ['127.0.0.1:%d']\n" % int(url.split(":")[2].split("/")[0]))
        prom = subprocess.Popen(["prometheus", "--config.file=" + cfg,
                                 "--storage.tsdb.path=" + tmp + "/tsdb",
                                 "--web.listen-address=127.0.0.1:%d" % prom_port,
                                 "--log.level=warn"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp + "/prom.log", "w"))
        procs.append(prom)
        run = subprocess.run([TRAINER, "--preset", "tiny", "--quiet", "--steps", "24",
                              "--socket", sock, "--out_dir", tmp + "/run2", "--eval_every", "0"],
                             capture_output=True, text=True)
        if run.returncode != 0:
            fail("trainer: " + run.stdout + run.stderr)
        want = value(get(url), "stallfree_pushes_total")
        api = ("http://127.0.0.1:%d/api/v1/query?query=" % prom_port +
               urllib.parse.quote('stallfree_pushes_total{job="stallfreed"}'))

        def scraped():
            try:
                res = json.loads(get(api))["data"]["result"]
            except Exception:
                return None
            return res and float(res[0]["value"][1]) == want
        wait_for(scraped, 60, "Prometheus to report stallfree_pushes_total = %g" % want)
        print("PASS: promtool clean; Prometheus reports stallfree_pushes_total %g" % want)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

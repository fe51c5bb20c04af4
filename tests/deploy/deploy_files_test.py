#!/usr/bin/env python3
"""deploy/Containerfile and deploy/kubernetes/stallfreed-daemonset.yaml against the daemon they
deploy (run from the runfiles root): both parse, every flag they pass is one stallfreed knows,
and they agree with each other and with it on the socket path, the metrics port, the state
directory and the user; the trainer pod mounts the daemon's socket directory; the image installs
every Debian library stallfreed and stallfreectl link that debian:12-slim lacks."""
import json
import re
import subprocess
import sys

import yaml

DAEMON = "server/stallfreed"
CTL = "client/stallfreectl"
# Packages debian:12-slim already has (its apt and dpkg pull them in).
BASE = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g", "liblzma5", "libzstd1", "liblz4-1",
        "libcap2", "libgcrypt20", "libgpg-error0", "libsystemd0", "libseccomp2", "libselinux1"}
failures = []


def check(ok, msg):
    if not ok:
        failures.append(msg)


def flags_of(args):
    """--name value pairs of an argument list."""
    out = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            out[a[2:]] = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
    return out


def main():
    known = set(re.findall(r"--([a-z_]+)", subprocess.run([DAEMON, "--help"], capture_output=True,
                                                          text=True).stdout + subprocess.run(
        [DAEMON, "--help"], capture_output=True, text=True).stderr))
    check("socket" in known and "metrics_address" in known, "stallfreed --help lists no flags")

    # The DaemonSet and the trainer pod.
    docs = list(yaml.safe_load_all(open("deploy/kubernetes/stallfreed-daemonset.yaml")))
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = next(d for d in docs if d["kind"] == "Pod")
    spec = ds["spec"]["template"]["spec"]
    c = spec["containers"][0]
    f = flags_of(c["args"])
    for name in f:
        check(name in known, "the DaemonSet passes --%s, which stallfreed does not know" % name)
    sock = f.get("socket", "")
    sock_dir = sock.rsplit("/", 1)[0]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    check(sock_dir in mounts and "hostPath" in vols[mounts[sock_dir]],
          "the socket directory %s is not a hostPath mount" % sock_dir)
    check(f.get("state_dir") in mounts, "the state directory is not mounted")
    port = f.get("metrics_address", ":").rsplit(":", 1)[1]
    check(port.isdigit(), "no metrics port")
    check(any(str(p["containerPort"]) == port for p in c["ports"]), "containerPort != " + port)
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    check(ann.get("prometheus.io/port") == port and ann.get("prometheus.io/scrape") == "true",
          "scrape annotations do not point at port %s" % port)
    check(spec.get("hostPID") is True, "hostPID (the fd hand-off's pid check) is not set")
    check("IPC_LOCK" in c["securityContext"]["capabilities"]["add"], "no IPC_LOCK for mlock")
    for probe in ("readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        check(cmd[-1] == "health" and flags_of(cmd).get("socket") == sock,
              "%s does not run stallfreectl health on %s: %s" % (probe, sock, cmd))
    check("requests" in c["resources"], "no resource requests")
    pc = pod["spec"]["containers"][0]
    pmounts = {m["mountPath"]: m["name"] for m in pc["volumeMounts"]}
    pvols = {v["name"]: v for v in pod["spec"]["volumes"]}
    check(sock_dir in pmounts and pvols[pmounts[sock_dir]]["hostPath"]["path"] ==
          vols[mounts[sock_dir]]["hostPath"]["path"],
          "the trainer pod does not mount the daemon's socket directory")
    env = {e["name"]: e["value"] for e in pc.get("env", [])}
    check(env.get("STALLFREE_SOCKET") == sock, "the trainer's STALLFREE_SOCKET is not " + sock)

    # The Containerfile.
    text = open("deploy/Containerfile").read().replace("\\\n", " ")
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    inst = {}
    for l in lines:
        key, _, rest = l.partition(" ")
        inst.setdefault(key, []).append(rest.strip())
    check(inst.get("FROM") == ["debian:12-slim"], "not FROM debian:12-slim")
    cmd = json.loads(inst["CMD"][0])
    cf = flags_of(cmd)
    for name in cf:
        check(name in known, "the Containerfile passes --%s, which stallfreed does not know" % name)
    check(cf.get("socket") == sock, "Containerfile socket %s != DaemonSet %s" % (cf.get("socket"), sock))
    check(cf.get("state_dir") == f.get("state_dir"), "state directories differ")
    check(cf.get("metrics_address", ":").rsplit(":", 1)[1] == port, "metrics ports differ")
    volumes = json.loads(inst["VOLUME"][0])
    check(sock_dir in volumes and cf.get("state_dir") in volumes, "VOLUME lacks the directories")
    check(inst.get("EXPOSE") == [port], "EXPOSE is not " + port)
    health = inst["HEALTHCHECK"][0]
    check(("\"%s\"" % sock) in health and "\"health\"" in health, "HEALTHCHECK: " + health)
    user = inst["USER"][0]
    check(user != "root", "the image runs as root")
    uid = re.search(r"useradd .*--uid (\d+) .*%s" % user, text)
    check(uid and int(uid.group(1)) == c["securityContext"]["runAsUser"],
          "the image's user and the DaemonSet's runAsUser differ")
    apt = set(re.findall(r"\b(lib[a-z0-9+.\-]+)", " ".join(l for l in lines if "apt-get install" in l)))
    for binary in (DAEMON, CTL):
        ldd = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
        for lib in re.findall(r"=> (/\S+)", ldd):
            if "_solib" in lib or "bazel-out" in lib:
                continue  # stallfree's own (linked in by build-image.sh's --dynamic_mode=off)
            owner = subprocess.run(["dpkg", "-S", subprocess.run(["readlink", "-f", lib],
                                                                 capture_output=True,
                                                                 text=True).stdout.strip()],
                                   capture_output=True, text=True).stdout.split(":")[0]
            if owner and owner not in BASE:
                check(owner in apt, "%s links %s (Debian package %s), which the image does not "
                      "install" % (binary, lib, owner))
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()

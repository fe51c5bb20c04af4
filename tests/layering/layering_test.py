"""The project's layers, checked: which top-level directory may include from or depend on which.

Every source file's #include "dir/..." and every BUILD file's //dir labels must name a layer
its own layer may use (LAYERS below, the map the README's "Layout" section describes). Bazel
visibility states the same for BUILD edges (each package's default_visibility); this test also
catches an include that no BUILD edge backs, and headers that must stay free of the transport
(the engine's: no gRPC or protobuf). It first proves it can fail: a forbidden include and a
forbidden label in a scratch tree must be reported.

Run by Bazel with every layer's sources as data, or by hand: python3 layering_test.py [ROOT].
"""
import os
import re
import sys
import tempfile

# layer -> what it may use besides itself, common/ and third_party/ (a directory, or one file or
# Bazel target of it). proto is offload.proto's generated code ("stallfree/v1/...").
LAYERS = {
    "common": set(),
    "proto": set(),
    "kernels": set(),
    # The engine uses a backend's memory and optimizer kernels, never the math ops (BLAS).
    "engine": {"kernels/memory.h", "kernels/optimizer.h", "//kernels:memory",
               "//kernels:optimizer"},
    "client": {"proto", "engine/offload_target.h", "//engine:offload_target"},
    "server": {"proto", "kernels"},
    "parallel": {"kernels"},
    "trainer": {"kernels", "engine", "client", "parallel"},
    "python": {"kernels", "engine", "client", "//server:stallfreed"},
    "testing": {"proto", "client", "//server:stallfreed"},
    "bench": {"proto", "kernels", "engine", "client", "server", "parallel", "trainer",
              "testing"},
    "examples": set(),
    "deploy": {"//server:stallfreed", "//client:stallfreectl"},
}
ALWAYS = {"common", "third_party"}
# Includes a layer must not have at all (the transport stays out of the engine and below it).
TRANSPORT = re.compile(r'#include\s*[<"](grpc|grpcpp|google/protobuf|stallfree/v1)/')
TRANSPORT_FREE = ("common", "kernels", "engine")

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
# A Python file outside tests/ reaching into tests/ for code (sys.path or an import).
PY_TESTS = re.compile(r'^.*(sys\.path.*["\']tests\b|^\s*(from|import)\s+tests\b).*$', re.M)
LABEL = re.compile(r'"//([a-z_]+)(/[^:"]*)?(:[^"]*)?"')
SOURCE_EXT = (".h", ".cc", ".cu", ".cuh")


def allowed(layer, used, exact):
    """Whether `layer` may use `used` (a top-level directory) through `exact` (the included
    path, or the Bazel label)."""
    if used == layer or used in ALWAYS:
        return True
    rules = LAYERS[layer]
    return used in rules or exact in rules


def include_layer(path):
    """The layer an #include names: a project directory, "proto" for offload.proto's generated
    code, or None for a system or third-party header (absl/, gloo/, pybind11/ ...)."""
    if path.startswith("stallfree/v1/"):
        return "proto"
    first = path.split("/", 1)[0]
    return first if first in LAYERS or first in ("tests", "third_party") else None


def violations(root, checked=None):
    """The forbidden edges under root; `checked` (a dict) gets each layer's count of files read."""
    out = []
    checked = {} if checked is None else checked
    for layer in LAYERS:
        checked.setdefault(layer, 0)
        top = os.path.join(root, layer)
        for dirpath, _, files in os.walk(top):
            for f in files:
                full = os.path.join(dirpath, f)
                rel = os.path.relpath(full, root)
                if f.endswith(SOURCE_EXT + (".py",)) or f == "BUILD":
                    checked[layer] += 1
                if f.endswith(SOURCE_EXT):
                    text = open(full, encoding="utf-8", errors="replace").read()
                    for inc in INCLUDE.findall(text):
                        used = include_layer(inc)
                        if used is not None and not allowed(layer, used, inc):
                            out.append("%s includes %s: %s may not use %s" %
                                       (rel, inc, layer, used))
                    if layer in TRANSPORT_FREE and TRANSPORT.search(text):
                        out.append("%s includes %s: %s stays free of gRPC and protobuf" %
                                   (rel, TRANSPORT.search(text).group(0), layer))
                elif f.endswith(".py"):
                    text = open(full, encoding="utf-8", errors="replace").read()
                    for m in PY_TESTS.finditer(text):
                        out.append("%s reaches into tests/: %s" % (rel, m.group(0).strip()))
                elif f == "BUILD":
                    text = open(full, encoding="utf-8").read()
                    for m in LABEL.finditer(text):
                        used, label = m.group(1), m.group(0).strip('"')
                        if used in ("visibility", "conditions") or "__" in label:
                            continue  # visibility specs, not dependencies
                        if not allowed(layer, used, label):
                            out.append("%s names %s: %s may not depend on %s" %
                                       (rel, label, layer, used))
    return out


def self_check():
    """A scratch tree with forbidden includes (the engine on the math ops, the kernels on the
    engine), a transport include and a forbidden label: all must be reported (the check is not
    vacuous)."""
    with tempfile.TemporaryDirectory() as d:
        for layer in ("engine", "kernels", "client"):
            os.makedirs(os.path.join(d, layer))
        with open(os.path.join(d, "kernels", "k.h"), "w") as f:
            f.write('#include "common/log.h"\n#include "engine/zenflow.h"\n')
        with open(os.path.join(d, "engine", "e.h"), "w") as f:
            f.write('#include "kernels/ops.h"\n#include "stallfree/v1/offload.pb.h"\n')
        with open(os.path.join(d, "client", "tool.py"), "w") as f:
            f.write('import sys\nsys.path.insert(0, str(REPO / "tests" / "python"))\n')
        with open(os.path.join(d, "client", "BUILD"), "w") as f:
            f.write('cc_library(name = "c", deps = ["//engine:offload_target", "//engine"])\n')
        got = violations(d)
        want = ["kernels/k.h includes engine/zenflow.h", "engine/e.h includes kernels/ops.h",
                "engine/e.h includes stallfree/v1/", "client/BUILD names //engine:",
                "client/tool.py reaches into tests/"]
        for w in want:
            assert any(g.startswith(w) for g in got), (w, got)
        assert len(got) == 6, got  # e.h's proto include is also a transport include


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LAYERING_ROOT", ".")
    self_check()
    if not os.path.isdir(os.path.join(root, "engine")):
        print("layering_test: no engine/ under %s (run from the repository root)" % root)
        return 1
    checked = {}
    bad = violations(root, checked)
    # Every built layer must have been read: a check that saw no files would pass vacuously.
    for layer in ("bench", "client", "common", "engine", "kernels", "parallel", "proto",
                  "python", "server", "testing", "trainer"):
        if checked.get(layer, 0) == 0:
            bad.append("%s: no files read (its :layer_sources missing from the data?)" % layer)
    for b in bad:
        print("FORBIDDEN EDGE:", b)
    print("layering_test: %d files in %d layers checked, %d forbidden edges"
          % (sum(checked.values()), len(LAYERS), len(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

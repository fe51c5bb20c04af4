#!/usr/bin/env python3
"""Writes a wheel (PEP 427) of an assembled package directory; standard library only.

    build_wheel.py --package-dir bazel-bin/python/stallfree --out-dir DIR --name stallfree \
        --python-tag cp311 --abi-tag cp311 --platform-tag linux_x86_64 \
        --executable stallfreed --console-script stallfreed=stallfree.daemon:stallfreed_main ...

The //python:wheel rule (python/package.bzl) runs it on //python:stallfree_package, the same
tree `PYTHONPATH=bazel-bin/python` imports, so the wheel holds exactly those files: the .py
sources (0644), the extension and the --executable binaries (0755: pip keeps the bit). It adds
the .dist-info: METADATA (the version is `__version__` of the package's __init__.py, read
without importing it), WHEEL, entry_points.txt, top_level.txt and RECORD (sha256 of every
file). The zip is reproducible: sorted entries, fixed timestamps, so the same inputs give the
same bytes (Bazel's cache and `sha256sum dist/*.whl` agree across builds).

--version-stamp BINARY=TEXT ({version} in TEXT) fails the build unless the shipped BINARY
contains TEXT: the daemon reports its version by a literal ("stallfreed 0.1.0"), which must not
drift from the package's.
"""

import argparse
import ast
import base64
import hashlib
import io
import os
import re
import sys
import zipfile

_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can hold


def _literal(path, name):
    """The value of the top-level `name = <literal>` in the Python file at `path`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    sys.exit("build_wheel: %s has no top-level %s = <literal>" % (path, name))


def _record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def _metadata(a, version, runtime_packages):
    lines = ["Metadata-Version: 2.1", "Name: " + a.name, "Version: " + version,
             "Summary: " + a.summary]
    if a.requires_python:
        lines.append("Requires-Python: " + a.requires_python)
    for extra in a.provides_extra:
        lines.append("Provides-Extra: " + extra)
    for req in a.requires_dist:
        lines.append("Requires-Dist: " + req)
    lines.append("Description-Content-Type: text/markdown")
    whl = "%s-%s-%s-%s-%s.whl" % (_dist_name(a.name), version, a.python_tag, a.abi_tag,
                                  a.platform_tag)
    body = [
        "# %s %s" % (a.name, version), "",
        a.summary, "",
        "    pip install %s            # the core: Daemon, Error, the binaries" % whl,
        "    pip install '%s[torch]'   # and stallfree.torch.ZenFlowAdamW" % whl, "",
        "Start the daemon with `python -m stallfree.daemon [flags]` or the `stallfreed` console "
        "script; `stallfreectl` is the admin CLI.", "",
        "The extension and the binaries link against Debian 12's system libraries; install "
        "them with:", "",
        "    sudo apt-get install " + " ".join(runtime_packages), "",
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(body)


def _dist_name(name):
    return re.sub(r"[-_.]+", "_", name)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--package-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--summary", default="")
    p.add_argument("--python-tag", required=True)
    p.add_argument("--abi-tag", required=True)
    p.add_argument("--platform-tag", required=True)
    p.add_argument("--requires-python", default="")
    p.add_argument("--requires-dist", action="append", default=[])
    p.add_argument("--provides-extra", action="append", default=[])
    p.add_argument("--executable", action="append", default=[],
                   help="a file of the package to install with mode 0755")
    p.add_argument("--console-script", action="append", default=[], help="NAME=module:function")
    p.add_argument("--version-stamp", action="append", default=[], help="BINARY=TEXT")
    p.add_argument("--runtime-packages-from", default="",
                   help="a module of the package whose RUNTIME_PACKAGES (the Debian packages "
                        "needed at run time) the description lists")
    a = p.parse_args()

    pkg = os.path.basename(os.path.normpath(a.package_dir))
    version = _literal(os.path.join(a.package_dir, "__init__.py"), "__version__")
    if not re.fullmatch(r"\d+(\.\d+)*([ab]|rc)?\d*(\.post\d+)?(\.dev\d+)?", version):
        sys.exit("build_wheel: __version__ %r is not a PEP 440 release version" % version)
    runtime_packages = ()
    if a.runtime_packages_from:
        runtime_packages = _literal(os.path.join(a.package_dir, a.runtime_packages_from),
                                    "RUNTIME_PACKAGES")

    # The package's files, as the wheel will hold them.
    files = {}  # archive name -> (bytes, mode)
    for root, dirs, names in os.walk(a.package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for n in sorted(names):
            if n.endswith(".pyc"):
                continue
            path = os.path.join(root, n)
            rel = os.path.relpath(path, a.package_dir)
            with open(path, "rb") as f:
                data = f.read()
            executable = rel in a.executable or n.endswith(".so")
            files["%s/%s" % (pkg, rel)] = (data, 0o755 if executable else 0o644)
    for e in a.executable:
        if "%s/%s" % (pkg, e) not in files:
            sys.exit("build_wheel: --executable %s is not in %s" % (e, a.package_dir))
    for stamp in a.version_stamp:
        binary, _, text = stamp.partition("=")
        want = text.format(version=version).encode()
        data = files.get("%s/%s" % (pkg, binary), (None,))[0]
        if data is None:
            sys.exit("build_wheel: --version-stamp %s: no such file in the package" % binary)
        if want not in data:
            prefix = re.escape(text.split("{version}")[0].encode())
            found = sorted(set(m.group(0).decode("ascii", "replace")
                               for m in re.finditer(prefix + rb"[0-9][0-9A-Za-z.+-]*", data)))
            sys.exit("build_wheel: %s reports %s, not %r: the package's __version__ (%s, in "
                     "%s/__init__.py) and the binary's version literal must agree"
                     % (binary, found or "no version", want.decode(), version, pkg))

    dist = _dist_name(a.name)
    info = "%s-%s.dist-info" % (dist, version)
    tag = "%s-%s-%s" % (a.python_tag, a.abi_tag, a.platform_tag)
    scripts = sorted(a.console_script)
    meta = {
        "METADATA": _metadata(a, version, runtime_packages),
        "WHEEL": "Wheel-Version: 1.0\nGenerator: stallfree python/build_wheel.py\n"
                 "Root-Is-Purelib: false\nTag: %s\n" % tag,
        "top_level.txt": pkg + "\n",
    }
    if scripts:
        meta["entry_points.txt"] = "[console_scripts]\n" + "".join(
            "%s = %s\n" % tuple(s.split("=", 1)) for s in scripts)
    for n, text in meta.items():
        files["%s/%s" % (info, n)] = (text.encode("utf-8"), 0o644)
    record_name = "%s/RECORD" % info
    record = "".join("%s,%s,%d\n" % (n, _record_hash(d), len(d))
                     for n, (d, _) in sorted(files.items()))
    record += "%s,,\n" % record_name
    files[record_name] = (record.encode("utf-8"), 0o644)

    # The package first, the .dist-info last (RECORD at the very end), as PEP 427 recommends.
    order = sorted(n for n in files if not n.startswith(info + "/"))
    order += sorted(n for n in files if n.startswith(info + "/") and n != record_name)
    order.append(record_name)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for n in order:
            data, mode = files[n]
            zi = zipfile.ZipInfo(n, date_time=_EPOCH)
            zi.create_system = 3  # unix: external_attr carries the mode, which pip applies
            zi.external_attr = (0o100000 | mode) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data, compresslevel=6)

    os.makedirs(a.out_dir, exist_ok=True)
    out = os.path.join(a.out_dir, "%s-%s-%s.whl" % (dist, version, tag))
    with open(out + ".tmp", "wb") as f:
        f.write(buf.getvalue())
    os.replace(out + ".tmp", out)
    print("build_wheel: %s (%d files, %d bytes)" % (out, len(files), len(buf.getvalue())))


if __name__ == "__main__":
    main()

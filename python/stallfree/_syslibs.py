"""The Debian packages behind the shared libraries stallfree's extension and binaries load.

The wheel does not bundle gRPC, protobuf, abseil, oneTBB, OpenBLAS, civetweb or libsystemd: the
extension (_stallfree.so), stallfreed and stallfreectl link against Debian 12's own. When one is
missing, the dynamic loader says only "libgrpc++.so.1.51: cannot open shared object file";
`missing_library_error` turns that into the package to install and the `apt-get install` line.

This module imports nothing of the package (it runs before the extension loads), and
python/build_wheel.py reads RUNTIME_PACKAGES from it for the wheel's description.

How the table was made: `ldd` of _stallfree.so, stallfreed and stallfreectl, then `dpkg -S` of
each library (Debian 12 "bookworm"). tests/python/test_wheel.py checks it against the installed
wheel's binaries on every run (every library they load maps to the package dpkg names, and
RUNTIME_PACKAGES is exactly the packages of their direct dependencies).
"""

import os
import re

# What `apt-get install` needs for stallfree to run: the packages of the libraries the
# extension and the two binaries name directly (DT_NEEDED), less libc6 / libstdc++6 /
# libgcc-s1, which every Debian system has. Their own dependencies come with them.
RUNTIME_PACKAGES = (
    "libgrpc++1.51",
    "libgrpc29",
    "libprotobuf32",
    "libabsl20220623",
    "libtbb12",
    "libcivetweb1",
    "libsystemd0",
    "libssl3",
)

# soname -> Debian package, for every library the three load (directly or not).
PACKAGE_OF = {
    "libgrpc++.so.1.51": "libgrpc++1.51",
    "libgrpc.so.29": "libgrpc29",
    "libgpr.so.29": "libgrpc29",
    "libupb.so.29": "libgrpc29",
    "libaddress_sorting.so.29": "libgrpc29",
    "libprotobuf.so.32": "libprotobuf32",
    "libtbb.so.12": "libtbb12",
    "libcivetweb.so.1": "libcivetweb1",
    "libsystemd.so.0": "libsystemd0",
    "libcap.so.2": "libcap2",
    "libgcrypt.so.20": "libgcrypt20",
    "libgpg-error.so.0": "libgpg-error0",
    "liblzma.so.5": "liblzma5",
    "libzstd.so.1": "libzstd1",
    "liblz4.so.1": "liblz4-1",
    "libcares.so.2": "libc-ares2",
    "libssl.so.3": "libssl3",
    "libcrypto.so.3": "libssl3",
    "libre2.so.9": "libre2-9",
    "libz.so.1": "zlib1g",
    "libstdc++.so.6": "libstdc++6",
    "libgcc_s.so.1": "libgcc-s1",
    "libc.so.6": "libc6",
    "libm.so.6": "libc6",
}

# Every abseil library of the LTS 2022-06-23 (about 40 sonames) is in one package.
_ABSL = re.compile(r"^libabsl_\w+\.so\.20220623$")

_MISSING = re.compile(r"([^\s:]+): cannot open shared object file")


def package_of(soname):
    """The Debian package holding `soname` (a file name, or a path to one), or None."""
    soname = os.path.basename(soname)
    if soname in PACKAGE_OF:
        return PACKAGE_OF[soname]
    if _ABSL.match(soname):
        return "libabsl20220623"
    return None


def apt_line(first=None):
    """`sudo apt-get install ...` for everything stallfree needs, `first` (a package) first."""
    pkgs = [first] if first else []
    pkgs += [p for p in RUNTIME_PACKAGES if p != first]
    return "sudo apt-get install " + " ".join(pkgs)


def missing_library_hint(message):
    """For a loader message naming a missing library ("libtbb.so.12: cannot open shared object
    file: ..."): a sentence naming its Debian package and the apt-get line; else None."""
    m = _MISSING.search(message or "")
    if not m:
        return None
    soname = os.path.basename(m.group(1))
    pkg = package_of(soname)
    if pkg:
        what = "the system library %s is missing; it is in the Debian package %s" % (soname, pkg)
    else:
        what = ("the system library %s is missing (not one this table knows: find its package "
                "with `apt-file search %s`)" % (soname, soname))
    return ("%s. stallfree's extension and binaries use Debian 12's gRPC, protobuf, abseil, "
            "oneTBB, OpenBLAS, civetweb and libsystemd; install them with:\n    %s"
            % (what, apt_line(pkg)))


def missing_library_error(exc, what="its extension stallfree._stallfree"):
    """An ImportError naming the package to install for `exc`, the ImportError of a module that
    could not load a shared library; None when `exc` is some other failure."""
    hint = missing_library_hint(str(exc))
    if hint is None:
        return None
    return ImportError("stallfree cannot load %s (%s): %s" % (what, exc, hint),
                       name=getattr(exc, "name", None), path=getattr(exc, "path", None))

"""The wheel as users get it: `pip install` into a fresh virtual environment, then everything
runs from there, in processes whose sys.path holds neither bazel-bin nor this checkout.

- The wheel itself: the package's files (the same bytes as the Bazel-assembled package), the
  binaries and the extension 0755, a RECORD whose sha256 match, METADATA whose version is the
  package's __version__ and whose only requirements are behind the `torch` extra.
- Installed without torch (pip --no-index --no-deps: nothing is downloaded): `import stallfree`
  comes from the new site-packages; stallfree.Daemon() starts the shipped stallfreed and the
  `stallfreectl` console script's `stats` answers with "stallfreed <__version__>";
  `import stallfree.torch` fails only for want of torch.
- `python -m stallfree.daemon --help` and the `stallfreed` / `stallfreectl` console scripts;
  `python -m stallfree.daemon --socket ...` runs the daemon (exec: the same pid is stallfreed)
  until SIGTERM, exit status 0.
- With the project's torch made visible (a .pth naming its site-packages): ZenFlowAdamW in
  sync-offload mode, fp32, matches torch.optim.AdamW on a small model.
- A missing system library: a real dynamic-loader failure (a copy of _stallfree.so whose one
  DT_NEEDED entry names a path that does not exist) and the loader's exact message for a
  missing libgrpc++ both give an ImportError naming the Debian package and the apt-get line;
  a stallfreed that cannot load gives a Daemon error with the same; and the table of
  stallfree/_syslibs.py covers every library the installed binaries load, as dpkg names them.
- `pip uninstall` removes every file (RECORD is complete).

The wheel: $STALLFREE_WHEEL, else //python:wheel in the test's runfiles, else
bazel-bin/python/wheel/ or dist/ of the checkout (`make wheel`).
"""
import base64
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the runfiles root under Bazel, else the checkout
BINARIES = ("stallfreed", "stallfreectl")
# The pip of the interpreter running this test (.venv's), ignoring pip.conf and $PIP_*.
PIP = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "--no-input"]


def find_wheel():
    env = os.environ.get("STALLFREE_WHEEL")
    if env:
        return env
    for pattern in ("python/wheel/stallfree-*.whl", "bazel-bin/python/wheel/stallfree-*.whl",
                    "dist/stallfree-*.whl"):
        found = sorted(glob.glob(os.path.join(ROOT, pattern)))
        if len(found) > 1:
            pytest.fail("more than one wheel: %s" % found)
        if found:
            return found[0]
    pytest.fail("no stallfree wheel: run `make wheel` (or `bazel build //python:wheel`), or set "
                "STALLFREE_WHEEL")


WHEEL = find_wheel()


def source_version():
    """__version__ of the package next to this test (runfiles or checkout), or None."""
    path = os.path.join(ROOT, "python", "stallfree", "__init__.py")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        m = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    return m and m.group(1)


def clean_env(**extra):
    """This environment less everything that points Python or stallfree elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "STALLFREE_")) and k != "VIRTUAL_ENV"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Venv:
    """A fresh virtual environment (Debian's python3.11 beneath .venv's) with the wheel in it."""

    def __init__(self, root):
        self.root = root
        self.bin = os.path.join(root, "bin")
        self.python = os.path.join(self.bin, "python")
        self.cwd = os.path.join(root, "work")
        os.makedirs(self.cwd)
        run([sys.executable, "-m", "venv", "--without-pip", root])
        self.site = self.run_py("import sysconfig; print(sysconfig.get_paths()['platlib'])"
                                ).stdout.strip()
        run(PIP + ["--python", self.python, "install", "--no-index", "--no-deps", WHEEL])

    def run(self, cmd, timeout=60, check=True, env=None, **kw):
        return run(cmd, timeout=timeout, check=check, cwd=self.cwd,
                   env=env or clean_env(), **kw)

    def run_py(self, source, *args, **kw):
        return self.run([self.python, "-c", source] + list(args), **kw)


def run(cmd, timeout=120, check=True, **kw):
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, **kw)
    if check and proc.returncode != 0:
        pytest.fail("%s exited %d\n--- stdout\n%s\n--- stderr\n%s"
                    % (cmd, proc.returncode, proc.stdout, proc.stderr))
    return proc


@pytest.fixture(scope="module")
def venv():
    # Under /tmp, not Bazel's TEST_TMPDIR: nothing of its path looks like Bazel's.
    root = tempfile.mkdtemp(prefix="sf-wheel-venv-", dir="/tmp")
    yield Venv(os.path.join(root, "venv"))
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def short_dir():
    """For unix socket paths (at most 107 bytes; TEST_TMPDIR can be longer)."""
    path = tempfile.mkdtemp(prefix="sf-wheel-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def load_syslibs(venv):
    """The installed stallfree/_syslibs.py, loaded on its own (it imports nothing of the
    package): the table the ImportError uses."""
    spec = importlib.util.spec_from_file_location(
        "installed_syslibs", os.path.join(venv.site, "stallfree", "_syslibs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def needed(path):
    """The DT_NEEDED entries of the ELF file at `path`."""
    out = run(["readelf", "-d", path]).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def break_needed(src, dst, missing):
    """Copies the ELF file `src` to `dst` with its longest DT_NEEDED entry replaced, in place in
    .dynstr, by "/no/such/dir/<missing>": the dynamic loader then fails on it for real, with its
    own message ("/no/such/dir/<missing>: cannot open shared object file: ...")."""
    longest = max(needed(src), key=len)
    fake = "/no/such/dir/" + missing
    assert len(fake) <= len(longest), (fake, longest)
    with open(src, "rb") as f:
        data = f.read()
    old = b"\0" + longest.encode() + b"\0"
    assert old in data, longest
    data = data.replace(old, b"\0" + fake.encode().ljust(len(longest), b"\0") + b"\0")
    with open(dst, "wb") as f:
        f.write(data)
    os.chmod(dst, 0o755)
    assert fake in needed(dst)


# --- the wheel file -------------------------------------------------------------------------

def test_wheel_file():
    name = os.path.basename(WHEEL)
    m = re.fullmatch(r"stallfree-([^-]+)-cp311-cp311-linux_x86_64\.whl", name)
    assert m, name
    version = m.group(1)
    if source_version() is not None:
        assert version == source_version(), "the wheel is stale: rebuild it (make wheel)"
    info = "stallfree-%s.dist-info" % version
    with zipfile.ZipFile(WHEEL) as z:
        names = z.namelist()
        expected = {"stallfree/" + n for n in ("__init__.py", "_daemon.py", "daemon.py",
                                                "_syslibs.py", "torch.py", "_partition.py",
                                                "_state.py", "_integrations.py", "dcp.py",
                                                "_torch_private.py",
                                                "_stallfree.so", "stallfreed", "stallfreectl")}
        assert expected <= set(names), sorted(expected - set(names))
        assert names[-1] == info + "/RECORD"
        # RECORD: every other file once, with its sha256 and size.
        rows = [r.rsplit(",", 2) for r in z.read(info + "/RECORD").decode().splitlines()]
        assert sorted(r[0] for r in rows) == sorted(names)
        for n, digest, size in rows:
            if n == info + "/RECORD":
                assert digest == size == ""
                continue
            data = z.read(n)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + want.decode() and int(size) == len(data), n
        # Modes: the binaries and the extension executable, the sources not.
        for n in names:
            mode = z.getinfo(n).external_attr >> 16 & 0o777
            exe = n.endswith(".so") or n.rsplit("/", 1)[-1] in BINARIES
            assert mode == (0o755 if exe else 0o644), (n, oct(mode))
        meta = z.read(info + "/METADATA").decode()
        wheel = z.read(info + "/WHEEL").decode()
        entry = z.read(info + "/entry_points.txt").decode()
        # The same files as the Bazel-assembled package (the wheel is built from it), when the
        # test has that package in its runfiles.
        pkg = os.path.join(ROOT, "python", "stallfree")
        if os.path.exists(os.path.join(pkg, "_stallfree.so")):
            for n in sorted(expected):
                with open(os.path.join(ROOT, "python", n), "rb") as f:
                    assert z.read(n) == f.read(), n
    assert "\nName: stallfree\n" in meta and "\nVersion: %s\n" % version in meta
    assert "Requires-Python: ==3.11.*" in meta
    requires = re.findall(r"^Requires-Dist: (.*)$", meta, re.M)
    assert any(r.startswith("torch>=2.1") for r in requires), requires
    assert all('extra == "torch"' in r for r in requires), requires  # the core needs none
    assert "Root-Is-Purelib: false" in wheel and "Tag: cp311-cp311-linux_x86_64" in wheel
    assert "stallfreed = stallfree.daemon:stallfreed_main" in entry
    assert "stallfreectl = stallfree.daemon:stallfreectl_main" in entry


# --- installed, without torch ---------------------------------------------------------------

CORE_CHILD = r"""
import importlib.metadata, importlib.util, json, os, subprocess, sys
out = {"sys_path": sys.path, "torch_found": importlib.util.find_spec("torch") is not None}
import stallfree
out.update(file=stallfree.__file__, version=stallfree.__version__,
           dist_version=importlib.metadata.version("stallfree"),
           stallfreed=stallfree.stallfreed_path(), stallfreectl=stallfree.stallfreectl_path())
with stallfree.Daemon(threads=1) as d:
    ctl = os.path.join(os.path.dirname(sys.executable), "stallfreectl")
    p = subprocess.run([ctl, "--socket", d.socket, "--o", "json", "stats"],
                       capture_output=True, text=True, timeout=30)
    out.update(stats_rc=p.returncode, stats=p.stdout, stats_err=p.stderr,
               daemon_exe=os.readlink("/proc/%d/exe" % d.pid))
try:
    import stallfree.torch
    out["torch_import"] = "ok"
except ImportError as e:
    out["torch_import"] = "%s: %s (name=%s)" % (type(e).__name__, e, e.name)
print(json.dumps(out))
"""


def assert_isolated(sys_path, venv, cwd):
    """No entry of a child's sys.path is Bazel's, and the only stallfree package it can see is
    the one installed in the new venv's site-packages."""
    for entry in sys_path:
        assert "bazel-bin" not in entry and "bazel-out" not in entry, (entry, sys_path)
        where = os.path.realpath(os.path.join(cwd, entry))
        if os.path.isdir(os.path.join(where, "stallfree")):
            assert where == os.path.realpath(venv.site), (entry, sys_path)


def test_installed_core_without_torch(venv):
    out = json.loads(venv.run_py(CORE_CHILD).stdout)
    assert_isolated(out["sys_path"], venv, venv.cwd)
    pkg = os.path.join(venv.site, "stallfree")
    assert out["file"] == os.path.join(pkg, "__init__.py")
    assert out["version"] == out["dist_version"]
    assert not out["torch_found"], "torch must not be visible in the bare venv"
    assert out["stallfreed"] == os.path.join(pkg, "stallfreed")
    assert out["stallfreectl"] == os.path.join(pkg, "stallfreectl")
    assert os.path.realpath(out["daemon_exe"]) == os.path.realpath(out["stallfreed"])
    assert out["stats_rc"] == 0, out["stats_err"]
    stats = json.loads(out["stats"])
    assert stats["version"] == "stallfreed " + out["version"], stats
    assert out["torch_import"].startswith("ModuleNotFoundError") and "name=torch" in \
        out["torch_import"], out["torch_import"]


def test_daemon_module_and_console_scripts(venv, short_dir):
    helps = {
        "python -m stallfree.daemon": [venv.python, "-m", "stallfree.daemon", "--help"],
        "stallfreed": [os.path.join(venv.bin, "stallfreed"), "--help"],
        "stallfreectl": [os.path.join(venv.bin, "stallfreectl"), "--help"],
    }
    for what, cmd in helps.items():
        p = venv.run(cmd)
        want = "admin CLI for stallfreed" if what == "stallfreectl" else "stallfree offload daemon"
        assert want in p.stdout + p.stderr and "--socket" in p.stdout + p.stderr, (what, p)

    # The daemon through `python -m stallfree.daemon`, driven by the stallfreectl script.
    sock = os.path.join(short_dir, "d.sock")
    ctl = [os.path.join(venv.bin, "stallfreectl"), "--socket", sock]
    log_path = os.path.join(short_dir, "log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [venv.python, "-m", "stallfree.daemon", "--socket", sock, "--state_dir",
             os.path.join(short_dir, "state"), "--threads", "1", "--log_level", "warning"],
            cwd=venv.cwd, env=clean_env(), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while venv.run(ctl + ["health"], check=False).returncode != 0:
            assert proc.poll() is None, open(log_path).read()
            assert time.monotonic() < deadline, "no answer within 30 s: " + open(log_path).read()
            time.sleep(0.1)
        # exec: the process python started is now stallfreed itself.
        exe = os.path.realpath("/proc/%d/exe" % proc.pid)
        assert exe == os.path.realpath(os.path.join(venv.site, "stallfree", "stallfreed"))
        stats = venv.run(ctl + ["stats"]).stdout
        version = venv.run_py("import stallfree; print(stallfree.__version__)").stdout.strip()
        assert re.search(r"^version\s+stallfreed %s$" % re.escape(version), stats, re.M), stats
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, open(log_path).read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- installed, with torch ------------------------------------------------------------------

TORCH_CHILD = r"""
import json, sys
import torch
import stallfree
from stallfree.torch import ZenFlowAdamW
torch.set_num_threads(1)

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))

ref, sf = model(), model()
init = [p.detach().clone() for p in sf.parameters()]
kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
losses = []
with stallfree.Daemon(threads=1) as d:
    opts = [torch.optim.AdamW(ref.parameters(), **kw),
            ZenFlowAdamW(sf.named_parameters(), mode="sync-offload", grad_dtype="fp32",
                         param_dtype="fp32", socket=d.socket, **kw)]
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(8, 16, generator=gen)
        y = torch.randint(0, 8, (8,), generator=gen)
        row = []
        for m, opt in zip((ref, sf), opts):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            row.append(loss.item())
        losses.append(row)
    opts[1].close()
diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), sf.parameters()))
moved = min((a - b).abs().max().item() for a, b in zip(sf.parameters(), init))
print(json.dumps(dict(sys_path=sys.path, stallfree=stallfree.__file__,
                      stallfree_torch=sys.modules["stallfree.torch"].__file__,
                      torch=torch.__file__, diff=diff, moved=moved, losses=losses)))
"""


def test_zenflow_adamw_from_wheel(venv):
    import torch  # this test's own (the project's .venv): made visible to the new venv
    torch_site = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    pth = os.path.join(venv.site, "zz_project_torch.pth")
    with open(pth, "w") as f:
        f.write(torch_site + "\n")
    try:
        out = json.loads(venv.run_py(TORCH_CHILD, timeout=120).stdout)
    finally:
        os.remove(pth)
    assert_isolated(out["sys_path"], venv, venv.cwd)
    assert out["stallfree"] == os.path.join(venv.site, "stallfree", "__init__.py")
    assert out["stallfree_torch"] == os.path.join(venv.site, "stallfree", "torch.py")
    assert out["torch"].startswith(torch_site)
    assert out["moved"] > 1e-4, out  # every parameter trained
    # The tolerance of test_adamw_equivalence (models.PARAM_ATOL: a few ulp through 6 steps).
    assert out["diff"] <= 1e-5, out
    for a, b in out["losses"]:
        assert abs(a - b) <= 1e-5 * abs(a), out["losses"]


# --- a missing system library ---------------------------------------------------------------

def test_missing_library_real_loader_failure(venv, tmp_path):
    """A copy of the installed package whose _stallfree.so needs a libgrpc++.so.1.51 that is
    nowhere: the real dlopen failure, turned into the Debian package and the apt-get line."""
    copy = tmp_path / "pkg"
    shutil.copytree(os.path.join(venv.site, "stallfree"), copy / "stallfree",
                    ignore=shutil.ignore_patterns("__pycache__"))
    so = str(copy / "stallfree" / "_stallfree.so")
    os.remove(so)
    break_needed(os.path.join(venv.site, "stallfree", "_stallfree.so"), so, "libgrpc++.so.1.51")
    p = venv.run_py("import stallfree", check=False, env=clean_env(PYTHONPATH=str(copy)))
    assert p.returncode != 0
    err = [line for line in p.stderr.splitlines()
           if line.startswith("ImportError: stallfree cannot load its extension")]
    assert len(err) == 1, p.stderr  # the one raised (the loader's own is its __cause__)
    assert "(/no/such/dir/libgrpc++.so.1.51: cannot open shared object file" in err[0], p.stderr
    assert "the Debian package libgrpc++1.51" in p.stderr, p.stderr
    assert re.search(r"^\s+sudo apt-get install libgrpc\+\+1\.51 .*libtbb12", p.stderr, re.M), \
        p.stderr


def test_missing_library_exact_loader_message(venv):
    """The loader's message as a machine without libtbb12 prints it (no path): the same."""
    child = r"""
import importlib.abc, sys
MSG = "libtbb.so.12: cannot open shared object file: No such file or directory"
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "stallfree._stallfree":
            raise ImportError(MSG, name=name)
sys.meta_path.insert(0, Missing())
try:
    import stallfree
except ImportError as e:
    print(e)
    print("NAME", e.name, "CAUSE", type(e.__cause__).__name__, e.__cause__)
"""
    out = venv.run_py(child).stdout
    assert "stallfree cannot load its extension stallfree._stallfree (libtbb.so.12: cannot " \
           "open shared object file: No such file or directory)" in out, out
    assert "the system library libtbb.so.12 is missing; it is in the Debian package libtbb12" \
        in out, out
    assert re.search(r"^\s+sudo apt-get install libtbb12 libgrpc\+\+1\.51 ", out, re.M), out
    assert "NAME stallfree._stallfree CAUSE ImportError libtbb.so.12" in out, out


def test_daemon_missing_library(venv, tmp_path):
    """A stallfreed that cannot load libcivetweb (only the daemon links it): stallfree.Daemon's
    error carries the loader's message and the package."""
    broken = str(tmp_path / "stallfreed")
    break_needed(os.path.join(venv.site, "stallfree", "stallfreed"), broken, "libcivetweb.so.1")
    p = venv.run_py("import stallfree\ntry:\n    stallfree.Daemon()\nexcept stallfree.Error as e:"
                    "\n    print(e)", env=clean_env(STALLFREE_STALLFREED=broken))
    assert "stallfreed exited with code 127 while starting" in p.stdout, p.stdout
    assert "libcivetweb.so.1: cannot open shared object file" in p.stdout, p.stdout
    assert "the Debian package libcivetweb1" in p.stdout, p.stdout
    assert "sudo apt-get install libcivetweb1 " in p.stdout, p.stdout


def test_system_library_table_is_complete(venv):
    """Every library the installed extension and binaries load maps to a Debian package (the
    one dpkg says, where dpkg is), and RUNTIME_PACKAGES are exactly those of their direct
    dependencies less the C/C++ runtime every system has."""
    syslibs = load_syslibs(venv)
    pkg = os.path.join(venv.site, "stallfree")
    files = [os.path.join(pkg, n) for n in ("_stallfree.so",) + BINARIES]
    direct, loaded = set(), {}
    for f in files:
        direct.update(needed(f))
        for m in re.finditer(r"^\s*(\S+) => (/\S+)", run(["ldd", f]).stdout, re.M):
            loaded[m.group(1)] = m.group(2)
    assert "libgrpc++.so.1.51" in loaded and "libtbb.so.12" in loaded, loaded
    unknown = sorted(s for s in loaded if syslibs.package_of(s) is None)
    assert not unknown, "add these to stallfree/_syslibs.py: %s" % unknown
    base = {"libc6", "libstdc++6", "libgcc-s1"}
    direct_pkgs = {syslibs.package_of(s) for s in direct if not s.startswith("ld-linux")}
    assert set(syslibs.RUNTIME_PACKAGES) == direct_pkgs - base
    assert len(syslibs.RUNTIME_PACKAGES) == len(set(syslibs.RUNTIME_PACKAGES))

    if shutil.which("dpkg") is None:
        pytest.skip("no dpkg here: the packages of the table are not checked")
    # dpkg knows a file by the path its package installed (/usr/lib or /lib: usrmerge), and an
    # alternatives link (libopenblas.so.0) by its target.
    candidates = {}
    for soname, path in loaded.items():
        paths = {path, os.path.realpath(path)}
        for p in list(paths):
            for a, b in (("/usr/lib/", "/lib/"), ("/lib/", "/usr/lib/")):
                if p.startswith(a):
                    paths.add(b + p[len(a):])
        candidates[soname] = paths
    all_paths = sorted(set().union(*candidates.values()))
    out = run(["dpkg", "-S"] + all_paths, check=False).stdout
    owner = {}
    for line in out.splitlines():
        pkgs, _, path = line.partition(": ")
        owner.setdefault(path.strip(), set()).update(
            p.strip().split(":")[0] for p in pkgs.split(","))
    wrong = {}
    for soname, paths in candidates.items():
        owners = set().union(*(owner.get(p, set()) for p in paths))
        if syslibs.package_of(soname) not in owners:
            wrong[soname] = (syslibs.package_of(soname), sorted(owners))
    assert not wrong, "stallfree/_syslibs.py disagrees with dpkg -S: %s" % wrong


# --- uninstall ------------------------------------------------------------------------------

def test_uninstall_removes_every_file(short_dir):
    v = Venv(os.path.join(short_dir, "venv"))
    v.run_py("import stallfree")  # leaves __pycache__ behind, as use does
    run(PIP + ["--python", v.python, "uninstall", "-y", "stallfree"])
    left = [os.path.join(r, n) for r, _, ns in os.walk(v.site) for n in ns
            if "stallfree" in os.path.join(r, n)]
    assert not left, left
    for n in BINARIES:
        assert not os.path.exists(os.path.join(v.bin, n))

"""py_extension_package: a Python package directory (a tree artifact) assembled from its .py
sources, a compiled extension module and helper binaries, so that `PYTHONPATH=bazel-bin/<pkg>`
imports it. Bazel cannot otherwise put generated files next to same-named sources.

py_wheel: a wheel of such a package (python/build_wheel.py writes it)."""

def _impl(ctx):
    out = ctx.actions.declare_directory(ctx.attr.dirname)
    inputs = ctx.files.srcs + ctx.files.extensions + ctx.files.binaries
    cmds = ["mkdir -p " + out.path]
    for f in ctx.files.srcs + ctx.files.extensions:
        cmds.append("cp %s %s/%s" % (f.path, out.path, f.basename))
    for f in ctx.files.binaries:
        cmds.append("cp %s %s/%s" % (f.path, out.path, f.basename))
    ctx.actions.run_shell(
        inputs = inputs,
        outputs = [out],
        command = " && ".join(cmds),
        progress_message = "Assembling the Python package %s" % ctx.attr.dirname,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

py_extension_package = rule(
    implementation = _impl,
    attrs = {
        "dirname": attr.string(mandatory = True),
        "srcs": attr.label_list(allow_files = [".py"]),
        "extensions": attr.label_list(allow_files = [".so"]),
        "binaries": attr.label_list(allow_files = True, cfg = "target"),
    },
)

def _wheel_impl(ctx):
    out = ctx.actions.declare_directory(ctx.attr.name)
    pkg = ctx.files.package
    if len(pkg) != 1:
        fail("package: expected one directory (a py_extension_package), got %d files" % len(pkg))
    args = ctx.actions.args()
    args.add(ctx.file.builder)
    args.add("--package-dir", pkg[0].path)
    args.add("--out-dir", out.path)
    args.add("--name", ctx.attr.distribution)
    args.add("--summary", ctx.attr.summary)
    args.add("--python-tag", ctx.attr.python_tag)
    args.add("--abi-tag", ctx.attr.abi_tag)
    args.add("--platform-tag", ctx.attr.platform_tag)
    args.add("--requires-python", ctx.attr.requires_python)
    args.add_all(ctx.attr.requires_dist, before_each = "--requires-dist")
    args.add_all(ctx.attr.extras, before_each = "--provides-extra")
    args.add_all(ctx.attr.executables, before_each = "--executable")
    args.add_all(["%s=%s" % (k, v) for k, v in sorted(ctx.attr.console_scripts.items())], before_each = "--console-script")
    args.add_all(["%s=%s" % (k, v) for k, v in sorted(ctx.attr.version_stamps.items())], before_each = "--version-stamp")
    if ctx.attr.runtime_packages_from:
        args.add("--runtime-packages-from", ctx.attr.runtime_packages_from)
    ctx.actions.run(
        executable = ctx.attr.python,
        arguments = [args],
        inputs = pkg + [ctx.file.builder],
        outputs = [out],
        mnemonic = "PyWheel",
        progress_message = "Building the wheel of %s" % ctx.attr.distribution,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

# py_wheel: a wheel of a py_extension_package, written by python/build_wheel.py (standard
# library only) into the directory bazel-bin/<package>/<name>/ (a tree artifact, so that the
# file name can carry the version the builder reads from the package's __init__.py).
py_wheel = rule(
    implementation = _wheel_impl,
    attrs = {
        "package": attr.label(mandatory = True),
        "builder": attr.label(allow_single_file = [".py"], default = "//python:build_wheel.py"),
        # The interpreter that runs the builder (Debian's; any Python 3 would do).
        "python": attr.string(default = "/usr/bin/python3"),
        "distribution": attr.string(mandatory = True),
        "summary": attr.string(default = ""),
        "python_tag": attr.string(mandatory = True),
        "abi_tag": attr.string(mandatory = True),
        "platform_tag": attr.string(mandatory = True),
        "requires_python": attr.string(default = ""),
        "requires_dist": attr.string_list(),
        "extras": attr.string_list(),
        "executables": attr.string_list(),
        "console_scripts": attr.string_dict(),
        "version_stamps": attr.string_dict(),
        "runtime_packages_from": attr.string(default = ""),
    },
)

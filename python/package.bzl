"""py_extension_package: a Python package directory (a tree artifact) assembled from its .py
sources, a compiled extension module and helper binaries, so that `PYTHONPATH=bazel-bin/<pkg>`
imports it. Bazel cannot otherwise put generated files next to same-named sources."""

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

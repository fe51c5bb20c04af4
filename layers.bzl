"""The layering check's view of a package (tests/layering)."""

def layer_sources():
    """This package's sources (C++, CUDA, Python) and BUILD file as :layer_sources, for
    tests/layering."""
    native.filegroup(
        name = "layer_sources",
        srcs = native.glob([
            "**/*.h",
            "**/*.cc",
            "**/*.cu",
            "**/*.cuh",
            "**/*.py",
        ]) + ["BUILD"],
        visibility = ["//tests/layering:__pkg__"],
    )

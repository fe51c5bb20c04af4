"""cuda_library: compiles .cu files with nvcc (sm_90 + PTX) into objects a cc_library links."""

NVCC = "/usr/local/cuda/bin/nvcc"

def cuda_library(name, srcs, hdrs = [], deps = [], copts = [], **kwargs):
    objs = []
    for src in srcs:
        obj = name + "_" + src.replace("/", "_").replace(".cu", ".o")
        native.genrule(
            name = obj + "_nvcc",
            srcs = [src] + depset(hdrs + native.glob(["**/*.h"])).to_list(),
            outs = [obj],
            cmd = (NVCC + " -std=c++17 -O3 -Xcompiler -fPIC " +
                   "-gencode arch=compute_90,code=sm_90 " +
                   "-gencode arch=compute_90,code=compute_90 " +
                   "-I. -I$(GENDIR) " + " ".join(copts) +
                   " -c $(location " + src + ") -o $@"),
        )
        objs.append(":" + obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["//third_party:cudart"],
        linkstatic = 1,
        **kwargs
    )

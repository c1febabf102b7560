//! Compiles the C++ bridge to c10d (csrc/*.cpp) against the libtorch that tch links, and
//! sets an rpath so the binary runs without LD_LIBRARY_PATH.
//!
//! With `--features cuda`, the bridge also compiles c10d's ProcessGroupNCCL (`-DUSE_C10D_NCCL`)
//! against the CUDA and NCCL headers, and the binary links `torch_cuda` (which tch must link too:
//! `LIBTORCH` names the CUDA libtorch). CUDA's own libraries (cuBLAS, cuDNN, NCCL, ...) are needed
//! where the binary runs, not where it links: `--allow-shlib-undefined`.
use std::env;
use std::path::{Path, PathBuf};

fn env_var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

fn fail(what: &str) -> ! {
    eprintln!(
        "\nerror: {what}\n\n\
         runner needs libtorch 2.13.0 and the gloo headers. Any one of these fixes it:\n  \
         - run ./scripts/setup.sh (fetches both into .deps/ from PyPI and Debian, once);\n  \
         - set LIBTORCH to a libtorch 2.13.0 folder (holding lib/libtorch_cpu.so and include/);\n  \
         - set GLOO_INCLUDE to a folder holding gloo/config.h, or apt-get install libgloo-dev.\n"
    );
    std::process::exit(1);
}

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let libtorch = env_var("LIBTORCH").map(PathBuf::from).unwrap_or_else(|| root.join(".deps/libtorch"));
    let lib = libtorch.join("lib");
    if !lib.join("libtorch_cpu.so").exists() {
        fail(&format!("no libtorch at {} (lib/libtorch_cpu.so is missing)", libtorch.display()));
    }
    let gloo = env_var("GLOO_INCLUDE")
        .map(PathBuf::from)
        .into_iter()
        .chain([root.join(".deps/gloo/usr/include"), PathBuf::from("/usr/include")])
        .find(|dir| dir.join("gloo/config.h").exists())
        .unwrap_or_else(|| fail("the gloo headers (gloo/config.h) were not found"));

    for file in [
        "csrc/bridge.cpp",
        "csrc/checkpoint.cpp",
        "csrc/fsdp.cpp",
        "csrc/memory.cpp",
        "csrc/events.cpp",
        "csrc/graph.cpp",
        "csrc/bridge.h",
        "csrc/internal.hpp",
        "csrc/traffic.hpp",
    ] {
        println!("cargo:rerun-if-changed={file}");
    }
    let include = libtorch.join("include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .std("c++17")
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(&gloo)
        .define("USE_C10D_GLOO", None)
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .file("csrc/bridge.cpp")
        .file("csrc/checkpoint.cpp")
        .file("csrc/fsdp.cpp")
        .file("csrc/memory.cpp")
        .file("csrc/events.cpp")
        .file("csrc/graph.cpp");
    let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();
    if cuda {
        let headers = cuda_include(&root, &lib);
        build.include(&headers).define("USE_C10D_NCCL", None).define("RUNNER_NCCL", None);
    }
    build.compile("runner_bridge");

    let version = std::fs::read_to_string(libtorch.join("build-version")).unwrap_or_else(|_| "unknown".into());
    println!("cargo:rustc-env=RUNNER_LIBTORCH_VERSION={}", version.trim());

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
    if cuda {
        // Kept even where nothing of tch refers to them (the linker drops such libraries by
        // default): loading libtorch_cuda.so is what registers CUDA with libtorch, without it
        // tch::Cuda::device_count() is 0 on any machine.
        for arg in ["-Wl,--push-state,--no-as-needed", "-ltorch_cuda", "-lc10_cuda", "-Wl,--pop-state"] {
            println!("cargo:rustc-link-arg={arg}");
        }
        // libtorch_cuda.so's own dependencies (cuBLAS, cuDNN, NCCL, ...) are found where it runs.
        println!("cargo:rustc-link-arg=-Wl,--allow-shlib-undefined");
    }
    rpath(&lib);
}

/// The folder of the CUDA and NCCL headers for the `cuda` feature, after checking that the
/// libtorch is a CUDA one: CUDA_INCLUDE (one folder holding both), or what
/// `scripts/setup.sh --cuda` put in .deps/cuda/include.
fn cuda_include(root: &Path, lib: &Path) -> PathBuf {
    let how = "\n  run ./scripts/setup.sh --cuda (fetches the CUDA libtorch and the CUDA and NCCL headers, once),\n  \
               then build with the CUDA libtorch, in a target folder of its own:\n\n    \
               LIBTORCH=$PWD/.deps/libtorch-cuda cargo build --release --features cuda --target-dir target/cuda\n";
    if !lib.join("libtorch_cuda.so").exists() {
        eprintln!(
            "\nerror: the cuda feature needs a CUDA libtorch, and {} has no libtorch_cuda.so.\n{how}",
            lib.display()
        );
        std::process::exit(1);
    }
    let dir = env_var("CUDA_INCLUDE").map(PathBuf::from).unwrap_or_else(|| root.join(".deps/cuda/include"));
    for header in ["cuda_runtime_api.h", "cublas_v2.h", "nccl.h"] {
        if !dir.join(header).exists() {
            eprintln!("\nerror: the cuda feature needs {header}, which {} does not hold.\n{how}", dir.display());
            std::process::exit(1);
        }
    }
    dir
}

/// Every binary, test and bench of this crate finds libtorch where it was built against.
fn rpath(lib: &Path) {
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

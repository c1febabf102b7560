//! Compiles the C++ bridge to c10d (csrc/bridge.cpp) against the libtorch that tch links, and
//! sets an rpath so the binary runs without LD_LIBRARY_PATH.
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

    for file in ["csrc/bridge.cpp", "csrc/bridge.h"] {
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
        .file("csrc/bridge.cpp");
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build.define("USE_C10D_NCCL", None).define("RUNNER_NCCL", None);
        if let Some(cuda) = env_var("CUDA_INCLUDE") {
            build.include(cuda);
        }
        println!("cargo:rustc-link-lib=torch_cuda");
    }
    build.compile("runner_bridge");

    let version = std::fs::read_to_string(libtorch.join("build-version")).unwrap_or_else(|_| "unknown".into());
    println!("cargo:rustc-env=RUNNER_LIBTORCH_VERSION={}", version.trim());

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
    rpath(&lib);
}

/// Every binary, test and bench of this crate finds libtorch where it was built against.
fn rpath(lib: &Path) {
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

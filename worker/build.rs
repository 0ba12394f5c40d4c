//! Bakes libtorch's lib/ directory into the binaries' rpath, so
//! `accrue-worker` runs without LD_LIBRARY_PATH; with the `cuda` feature,
//! also builds the CUDA memory shim (`csrc/cuda_memory.cpp`, see
//! `src/gpu_memory.rs`) when libtorch's CUDA library and the CUDA headers
//! are there, and says so with a warning when they are not (the worker
//! then reports device-level memory through the CUDA driver instead), and
//! the varlen flash attention shim (`csrc/flash_varlen.cpp`, see
//! `src/model/varlen.rs`).
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(accrue_cuda_memory)");
    println!("cargo::rustc-check-cfg=cfg(accrue_flash_varlen)");
    println!("cargo:rerun-if-changed=csrc/cuda_memory.cpp");
    println!("cargo:rerun-if-changed=csrc/flash_varlen.cpp");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .ok()
        .map(PathBuf::from);
    if let Some(dir) = &lib {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        match &lib {
            Some(dir) => {
                link_torch_cuda(dir);
                cuda_memory_shim(dir);
                flash_varlen_shim(dir);
            }
            None => println!("cargo:warning=cuda memory shim skipped: libtorch's lib/ unknown"),
        }
    }
}

/// Keeps `libtorch_cuda.so` among the binaries' needed libraries. Nothing
/// in them calls it directly, so the linker's `--as-needed` drops it, and
/// without it loaded libtorch registers no CUDA backend: `tch` then sees
/// no GPU on a GPU machine (found on the first one: `accrue-worker` built
/// with `--features cuda` did not list it in `DT_NEEDED`).
fn link_torch_cuda(lib: &Path) {
    if !lib.join("libtorch_cuda.so").is_file() {
        println!(
            "cargo:warning=libtorch at {} has no libtorch_cuda.so: this worker trains on the CPU only",
            lib.display()
        );
        return;
    }
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
}

/// The directory holding `cuda_runtime_api.h` and the headers it needs:
/// `$CUDA_HOME`, the system toolkit, or the CUDA wheels installed beside
/// PyTorch.
fn cuda_include(torch: &Path) -> Option<PathBuf> {
    let site = torch.parent();
    let candidates = [
        std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("include")),
        Some(PathBuf::from("/usr/local/cuda/include")),
        site.map(|s| s.join("nvidia/cu13/include")),
        site.map(|s| s.join("nvidia/cuda_runtime/include")),
    ];
    candidates
        .into_iter()
        .flatten()
        // cuda_runtime.h includes crt/host_config.h, which the runtime
        // wheel alone lacks (it comes with nvcc's headers).
        .find(|d| d.join("cuda_runtime_api.h").is_file() && d.join("crt/host_config.h").is_file())
}

fn cuda_memory_shim(lib: &Path) {
    let Some(torch) = lib.parent() else { return };
    let include = torch.join("include");
    let Some(cuda) = cuda_include(torch) else {
        println!(
            "cargo:warning=cuda memory shim skipped: no CUDA headers with crt/ (set CUDA_HOME); \
             GPU memory metrics fall back to the driver's device-level figure"
        );
        return;
    };
    if !lib.join("libc10_cuda.so").is_file() || !include.join("c10/cuda").is_dir() {
        println!(
            "cargo:warning=cuda memory shim skipped: libtorch at {} has no CUDA",
            lib.display()
        );
        return;
    }
    if !compile_shim(
        "csrc/cuda_memory.cpp",
        "accrue_cuda_memory",
        &[include.as_path(), cuda.as_path()],
    ) {
        return;
    }
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=c10_cuda");
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-cfg=accrue_cuda_memory");
}

/// The varlen flash attention shim (`csrc/flash_varlen.cpp`): libtorch's
/// headers only (the CUDA kernel is found through the dispatcher at run
/// time), so it compiles against a CPU libtorch too, which is how CI
/// checks it on machines without a GPU.
fn flash_varlen_shim(lib: &Path) {
    let Some(torch) = lib.parent() else { return };
    let include = torch.join("include");
    if !include
        .join("ATen/ops/_flash_attention_forward.h")
        .is_file()
    {
        println!(
            "cargo:warning=varlen flash shim skipped: libtorch at {} declares no _flash_attention_forward",
            lib.display()
        );
        return;
    }
    // Like the memory shim: a shim that does not compile costs the varlen
    // path (CUDA rows run bucketed), never the build.
    if !compile_shim(
        "csrc/flash_varlen.cpp",
        "accrue_flash_varlen",
        &[include.as_path()],
    ) {
        return;
    }
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-cfg=accrue_flash_varlen");
}

/// Compiles the C++ shim `file` into the static library `name` against
/// libtorch's headers (`include`: libtorch's, then any other); false, with
/// a warning, when it does not compile (headers of another CUDA, a compiler
/// too old for c10): a shim costs its feature, never the build.
fn compile_shim(file: &str, name: &str, include: &[&Path]) -> bool {
    // PyTorch's wheels are built with the C++11 ABI; the shims share c10's
    // types with them.
    let abi = std::env::var("ACCRUE_CXX11_ABI").unwrap_or_else(|_| "1".into());
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .file(file)
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .warnings(false)
        .cargo_warnings(false);
    if let Some(torch) = include.first() {
        build
            .include(torch)
            .include(torch.join("torch/csrc/api/include"));
    }
    for dir in &include[1..] {
        build.include(dir);
    }
    match build.try_compile(name) {
        Ok(()) => true,
        Err(e) => {
            println!("cargo:warning={name} shim skipped: it did not compile ({e})");
            false
        }
    }
}

//! Generates the accrue.v1 tonic/prost code with a vendored `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; tonic-prost-build reads PROTOC.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let protos = [
        "accrue/v1/types.proto",
        "accrue/v1/job.proto",
        "accrue/v1/worker.proto",
        "accrue/v1/admin.proto",
        "accrue/v1/rollouts.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure().compile_protos(&protos, &["."])?;
    Ok(())
}

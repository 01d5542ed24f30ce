//! Compiles the Envoy rate-limit proto subset under `proto/` with protox (a protobuf compiler
//! written in Rust), so a fresh machine needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let entry = "proto/envoy/service/ratelimit/v3/rls.proto";
    println!("cargo:rerun-if-changed=proto");
    let files = protox::compile([entry], ["proto"])?;
    tonic_prost_build::configure()
        // prost's encoding; requests that do not decode are INVALID_ARGUMENT (src/pb/codec.rs).
        .codec_path("crate::pb::codec::RlsCodec")
        .build_server(true)
        .build_client(true)
        .compile_fds(files)?;
    Ok(())
}

//! Compiles the Envoy rate-limit and rate-limit quota proto subsets under `proto/` with protox (a protobuf compiler
//! written in Rust), so a fresh machine needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let entries = [
        "proto/envoy/service/ratelimit/v3/rls.proto",
        "proto/envoy/service/rate_limit_quota/v3/rlqs.proto",
    ];
    println!("cargo:rerun-if-changed=proto");
    let files = protox::compile(entries, ["proto"])?;
    tonic_prost_build::configure()
        // prost's encoding; requests that do not decode are INVALID_ARGUMENT (src/pb/codec.rs).
        .codec_path("crate::pb::codec::RlsCodec")
        .build_server(true)
        .build_client(true)
        .compile_fds(files)?;
    Ok(())
}

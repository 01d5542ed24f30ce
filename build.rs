//! Compiles the Envoy rate-limit, rate-limit quota and aggregated discovery (xDS) proto subsets, and
//! envoyproxy/ratelimit's `RateLimitConfig` resource, under `proto/` with protox (a protobuf
//! compiler written in Rust), so a fresh machine needs no system `protoc`. The well-known types
//! (`Any`, `Struct`, ...) map to `prost-types`. The quota service's server is generated a second
//! time, by hand, over the server's own decoding of its messages.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let entries = [
        "proto/envoy/service/ratelimit/v3/rls.proto",
        "proto/envoy/service/rate_limit_quota/v3/rlqs.proto",
        "proto/envoy/service/discovery/v3/ads.proto",
        "proto/ratelimit/config/ratelimit/v3/rls_conf.proto",
    ];
    println!("cargo:rerun-if-changed=proto");
    let files = protox::compile(entries, ["proto"])?;
    tonic_prost_build::configure()
        // prost's encoding; requests that do not decode are INVALID_ARGUMENT (src/pb/codec.rs).
        .codec_path("crate::pb::codec::RlsCodec")
        // A quota bucket's id is kept ordered (`rlqs::BucketId`): decoded as one, sent as one.
        .btree_map(".envoy.service.rate_limit_quota.v3.BucketId.bucket")
        .build_server(true)
        .build_client(true)
        .compile_fds(files)?;
    // The quota service's server again, over the server's own reading and writing of its
    // messages (`wire::quota`), which keep each bucket id as bytes, not as prost's map of strings.
    let quota = tonic_build::manual::Service::builder()
        .name("RateLimitQuotaService")
        .package("envoy.service.rate_limit_quota.v3")
        .method(
            tonic_build::manual::Method::builder()
                .name("stream_rate_limit_quotas")
                .route_name("StreamRateLimitQuotas")
                .input_type("crate::wire::quota::UsageReports")
                .output_type("crate::wire::quota::Answer")
                .codec_path("crate::server::rlqs::UsageCodec")
                .client_streaming()
                .server_streaming()
                .build(),
        )
        .build();
    tonic_build::manual::Builder::new()
        .build_client(false)
        .compile(&[quota]);
    Ok(())
}

//! Generated protobuf and gRPC code for Envoy's rate-limit and rate-limit quota APIs (see `proto/README.md`).
//!
//! Only the wire forms (`wire/`), the transports (`server/`), `client/` and the `probe` (the
//! other side of the wire) and tests speak these types; the rest of the crate works on domain
//! types.
#![allow(missing_docs, clippy::all, clippy::pedantic)]

pub mod codec;

/// Envoy API packages, nested as their proto package names so generated cross-references resolve.
pub mod envoy {
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
        pub mod rate_limit_quota {
            pub mod v3 {
                tonic::include_proto!("envoy.service.rate_limit_quota.v3");
            }
        }
        pub mod discovery {
            pub mod v3 {
                tonic::include_proto!("envoy.service.discovery.v3");
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
    pub mod config {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
}

/// googleapis' `google.rpc.Status`, the error detail of an xDS NACK.
pub mod google {
    pub mod rpc {
        tonic::include_proto!("google.rpc");
    }
}

/// envoyproxy/ratelimit's own API: the `RateLimitConfig` resource pushed over xDS.
pub mod ratelimit {
    pub mod config {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("ratelimit.config.ratelimit.v3");
            }
        }
    }
}

pub use envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor};
pub use envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports, rate_limit_quota_response,
    rate_limit_quota_service_client, rate_limit_quota_service_server,
};
pub use envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse, rate_limit_response, rate_limit_service_client,
    rate_limit_service_server,
};
pub use envoy::r#type::v3::{RateLimitStrategy, TokenBucket, rate_limit_strategy};

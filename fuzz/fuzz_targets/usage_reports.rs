//! A quota stream's message: arbitrary bytes read by the server's own decoder
//! (`wire::quota::UsageReports::decode`, each bucket id straight into the bytes a stream keeps)
//! and by prost's generated `RateLimitQuotaUsageReports`. Both must accept the same bytes with
//! the same reading, or refuse them with the same error.

#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use sluice::pb::RateLimitQuotaUsageReports;
use sluice::wire::quota::UsageReports;

fuzz_target!(|data: &[u8]| {
    let ours = UsageReports::decode(data).map_err(|e| e.to_string());
    let prost = RateLimitQuotaUsageReports::decode(data)
        .map(UsageReports::from)
        .map_err(|e| e.to_string());
    assert_eq!(ours, prost, "the server's reading differs from prost's");
});

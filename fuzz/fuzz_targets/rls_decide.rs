//! `ShouldRateLimit`: arbitrary bytes decoded as a protobuf `RateLimitRequest` (as the gRPC port
//! decodes a message), then answered by the gRPC adapter (`server::rls`: conversion, the real
//! decider over a fixed policy set on the in-memory store, conversion back) under three sets of
//! options, each at four times of a hand-driven clock. Panics and hangs are the failures; an
//! answer must also encode and decode back to itself.

#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use prost::Message;
use sluice::fuzz::Rls;
use sluice::pb::{RateLimitRequest, RateLimitResponse};

fuzz_target!(|data: &[u8]| {
    let Ok(request) = RateLimitRequest::decode(data) else {
        return;
    };
    for options in common::options() {
        let rls = Rls::new(
            common::policies(),
            common::metrics(),
            options,
            common::ORIGIN,
        );
        for t in common::TIMES {
            rls.set_clock(common::ORIGIN + t);
            if let Ok(response) = rls.answer(request.clone()) {
                let bytes = response.encode_to_vec();
                let back =
                    RateLimitResponse::decode(bytes.as_slice()).expect("an encoded answer decodes");
                assert_eq!(back, response);
            }
        }
    }
});

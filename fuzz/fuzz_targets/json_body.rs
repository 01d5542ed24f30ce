//! `POST /json`: arbitrary bytes through the admin port's proto3-JSON parser
//! (`wire::json::parse`); a body it accepts is then decided as the admin port decides it (the
//! real decider over a fixed policy set on the in-memory store, at four times of a hand-driven
//! clock) and its answer rendered (`wire::json::render`). Panics and hangs are the failures.

#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use sluice::fuzz::{json_parse, json_render};

fuzz_target!(|data: &[u8]| {
    let Ok(request) = json_parse(data) else {
        return;
    };
    let (decider, clock) = common::decider(common::options()[1].clone());
    for t in common::TIMES {
        clock.set(common::ORIGIN + t);
        if let Ok(decision) = common::decide(&decider, &request) {
            let body = json_render(&decision);
            drop(serde_json::to_vec(&body).expect("a rendered answer serializes"));
        }
    }
});

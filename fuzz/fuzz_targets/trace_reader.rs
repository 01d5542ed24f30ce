//! `sluice replay`'s traces: arbitrary bytes read as a plain (not gzip) trace by
//! `sluice::lab::TraceReader` up to its first error, as replay reads one, and every line
//! through `sluice::lab::trace::parse_line`. Beyond "no panic": the events read are in time
//! order.

#![no_main]

use std::io::Cursor;
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use sluice::lab::TraceReader;
use sluice::lab::trace::{parse_line, seconds};

fuzz_target!(|data: &[u8]| {
    let reader = TraceReader::new(
        Path::new("fuzz.jsonl"),
        Box::new(Cursor::new(data.to_vec())),
    );
    let mut last = 0;
    for event in reader {
        let Ok(event) = event else {
            break;
        };
        assert!(event.t >= last, "{} after {}", event.t, last);
        last = event.t;
        drop(seconds(event.t));
    }
    for line in String::from_utf8_lossy(data).lines() {
        drop(parse_line(line.trim()));
    }
});

//! The load benchmark's generator for traffic h2load cannot make: h2load sends one fixed body,
//! and the "many distinct keys" scenario needs a different counter key in every request.
//!
//! It plays h2load's part: `c` HTTP/2 connections with `m` concurrent `ShouldRateLimit` calls
//! each, a warm-up, then a measured interval; it prints one line of `key=value` pairs (rate,
//! latency percentiles, answers by code) for `benches/load.sh`. Every answer is read to its
//! trailers, so a gRPC error is counted, never taken for a decision.
//!
//! Like h2load it speaks HTTP/2 frame by frame, one task per connection, rather than through a
//! client library with a task per call: on the 2-core machine the benchmark runs on, the
//! generator shares a core with redis-server in the Redis scenarios, so every microsecond it
//! spends per call is taken from Redis. Its request headers go into the server's HPACK table
//! on the first request and are sent as indexes after it, as h2load's and h2's are; the server
//! decodes the same header blocks from either.
//!
//! Each request carries two descriptors, `[user=u<k>]` and `[client=c<j>]`, with `k` and `j`
//! drawn independently and uniformly from `0..keys`: `2 × keys` counters in all. With
//! `--descriptors 1` it carries the `user` one alone, so that the two runs give what a further
//! descriptor costs. With `--key-offset N` they are drawn from `N..N + keys` instead, so that
//! successive runs (the soak, `benches/soak.py`) can move to values the server has not seen.
//!
//! ```sh
//! cargo run --release --example loadgen -- --addr 127.0.0.1:8081 -c 10 -m 10 --keys 100000
//! ```
//!
//! With `--rate R` the calls are paced to `R` per second in all, each of the `c × m` call slots
//! on its own fixed schedule (a late call does not move the next one). Latency is measured from
//! the moment a call is sent, not from its scheduled time: tokio's timer wakes up to 1 ms late,
//! and that lateness is the generator's, not the server's.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
#[derive(Debug, Clone)]
struct Args {
    addr: String,
    connections: usize,
    streams: usize,
    seconds: f64,
    warm_up: f64,
    keys: usize,
    /// The first key drawn: values are `key_offset..key_offset + keys`.
    key_offset: usize,
    /// 2: `user` and `client`; 1: `user` alone.
    descriptors: usize,
    rate: Option<f64>,
    domain: String,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: "127.0.0.1:8081".into(),
        connections: 10,
        streams: 10,
        seconds: 5.0,
        warm_up: 1.0,
        keys: 100_000,
        key_offset: 0,
        descriptors: 2,
        rate: None,
        domain: "bench".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue; // passed by `cargo bench`; nothing to do with it
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--addr" => args.addr = value,
            "-c" | "--connections" => args.connections = value.parse().map_err(|e| bad(&e))?,
            "-m" | "--streams" => args.streams = value.parse().map_err(|e| bad(&e))?,
            "-D" | "--seconds" => args.seconds = value.parse().map_err(|e| bad(&e))?,
            "--warm-up" => args.warm_up = value.parse().map_err(|e| bad(&e))?,
            "--keys" => args.keys = value.parse().map_err(|e| bad(&e))?,
            "--key-offset" => args.key_offset = value.parse().map_err(|e| bad(&e))?,
            "--descriptors" => args.descriptors = value.parse().map_err(|e| bad(&e))?,
            "--rate" => args.rate = Some(value.parse().map_err(|e| bad(&e))?),
            "--domain" => args.domain = value,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if args.connections == 0 || args.streams == 0 || args.keys == 0 || args.seconds <= 0.0 {
        return Err("connections, streams, keys and seconds must be positive".into());
    }
    if args.key_offset.checked_add(args.keys).is_none() {
        return Err("--key-offset plus --keys must fit in a usize".into());
    }
    if !(1..=2).contains(&args.descriptors) {
        return Err("--descriptors must be 1 (user) or 2 (user and client)".into());
    }
    if args.rate.is_some_and(|r| r <= 0.0 || !r.is_finite()) {
        return Err("--rate must be a positive number".into());
    }
    Ok(args)
}

/// A protobuf length-delimited field.
fn field(out: &mut Vec<u8>, number: u8, data: &[u8]) {
    out.push(number << 3 | 2);
    varint(out, data.len());
    out.extend_from_slice(data);
}

fn varint(out: &mut Vec<u8>, mut n: usize) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// `prefix` and the decimal digits of `n`, without going through `fmt`.
fn decimal(out: &mut [u8; 24], prefix: u8, mut n: usize) -> &[u8] {
    let mut at = out.len();
    loop {
        at -= 1;
        out[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    at -= 1;
    out[at] = prefix;
    &out[at..]
}

/// One `descriptors` field of a `RateLimitRequest`, a descriptor of one entry, appended to `out`.
fn descriptor_field(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    let entry = 2 + key.len() + 2 + value.len(); // both below 128 bytes: one-byte lengths
    let desc = 2 + entry;
    out.extend_from_slice(&[2 << 3 | 2, desc as u8, 1 << 3 | 2, entry as u8]);
    field(out, 1, key);
    field(out, 2, value);
}

/// xorshift64*: a cheap per-connection generator for key choice (not for anything secret).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as usize % n
    }
}

#[derive(Debug, Default)]
struct Tally {
    /// Latency of each measured call, in microseconds.
    micros: Vec<u32>,
    ok: u64,
    over_limit: u64,
    other_code: u64,
    grpc_errors: u64,
    transport_errors: u64,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.micros.extend(other.micros);
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        self.other_code += other.other_code;
        self.grpc_errors += other.grpc_errors;
        self.transport_errors += other.transport_errors;
    }
}

// HTTP/2 (RFC 9113): the frame types and flags the generator uses.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const WINDOW_UPDATE: u8 = 8;
const CONTINUATION: u8 = 9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// What the generator grants the server to send, per stream and on the connection: far more
/// than any run receives, so it never has to grant more.
const RECEIVE_WINDOW: u32 = (1 << 31) - 1;

fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// An HPACK string literal, without Huffman coding.
fn hpack_string(out: &mut Vec<u8>, s: &[u8]) {
    hpack_int(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// An HPACK integer of `prefix` bits after the bits `high` (RFC 7541, 5.1).
fn hpack_int(out: &mut Vec<u8>, high: u8, prefix: u32, mut n: usize) {
    let max = (1usize << prefix) - 1;
    if n < max {
        out.push(high | n as u8);
        return;
    }
    out.push(high | max as u8);
    n -= max;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// The request's header blocks: the first, which adds `:path`, `:authority`, `content-type`
/// and `te` to the server's HPACK table (if it is big enough for them), and the one every later
/// request sends, which names them by index.
fn request_headers(authority: &str, table_size: usize) -> (Vec<u8>, Vec<u8>) {
    const PATH: &[u8] = b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    // (static index of the name, or 0 for a literal name; name; value), in the order sent.
    let fields: [(usize, &[u8], &[u8]); 4] = [
        (4, b":path", PATH),
        (1, b":authority", authority.as_bytes()),
        (31, b"content-type", b"application/grpc"),
        (0, b"te", b"trailers"),
    ];
    // An entry takes its name and value and 32 bytes of the table (RFC 7541, 4.1).
    let needed: usize = fields.iter().map(|(_, n, v)| n.len() + v.len() + 32).sum();
    let indexing = needed <= table_size;
    // :method POST and :scheme http are in the static table (3 and 6).
    let mut first = Vec::new();
    if table_size < 4_096 {
        // The server lowered the table below its default: the first block says it has heard
        // (RFC 7541, 4.2).
        hpack_int(&mut first, 0x20, 5, table_size);
    }
    first.extend_from_slice(&[0x80 | 3, 0x80 | 6]);
    for (index, name, value) in fields {
        // With indexing 01 and a 6-bit name index, without it 0000 and a 4-bit one.
        let (high, bits) = if indexing { (0x40, 6) } else { (0x00, 4) };
        hpack_int(&mut first, high, bits, index);
        if index == 0 {
            hpack_string(&mut first, name);
        }
        hpack_string(&mut first, value);
    }
    if !indexing {
        return (first.clone(), first);
    }
    // The table's newest entry is index 62: `te` (sent last), then content-type, :authority,
    // :path.
    let later = vec![
        0x80 | 3,
        0x80 | 6,
        0x80 | 65,
        0x80 | 64,
        0x80 | 63,
        0x80 | 62,
    ];
    (first, later)
}

/// One call slot of a connection: the stream it is waiting on, if any.
#[derive(Default)]
struct Slot {
    /// The stream in flight, 0 for none.
    stream: u32,
    sent: Option<Instant>,
    /// When a paced slot sends its next call.
    next: Option<Instant>,
    /// The first bytes of the response body (the gRPC prefix and `overall_code`).
    head: [u8; 7],
    got: usize,
    /// grpc-status, once a header block carried it.
    status_ok: Option<bool>,
}

/// How a stream ended.
enum End {
    /// The response came to its end (whether its grpc-status was 0 is in its slot).
    Answer,
    /// Reset by the server.
    Reset,
}

struct Connection {
    tcp: TcpStream,
    read: Vec<u8>,
    write: Vec<u8>,
    hpack: loona_hpack::Decoder<'static>,
    /// A header block split over CONTINUATION frames: its stream, whether it ends the stream,
    /// and the bytes so far.
    partial: Option<(u32, bool, Vec<u8>)>,
    /// What the server lets us send on the connection, in DATA bytes.
    send_window: i64,
    /// The server's settings that bound the calls: its initial stream window, concurrent
    /// streams, and HPACK table size.
    stream_window: i64,
    max_streams: usize,
    table_size: usize,
    got_settings: bool,
    /// The GOAWAY's error code, once the server has said it: no new streams.
    going_away: Option<u32>,
    /// DATA bytes received since the connection's receive window was last topped up.
    received: u64,
}

impl Connection {
    /// Reads at least one more chunk into `read`; false at the end of the stream.
    async fn fill(&mut self) -> Result<bool, String> {
        self.read.reserve(64 * 1024);
        let n = self
            .tcp
            .read_buf(&mut self.read)
            .await
            .map_err(|e| format!("read: {e}"))?;
        Ok(n > 0)
    }

    async fn flush(&mut self) -> Result<(), String> {
        if !self.write.is_empty() {
            self.tcp
                .write_all(&self.write)
                .await
                .map_err(|e| format!("write: {e}"))?;
            self.write.clear();
        }
        Ok(())
    }

    /// Handles every whole frame in `read`, calling `ended` for each stream that ends.
    fn frames(
        &mut self,
        mut ended: impl FnMut(u32, End),
        slots: &mut [Slot],
    ) -> Result<(), String> {
        let mut at = 0;
        while self.read.len() - at >= 9 {
            let h = &self.read[at..at + 9];
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            let (kind, flags) = (h[3], h[4]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            if self.read.len() - at - 9 < len {
                break;
            }
            let payload = at + 9..at + 9 + len;
            at += 9 + len;
            if self.partial.is_some() && kind != CONTINUATION {
                return Err(format!("frame type {kind} inside a header block"));
            }
            match kind {
                DATA => {
                    // The whole frame counts against the connection's receive window.
                    self.received += len as u64;
                    if self.received >= 1 << 30 {
                        frame_header(&mut self.write, 4, WINDOW_UPDATE, 0, 0);
                        self.write
                            .extend_from_slice(&(self.received as u32).to_be_bytes());
                        self.received = 0;
                    }
                    let p = unpadded(&self.read[payload], flags)?;
                    if let Some(slot) = slots.iter_mut().find(|s| s.stream == stream && stream != 0)
                    {
                        let take = p.len().min(slot.head.len() - slot.got);
                        slot.head[slot.got..slot.got + take].copy_from_slice(&p[..take]);
                        slot.got += take;
                    }
                    if flags & END_STREAM != 0 {
                        // A gRPC response ends with trailers; one that ends on DATA has none.
                        ended(stream, End::Answer);
                    }
                }
                HEADERS => {
                    let mut p = unpadded(&self.read[payload], flags)?;
                    if flags & PRIORITY != 0 {
                        p = p.get(5..).ok_or("short HEADERS priority")?;
                    }
                    let end = flags & END_STREAM != 0;
                    if flags & END_HEADERS != 0 {
                        header_block(&mut self.hpack, stream, end, p, &mut ended, slots)?;
                    } else {
                        self.partial = Some((stream, end, p.to_vec()));
                    }
                }
                CONTINUATION => {
                    let Some((id, end, mut block)) = self.partial.take() else {
                        return Err("CONTINUATION outside a header block".into());
                    };
                    block.extend_from_slice(&self.read[payload]);
                    if flags & END_HEADERS != 0 {
                        header_block(&mut self.hpack, id, end, &block, &mut ended, slots)?;
                    } else {
                        self.partial = Some((id, end, block));
                    }
                }
                RST_STREAM => ended(stream, End::Reset),
                SETTINGS if flags & ACK == 0 => {
                    for s in self.read[payload].chunks_exact(6) {
                        let value = u32::from_be_bytes([s[2], s[3], s[4], s[5]]);
                        match u16::from_be_bytes([s[0], s[1]]) {
                            1 if self.got_settings && (value as usize) < self.table_size => {
                                return Err("the server shrank its HPACK table mid-run".into());
                            }
                            1 => self.table_size = value as usize,
                            3 => self.max_streams = value as usize,
                            4 => {
                                // A change applies to the streams open too (RFC 9113, 6.9.2);
                                // the generator sends each stream's body at once, so only the
                                // value for new streams matters.
                                self.stream_window = i64::from(value);
                            }
                            _ => {}
                        }
                    }
                    self.got_settings = true;
                    frame_header(&mut self.write, 0, SETTINGS, ACK, 0);
                }
                PING if flags & ACK == 0 => {
                    let data = self.read[payload].to_vec();
                    frame_header(&mut self.write, data.len(), PING, ACK, 0);
                    self.write.extend_from_slice(&data);
                }
                GOAWAY => {
                    let p = self.read[payload].get(..8).ok_or("short GOAWAY")?;
                    let last = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff;
                    self.going_away = Some(u32::from_be_bytes([p[4], p[5], p[6], p[7]]));
                    // Streams above the last one the server took will never be answered.
                    for slot in slots.iter().filter(|s| s.stream > last) {
                        ended(slot.stream, End::Reset);
                    }
                }
                WINDOW_UPDATE if stream == 0 => {
                    let p = &self.read[payload];
                    let inc = p.get(..4).ok_or("short WINDOW_UPDATE")?;
                    self.send_window += i64::from(
                        u32::from_be_bytes([inc[0], inc[1], inc[2], inc[3]]) & 0x7fff_ffff,
                    );
                }
                _ => {} // SETTINGS and PING acks, stream WINDOW_UPDATE, PRIORITY, unknown types
            }
        }
        self.read.drain(..at);
        Ok(())
    }
}

/// One whole header block of `stream`: the response's headers or its trailers.
fn header_block(
    hpack: &mut loona_hpack::Decoder<'static>,
    stream: u32,
    end: bool,
    block: &[u8],
    ended: &mut impl FnMut(u32, End),
    slots: &mut [Slot],
) -> Result<(), String> {
    let mut status = None;
    hpack
        .decode_with_cb(block, |name: Cow<[u8]>, value: Cow<[u8]>| {
            if &name[..] == b"grpc-status" {
                status = Some(&value[..] == b"0");
            }
        })
        .map_err(|e| format!("HPACK: {e:?}"))?;
    let slot = slots.iter_mut().find(|s| s.stream == stream && stream != 0);
    if let (Some(slot), Some(ok)) = (slot, status) {
        slot.status_ok = Some(ok);
    }
    if end {
        ended(stream, End::Answer);
    }
    Ok(())
}

/// The payload of a DATA or HEADERS frame without its padding.
fn unpadded(p: &[u8], flags: u8) -> Result<&[u8], String> {
    if flags & PADDED == 0 {
        return Ok(p);
    }
    let pad = usize::from(*p.first().ok_or("an empty padded frame")?);
    if 1 + pad > p.len() {
        return Err("padding longer than its frame".into());
    }
    Ok(&p[1..p.len() - pad])
}

/// What one connection task needs besides its socket.
struct Shared {
    domain: Vec<u8>,
    keys: usize,
    key_offset: usize,
    descriptors: usize,
    streams: usize,
    interval: Option<Duration>,
    measuring: Arc<AtomicBool>,
    /// Becomes true when the connections are to stop sending.
    stop: watch::Receiver<bool>,
}

/// How long a connection waits, once told to stop, for the calls it has in flight.
const DRAIN: Duration = Duration::from_secs(5);

/// One connection: `streams` calls in flight (or paced), until `stop`; then it waits for the
/// calls in flight (at most [`DRAIN`]) and returns what they answered. A call that was never
/// answered (the connection failed, the server went away, or the wait ran out) is a transport
/// error, and the tally is returned with the error that ended the connection, if any.
async fn connection(
    tcp: TcpStream,
    addr: String,
    index: usize,
    tasks: usize,
    shared: Arc<Shared>,
) -> (Tally, Option<String>) {
    let mut conn = Connection {
        tcp,
        read: Vec::with_capacity(64 * 1024),
        write: Vec::with_capacity(64 * 1024),
        hpack: loona_hpack::Decoder::new(),
        partial: None,
        send_window: 65_535,
        stream_window: 65_535,
        max_streams: usize::MAX,
        table_size: 4_096,
        got_settings: false,
        going_away: None,
        received: 0,
    };
    // The server's table for our header blocks may not grow past what we allow it.
    conn.hpack.set_max_allowed_table_size(4_096);
    let mut slots: Vec<Slot> = (0..shared.streams).map(|_| Slot::default()).collect();
    let mut tally = Tally::default();
    let result = drive(
        &mut conn, &mut slots, &mut tally, &addr, index, tasks, &shared,
    )
    .await;
    let unanswered = slots.iter().filter(|s| s.stream != 0).count();
    tally.transport_errors += unanswered as u64;
    let error = match result {
        Err(e) => Some(e),
        Ok(()) if unanswered > 0 => Some(format!(
            "{unanswered} calls unanswered {} s after the end of the run",
            DRAIN.as_secs()
        )),
        Ok(()) => None,
    };
    (tally, error)
}

/// The connection's life: the handshake, then calls until `stop` and the drain.
async fn drive(
    conn: &mut Connection,
    slots: &mut [Slot],
    tally: &mut Tally,
    addr: &str,
    index: usize,
    tasks: usize,
    shared: &Shared,
) -> Result<(), String> {
    // The preface, our settings (no push; the whole receive window per stream), and the rest of
    // the receive window on the connection.
    conn.write.extend_from_slice(PREFACE);
    frame_header(&mut conn.write, 12, SETTINGS, 0, 0);
    conn.write.extend_from_slice(&[0, 2, 0, 0, 0, 0]);
    conn.write.extend_from_slice(&[0, 4]);
    conn.write.extend_from_slice(&RECEIVE_WINDOW.to_be_bytes());
    frame_header(&mut conn.write, 4, WINDOW_UPDATE, 0, 0);
    conn.write
        .extend_from_slice(&(RECEIVE_WINDOW - 65_535).to_be_bytes());
    conn.flush().await?;
    // The server's settings come first (RFC 9113, 3.4): they bound the first requests.
    while !conn.got_settings {
        if !conn.fill().await? {
            return Err("the server closed the connection during the handshake".into());
        }
        conn.frames(|_, _| {}, &mut [])?;
    }
    conn.flush().await?;
    let (mut first_headers, later_headers) = request_headers(addr, conn.table_size);

    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((index as u64 + 1) * 0x1000_0001));
    if let Some(i) = shared.interval {
        // Paced slots start spread over one interval, not all at once.
        let now = Instant::now();
        for (s, slot) in slots.iter_mut().enumerate() {
            let task = index * shared.streams + s;
            slot.next = Some(now + i.mul_f64(task as f64 / tasks as f64));
        }
    }
    let mut stop = shared.stop.clone();
    let mut drain_until: Option<Instant> = None;
    let mut next_stream = 1u32;
    let mut in_flight = 0usize;
    let mut message = Vec::with_capacity(128);
    let mut digits = [0u8; 24];
    // The streams that a read's frames ended, reused from read to read.
    let mut done = Vec::new();
    loop {
        let stopping = *stop.borrow_and_update() || conn.going_away.is_some();
        if stopping && in_flight == 0 {
            break;
        }
        if stopping && drain_until.is_none() {
            drain_until = Some(Instant::now() + DRAIN);
        }
        // Send a call on every free slot that is due.
        let now = Instant::now();
        let mut wake: Option<Instant> = None;
        let mut sent = false;
        for slot in slots.iter_mut().filter(|s| s.stream == 0) {
            if stopping || in_flight >= conn.max_streams {
                break;
            }
            if let Some(at) = slot.next.filter(|at| *at > now) {
                wake = Some(wake.map_or(at, |w| w.min(at)));
                continue;
            }
            if next_stream > (1 << 31) - 2 {
                return Err("ran out of stream ids".into());
            }
            message.clear();
            field(&mut message, 1, &shared.domain);
            descriptor_field(
                &mut message,
                b"user",
                decimal(
                    &mut digits,
                    b'u',
                    shared.key_offset + rng.below(shared.keys),
                ),
            );
            if shared.descriptors == 2 {
                descriptor_field(
                    &mut message,
                    b"client",
                    decimal(
                        &mut digits,
                        b'c',
                        shared.key_offset + rng.below(shared.keys),
                    ),
                );
            }
            let body = 5 + message.len();
            if body as i64 > conn.send_window || body as i64 > conn.stream_window {
                break; // wait for the server to open its window
            }
            let headers = if first_headers.is_empty() {
                &later_headers
            } else {
                &first_headers
            };
            frame_header(
                &mut conn.write,
                headers.len(),
                HEADERS,
                END_HEADERS,
                next_stream,
            );
            conn.write.extend_from_slice(headers);
            first_headers.clear();
            frame_header(&mut conn.write, body, DATA, END_STREAM, next_stream);
            conn.write.push(0);
            conn.write
                .extend_from_slice(&(message.len() as u32).to_be_bytes());
            conn.write.extend_from_slice(&message);
            conn.send_window -= body as i64;
            *slot = Slot {
                stream: next_stream,
                next: slot.next.zip(shared.interval).map(|(at, i)| at + i),
                ..Slot::default()
            };
            next_stream += 2;
            in_flight += 1;
            sent = true;
        }
        if sent {
            // A call's latency starts as its frames are written.
            let at = Instant::now();
            for slot in slots
                .iter_mut()
                .filter(|s| s.stream != 0 && s.sent.is_none())
            {
                slot.sent = Some(at);
            }
        }
        conn.flush().await?;
        // Then wait for answers, for the next paced call to be due, for the end of the run, or
        // past it for the end of the drain.
        let until = if stopping { drain_until } else { wake };
        let more = tokio::select! {
            more = conn.fill() => more?,
            () = sleep_until(until), if until.is_some() => {
                if stopping {
                    return Ok(()); // the drain ran out: what is left is unanswered
                }
                continue;
            }
            _ = stop.changed(), if !stopping => continue,
        };
        if !more {
            return Err(format!(
                "the server closed the connection with {in_flight} calls in flight"
            ));
        }
        let measuring = shared.measuring.load(Ordering::Relaxed);
        conn.frames(|stream, end| done.push((stream, end)), slots)?;
        for (stream, end) in done.drain(..) {
            let Some(slot) = slots.iter_mut().find(|s| s.stream == stream && stream != 0) else {
                continue; // not ours, or already ended
            };
            in_flight -= 1;
            let (sent, status_ok, head) = (slot.sent, slot.status_ok, slot.head);
            slot.stream = 0;
            if !measuring {
                continue;
            }
            let micros = sent.map_or(0, |t| t.elapsed().as_micros());
            tally.micros.push(u32::try_from(micros).unwrap_or(u32::MAX));
            match (end, status_ok) {
                (End::Reset, _) => tally.transport_errors += 1,
                (End::Answer, Some(true)) => match head {
                    // overall_code is field 1, a varint, and prost writes fields in order:
                    // `08 <code>` after the 5-byte gRPC prefix.
                    [_, _, _, _, _, 0x08, 1] => tally.ok += 1,
                    [_, _, _, _, _, 0x08, 2] => tally.over_limit += 1,
                    _ => tally.other_code += 1,
                },
                (End::Answer, _) => tally.grpc_errors += 1,
            }
        }
    }
    if let Some(code) = conn.going_away.filter(|_| !*stop.borrow()) {
        return Err(format!("the server said GOAWAY (error code {code})"));
    }
    Ok(())
}

/// Sleeps until `at`, or forever for None (a `select!` branch then disabled).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Seconds as a `Duration`, or an error naming the flag.
fn seconds(flag: &str, s: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(s).map_err(|e| format!("{flag}: {s:e} s: {e}"))
}

/// What was measured, over how many seconds, and whether a connection ended in an error (the
/// server went away, or calls were never answered).
async fn run(args: Args) -> Result<(Tally, f64, bool), Box<dyn std::error::Error>> {
    let tasks = args.connections * args.streams;
    let (stop, stop_rx) = watch::channel(false);
    let shared = Arc::new(Shared {
        domain: args.domain.into_bytes(),
        keys: args.keys,
        key_offset: args.key_offset,
        descriptors: args.descriptors,
        streams: args.streams,
        // Each call slot sends one call per `interval` when paced.
        interval: match args.rate {
            Some(r) => Some(seconds("--rate", tasks as f64 / r)?),
            None => None,
        },
        measuring: Arc::new(AtomicBool::new(false)),
        stop: stop_rx,
    });
    let (warm_up, measured) = (
        seconds("--warm-up", args.warm_up)?,
        seconds("--seconds", args.seconds)?,
    );
    let mut handles = Vec::new();
    for c in 0..args.connections {
        let tcp = TcpStream::connect(&args.addr).await?;
        tcp.set_nodelay(true)?;
        let task = connection(tcp, args.addr.clone(), c, tasks, shared.clone());
        handles.push(tokio::spawn(task));
    }
    tokio::time::sleep(warm_up).await;
    shared.measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(measured).await;
    shared.measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let _ = stop.send(true);
    let (mut total, mut failed) = (Tally::default(), false);
    for (c, handle) in handles.into_iter().enumerate() {
        let (tally, error) = handle.await?;
        total.merge(tally);
        if let Some(e) = error {
            eprintln!("loadgen: connection {c}: {e}");
            failed = true;
        }
    }
    Ok((total, elapsed, failed))
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p * sorted.len() as f64) as usize).min(sorted.len() - 1);
    f64::from(sorted[i]) / 1000.0
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("loadgen: {e}");
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let (mut tally, elapsed, failed) = match runtime.block_on(run(args)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("loadgen: {e}");
            std::process::exit(1);
        }
    };
    tally.micros.sort_unstable();
    let calls = tally.micros.len();
    println!(
        "rate={:.0} calls={calls} p50_ms={:.3} p99_ms={:.3} p999_ms={:.3} ok={} over_limit={} \
         other_code={} grpc_errors={} transport_errors={}",
        calls as f64 / elapsed,
        percentile(&tally.micros, 0.5),
        percentile(&tally.micros, 0.99),
        percentile(&tally.micros, 0.999),
        tally.ok,
        tally.over_limit,
        tally.other_code,
        tally.grpc_errors,
        tally.transport_errors,
    );
    if failed {
        // The line above holds what was measured; the run is still not one to take.
        std::process::exit(1);
    }
}

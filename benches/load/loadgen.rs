//! The load benchmark's generator for traffic h2load cannot make: h2load sends one fixed body,
//! and the "many distinct keys" scenario needs a different counter key in every request.
//!
//! It plays h2load's part: `c` HTTP/2 connections with `m` concurrent `ShouldRateLimit` calls
//! each, pre-framed protobuf bodies, a warm-up, then a measured interval; it prints one line of
//! `key=value` pairs (rate, latency percentiles, answers by code) for `benches/load.sh`. Every
//! answer is read to its trailers, so a gRPC error is counted, never taken for a decision.
//!
//! Each request carries two descriptors, `[user=u<k>]` and `[client=c<j>]`, with `k` and `j`
//! drawn independently and uniformly from `0..keys`: `2 × keys` counters in all.
//!
//! ```sh
//! cargo run --release --example loadgen -- --addr 127.0.0.1:8081 -c 10 -m 10 --keys 100000
//! ```
//!
//! With `--rate R` the calls are paced to `R` per second in all, each task on its own fixed
//! schedule (a late call does not move the next one). Latency is measured from the moment a
//! call is sent, not from its scheduled time: tokio's timer wakes up to 1 ms late, and that
//! lateness is the generator's, not the server's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request};
use tokio::net::TcpStream;

#[derive(Debug, Clone)]
struct Args {
    addr: String,
    connections: usize,
    streams: usize,
    seconds: f64,
    warm_up: f64,
    keys: usize,
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
            "--rate" => args.rate = Some(value.parse().map_err(|e| bad(&e))?),
            "--domain" => args.domain = value,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if args.connections == 0 || args.streams == 0 || args.keys == 0 || args.seconds <= 0.0 {
        return Err("connections, streams, keys and seconds must be positive".into());
    }
    if args.rate.is_some_and(|r| r <= 0.0 || !r.is_finite()) {
        return Err("--rate must be a positive number".into());
    }
    Ok(args)
}

/// A protobuf length-delimited field.
fn field(out: &mut Vec<u8>, number: u8, data: &[u8]) {
    out.push(number << 3 | 2);
    let mut len = data.len();
    while len >= 0x80 {
        out.push((len as u8) | 0x80);
        len >>= 7;
    }
    out.push(len as u8);
    out.extend_from_slice(data);
}

/// One `descriptors` field of a `RateLimitRequest`: a descriptor of one entry.
fn descriptor_field(key: &str, value: &str) -> Vec<u8> {
    let mut entry = Vec::new();
    field(&mut entry, 1, key.as_bytes());
    field(&mut entry, 2, value.as_bytes());
    let mut desc = Vec::new();
    field(&mut desc, 1, &entry);
    let mut out = Vec::new();
    field(&mut out, 2, &desc);
    out
}

/// The encoded fields every request is assembled from: the domain, and one `user` and one
/// `client` descriptor per key.
struct Fields {
    domain: Vec<u8>,
    users: Vec<Vec<u8>>,
    clients: Vec<Vec<u8>>,
}

/// A pre-framed `RateLimitRequest` (the 5-byte gRPC prefix, then the message) from its encoded
/// `domain` field and descriptor fields.
fn framed(domain: &[u8], descriptors: &[&[u8]]) -> Bytes {
    let len = domain.len() + descriptors.iter().map(|d| d.len()).sum::<usize>();
    let mut out = Vec::with_capacity(5 + len);
    out.push(0);
    out.extend_from_slice(&u32::try_from(len).expect("small").to_be_bytes());
    out.extend_from_slice(domain);
    for d in descriptors {
        out.extend_from_slice(d);
    }
    Bytes::from(out)
}

/// xorshift64*: a cheap per-task generator for key choice (not for anything secret).
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

/// What one call answered.
enum Answer {
    /// `overall_code` of a decoded response (1 OK, 2 OVER_LIMIT).
    Code(u64),
    /// A grpc-status other than 0.
    GrpcError,
}

async fn call(
    sender: &mut h2::client::SendRequest<Bytes>,
    uri: &http::Uri,
    body: Bytes,
) -> Result<Answer, h2::Error> {
    let request = Request::builder()
        .method(Method::POST)
        .uri(uri.clone())
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a valid request");
    let ready = sender.clone().ready().await?;
    *sender = ready;
    let (response, mut stream) = sender.send_request(request, false)?;
    stream.send_data(body, true)?;
    let response = response.await?;
    let (head, mut recv) = response.into_parts();
    let mut data = Vec::new();
    while let Some(chunk) = recv.data().await {
        let chunk = chunk?;
        recv.flow_control().release_capacity(chunk.len())?;
        data.extend_from_slice(&chunk);
    }
    let trailers = recv.trailers().await?;
    let status = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| head.headers.get("grpc-status"));
    if status.is_none_or(|s| s != "0") {
        return Ok(Answer::GrpcError);
    }
    // overall_code is field 1, a varint, and prost writes fields in order: `08 <code>`.
    Ok(Answer::Code(match data.get(5..7) {
        Some([0x08, code]) => u64::from(*code),
        _ => 0,
    }))
}

async fn run(args: Args) -> Result<(Tally, f64), Box<dyn std::error::Error>> {
    let mut domain = Vec::new();
    field(&mut domain, 1, args.domain.as_bytes());
    let fields = Arc::new(Fields {
        domain,
        users: (0..args.keys)
            .map(|k| descriptor_field("user", &format!("u{k}")))
            .collect(),
        clients: (0..args.keys)
            .map(|k| descriptor_field("client", &format!("c{k}")))
            .collect(),
    });
    let uri: http::Uri = format!(
        "http://{}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        args.addr
    )
    .parse()?;
    let tasks = args.connections * args.streams;
    // Each task sends one call per `interval` when paced.
    let interval = args.rate.map(|r| Duration::from_secs_f64(tasks as f64 / r));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for c in 0..args.connections {
        let tcp = TcpStream::connect(&args.addr).await?;
        tcp.set_nodelay(true)?;
        let (sender, connection) = h2::client::handshake(tcp).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                eprintln!("loadgen: connection {c}: {e}");
            }
        });
        for s in 0..args.streams {
            let mut sender = sender.clone();
            let (fields, uri, measuring, stop) =
                (fields.clone(), uri.clone(), measuring.clone(), stop.clone());
            let task = c * args.streams + s;
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((task as u64 + 1) * 0x1000_0001));
            handles.push(tokio::spawn(async move {
                let mut tally = Tally::default();
                // Paced tasks start spread over one interval, not all at once.
                let mut next =
                    interval.map(|i| Instant::now() + i.mul_f64(task as f64 / tasks as f64));
                while !stop.load(Ordering::Relaxed) {
                    if let (Some(at), Some(i)) = (next, interval) {
                        tokio::time::sleep_until(at.into()).await;
                        next = Some(at + i);
                    }
                    let start = Instant::now();
                    let user = &fields.users[rng.below(fields.users.len())];
                    let client = &fields.clients[rng.below(fields.clients.len())];
                    let body = framed(&fields.domain, &[user, client]);
                    let answer = call(&mut sender, &uri, body).await;
                    if !measuring.load(Ordering::Relaxed) {
                        continue;
                    }
                    let micros = start.elapsed().as_micros();
                    tally.micros.push(u32::try_from(micros).unwrap_or(u32::MAX));
                    match answer {
                        Ok(Answer::Code(1)) => tally.ok += 1,
                        Ok(Answer::Code(2)) => tally.over_limit += 1,
                        Ok(Answer::Code(_)) => tally.other_code += 1,
                        Ok(Answer::GrpcError) => tally.grpc_errors += 1,
                        Err(e) => {
                            tally.transport_errors += 1;
                            if tally.transport_errors == 1 {
                                eprintln!("loadgen: {e}");
                            }
                        }
                    }
                }
                tally
            }));
        }
    }
    tokio::time::sleep(Duration::from_secs_f64(args.warm_up)).await;
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut total = Tally::default();
    for handle in handles {
        total.merge(handle.await?);
    }
    Ok((total, elapsed))
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
    let (mut tally, elapsed) = match runtime.block_on(run(args)) {
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
}

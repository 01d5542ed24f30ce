//! Export: ended spans go into a bounded queue (a span that finds it full is dropped and
//! counted, never waited for), and one task sends them to the collector in batches, each send
//! cut at a timeout. The SDK's batch processor is not used: it cannot say what it drops.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::TracingFigures;

/// What became of ended, sampled spans.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    exported: AtomicU64,
    queue_full: AtomicU64,
    export_failed: AtomicU64,
}

impl Counters {
    // Relaxed: plain event counts, read for metrics only.
    fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn figures(&self) -> TracingFigures {
        TracingFigures {
            exported: self.exported.load(Ordering::Relaxed),
            dropped_queue_full: self.queue_full.load(Ordering::Relaxed),
            dropped_export_failed: self.export_failed.load(Ordering::Relaxed),
        }
    }
}

/// The SDK's processor: ended spans into the queue.
#[derive(Debug)]
pub(crate) struct Queue {
    sender: mpsc::Sender<SpanData>,
    counters: Arc<Counters>,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _: &mut Span, _: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.sender.try_send(span).is_err() {
            Counters::add(&self.counters.queue_full, 1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// How the sending task batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Batching {
    /// Most spans waiting in the queue.
    pub(crate) queue: usize,
    /// Most spans in one export.
    pub(crate) batch: usize,
    /// Longest a span waits for its batch to fill.
    pub(crate) delay: Duration,
    /// Longest one export may take.
    pub(crate) timeout: Duration,
}

/// The queue, and the task that empties it into `exporter` until `stop`, then sends what is
/// left (the caller bounds how long that may take).
pub(crate) fn start<E: SpanExporter + 'static>(
    exporter: E,
    batching: Batching,
    counters: Arc<Counters>,
    stop: CancellationToken,
) -> (Queue, tokio::task::JoinHandle<()>) {
    let (sender, receiver) = mpsc::channel(batching.queue.max(1));
    let task = tokio::spawn(send(
        exporter,
        receiver,
        batching,
        Arc::clone(&counters),
        stop,
    ));
    (Queue { sender, counters }, task)
}

async fn send<E: SpanExporter>(
    exporter: E,
    mut receiver: mpsc::Receiver<SpanData>,
    batching: Batching,
    counters: Arc<Counters>,
    stop: CancellationToken,
) {
    let max = batching.batch.max(1);
    let mut batch = Vec::with_capacity(max);
    let mut tick = tokio::time::interval(batching.delay);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let room = max - batch.len();
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
            n = receiver.recv_many(&mut batch, room) => {
                if n == 0 {
                    break;
                }
                if batch.len() < max {
                    continue;
                }
            }
        }
        if !batch.is_empty() {
            export(&exporter, &mut batch, batching.timeout, &counters).await;
        }
    }
    // What is queued at the stop: sent in batches until the queue is empty.
    receiver.close();
    loop {
        receiver.recv_many(&mut batch, max).await;
        if batch.is_empty() {
            break;
        }
        export(&exporter, &mut batch, batching.timeout, &counters).await;
    }
    let _ = exporter.shutdown();
}

async fn export<E: SpanExporter>(
    exporter: &E,
    batch: &mut Vec<SpanData>,
    timeout: Duration,
    counters: &Counters,
) {
    let n = batch.len();
    let spans = std::mem::replace(batch, Vec::with_capacity(n));
    match tokio::time::timeout(timeout, exporter.export(spans)).await {
        Ok(Ok(())) => Counters::add(&counters.exported, n),
        Ok(Err(e)) => {
            tracing::debug!(spans = n, error = %e, "trace export failed");
            Counters::add(&counters.export_failed, n);
        }
        Err(_) => {
            tracing::debug!(
                spans = n,
                timeout_ms = timeout.as_millis(),
                "trace export timed out"
            );
            Counters::add(&counters.export_failed, n);
        }
    }
}

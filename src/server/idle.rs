//! The idle timeout of an HTTP/2 connection: a connection over which the peer has sent no
//! HEADERS or DATA frame for the timeout is ended. Frames are followed from their 9-byte headers
//! in the bytes read (decrypted ones, under TLS), so PINGs, SETTINGS and WINDOW_UPDATEs do not
//! keep a connection alive while one that carries requests is never cut. The end is reported to
//! hyper as end-of-stream, so no GOAWAY is sent; the request timeout, kept below the idle
//! timeout by settings, means no unary call is open on a connection cut as idle.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// An HTTP/2 byte stream that reports end-of-stream once the peer has sent no request frame for
/// the idle timeout (see the module header); writes pass through.
#[derive(Debug)]
pub struct IdleCut<T> {
    io: T,
    idle: Idle,
    peer: SocketAddr,
}

impl<T> IdleCut<T> {
    /// `io`, cut after `timeout` without a request frame from `peer`.
    pub fn new(io: T, timeout: Duration, peer: SocketAddr) -> Self {
        Self {
            io,
            idle: Idle::new(timeout),
            peer,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleCut<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let idle = &mut this.idle;
        if idle.expired {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let now = Instant::now();
                if idle.frames.feed(&buf.filled()[before..]) {
                    idle.last = now;
                } else if now >= idle.last + idle.timeout {
                    // Upkeep frames arriving without pause must not keep the connection either:
                    // this read is delivered, the next one ends the connection.
                    tracing::debug!(peer = %this.peer, "closing idle connection");
                    idle.expired = true;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if idle.poll_expired(cx) {
                    tracing::debug!(peer = %this.peer, "closing idle connection");
                    // End-of-stream: hyper ends the connection and drops it, closing the socket.
                    return Poll::Ready(Ok(()));
                }
                Poll::Pending
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleCut<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The idle timer of one HTTP/2 connection.
#[derive(Debug)]
struct Idle {
    timeout: Duration,
    /// When the peer last sent a HEADERS or DATA frame (or connected).
    last: Instant,
    /// Fires at `last + timeout` or earlier; moved on lazily, so activity costs no timer update.
    timer: Pin<Box<Sleep>>,
    frames: FrameScan,
    expired: bool,
}

impl Idle {
    fn new(timeout: Duration) -> Self {
        let now = Instant::now();
        Self {
            timeout,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(now + timeout)),
            frames: FrameScan::default(),
            expired: false,
        }
    }

    /// Whether the connection has now been idle for the timeout; registers a wake-up otherwise.
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let deadline = self.last + self.timeout;
            if Instant::now() >= deadline {
                self.expired = true;
                return true;
            }
            self.timer.as_mut().reset(deadline);
        }
    }
}

/// Follows the frames of an inbound HTTP/2 byte stream from their headers, without buffering
/// payloads, to tell request traffic from connection upkeep.
#[derive(Debug)]
struct FrameScan {
    /// Bytes of the client connection preface still to skip.
    preface: usize,
    head: [u8; 9],
    filled: usize,
    /// Payload bytes of the current frame still to skip.
    payload: usize,
}

impl Default for FrameScan {
    fn default() -> Self {
        Self {
            preface: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".len(),
            head: [0; 9],
            filled: 0,
            payload: 0,
        }
    }
}

impl FrameScan {
    /// HTTP/2 frame types that carry requests: DATA, HEADERS, CONTINUATION.
    const REQUEST_FRAMES: [u8; 3] = [0x0, 0x1, 0x9];

    /// Consumes the next bytes read; true when they began a frame that carries requests.
    fn feed(&mut self, mut bytes: &[u8]) -> bool {
        let mut active = false;
        while !bytes.is_empty() {
            let skip = if self.preface > 0 {
                &mut self.preface
            } else {
                &mut self.payload
            };
            if *skip > 0 {
                let n = (*skip).min(bytes.len());
                *skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (9 - self.filled).min(bytes.len());
            self.head[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
            self.filled += n;
            bytes = &bytes[n..];
            if self.filled == 9 {
                self.filled = 0;
                let [a, b, c, kind, ..] = self.head;
                self.payload = usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c);
                active |= Self::REQUEST_FRAMES.contains(&kind);
            }
        }
        active
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, 0, 0, 0, 0, 1];
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn only_request_frames_count_as_activity_however_the_bytes_are_split() {
        let mut upkeep = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        upkeep.extend(frame(0x4, &[0; 12])); // SETTINGS
        upkeep.extend(frame(0x6, &[1; 8])); // PING, whose payload holds a HEADERS type byte
        upkeep.extend(frame(0x8, &[0, 0, 1, 0])); // WINDOW_UPDATE
        let headers = frame(0x1, &[0x83; 40]);
        // Feeds every chunk (no short circuit): whether any began a request frame.
        let feed = |scan: &mut FrameScan, bytes: &[u8], split: usize| {
            bytes
                .chunks(split)
                .fold(false, |seen, c| scan.feed(c) | seen)
        };
        for split in [1, 2, 7, 9, 1_000] {
            let mut scan = FrameScan::default();
            assert!(
                !feed(&mut scan, &upkeep, split),
                "upkeep counted, split {split}"
            );
            assert!(feed(&mut scan, &headers, split), "split {split}");
            assert!(!scan.feed(&frame(0x6, &[0; 8])), "split {split}");
            assert!(scan.feed(&frame(0x0, b"body")), "DATA, split {split}");
        }
    }
}

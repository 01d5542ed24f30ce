//! The process's global allocator: mimalloc. A library does not impose one on whoever links it,
//! so this module only names the choice, and each binary declares it with
//! `#[global_allocator] static ALLOCATOR: Allocator = ALLOCATOR;`: `src/main.rs`, and
//! `benches/memory.rs` so that it measures what the server runs.
//!
//! Why mimalloc: its thread-local free lists make the many small frees of each call (nearly all
//! in h2, hyper and tonic) cheap (docs/src/benchmarks/log.md, the tuning log). The memory store keeps its
//! tables on the system allocator (see `limiter::store`), which gives them back to the kernel.

/// The global allocator's type.
pub type Allocator = mimalloc::MiMalloc;

/// The global allocator, for a binary's `#[global_allocator]` static.
pub const ALLOCATOR: Allocator = mimalloc::MiMalloc;

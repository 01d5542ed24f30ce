//! The process's global allocator: mimalloc.
//!
//! A library does not impose a global allocator on whoever links it, so this module only names
//! the choice; each binary declares it, `src/main.rs` for the server and `benches/memory.rs` for
//! the memory benchmark, so that the benchmark measures what the server runs:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: sluice::allocator::Allocator = sluice::allocator::ALLOCATOR;
//! ```
//!
//! Why mimalloc: glibc's malloc and free were about a fifth of the server's instructions per
//! call (some fifty frees, nearly all in h2, hyper and tonic); mimalloc's thread-local free lists
//! take 11 % off the whole (BENCHMARKS.md, the tuning log). Its cost was memory: the memory
//! store's tables, freed as they double, stayed resident, so the store keeps its tables on the
//! system allocator (see `limiter::store`), which gives them back to the kernel.

/// The global allocator's type.
pub type Allocator = mimalloc::MiMalloc;

/// The global allocator, for a binary's `#[global_allocator]` static.
pub const ALLOCATOR: Allocator = mimalloc::MiMalloc;

//! sluice integration tests: one binary, a module per area.
mod check;
#[cfg(feature = "client")]
mod client;
mod compat;
mod conn;
mod gcra;
mod headers;
mod helpers;
mod lab;
mod memory;
mod ops;
mod redis;
mod redis_tls;
mod service;
mod wire;

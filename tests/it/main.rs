//! sluice integration tests: one binary, a module per area.
mod check;
mod gcra;
mod headers;
mod helpers;
mod lab;
mod memory;
mod ops;
mod redis;
mod service;
mod wire;

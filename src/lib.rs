pub mod limiter;
pub mod pb;
pub mod policy;

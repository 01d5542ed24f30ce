//! The stampede lab, behind `sluice check`: what a policy promises, rule by rule.
//!
//! - `guarantee`: each limited rule's promise in numbers (`B + floor(W / T)`), beside a fixed
//!   window's worst second.
//!
//! The lab never serves and never touches a network.

pub mod guarantee;

pub use guarantee::{CheckReport, Guarantee, guarantees};

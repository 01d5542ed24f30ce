//! The Lua scripts as Redis receives them. `gcra_lean.lua`, `lease.lua` and `share.lua` start with
//! `prelude.lua` (the time, and the counter of a one-key call read as its debt), the last two then
//! `slice.lua` (tokens taken ahead), joined here at compile time; `gcra.lua` keeps exact pairs of seconds and nanoseconds, and reads its own way.
//!
//! The prelude is shared as text, not as a Lua function: Lua makes every function anew at each
//! call, which a lone request would pay for.

/// `gcra.lua`: exact over the whole range of times.
pub(super) const GCRA: &str = include_str!("gcra.lua");

/// `gcra_lean.lua` after the prelude: plain numbers, for requests that `fits_lean`.
pub(super) const LEAN: &str = concat!(include_str!("prelude.lua"), include_str!("gcra_lean.lua"));

/// `lease.lua` after the prelude and `slice.lua` (a take's tokens, and the TAT written back).
pub(super) const LEASE: &str = concat!(
    include_str!("prelude.lua"),
    include_str!("slice.lua"),
    include_str!("lease.lua")
);

/// `share.lua` after the prelude and `slice.lua`.
pub(super) const SHARE: &str = concat!(
    include_str!("prelude.lua"),
    include_str!("slice.lua"),
    include_str!("share.lua")
);

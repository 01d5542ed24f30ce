//! The Lua scripts as Redis receives them, joined from chunks at compile time. Every script but
//! `gcra.lua` (which keeps exact pairs of seconds and nanoseconds, and reads its own way) starts
//! with `now.lua` (the time, and locals for Redis's globals). `gcra_lean.lua`, `lease.lua` and
//! `share.lua` go on with `prelude.lua` (the counter of a one-key call read as its debt), the
//! last two then with `slice.lua` (tokens taken ahead); `share.lua` and `fleet.lua`, which keep
//! tables of holders' entries, with `entries.lua` (an entry read and repaired, and the
//! water-fill).
//!
//! The chunks are shared as text, not as Lua functions of one library: Lua makes every function
//! anew at each call, which a lone request would pay for.

/// `gcra.lua`: exact over the whole range of times.
pub(super) const GCRA: &str = include_str!("gcra.lua");

/// `gcra_lean.lua` after the prelude: plain numbers, for requests that `fits_lean`.
pub(super) const LEAN: &str = concat!(
    include_str!("now.lua"),
    include_str!("prelude.lua"),
    include_str!("gcra_lean.lua")
);

/// `lease.lua` after the prelude and `slice.lua` (a take's tokens, and the TAT written back).
pub(super) const LEASE: &str = concat!(
    include_str!("now.lua"),
    include_str!("prelude.lua"),
    include_str!("slice.lua"),
    include_str!("lease.lua")
);

/// `share.lua` after the prelude, `slice.lua` and `entries.lua`.
pub(super) const SHARE: &str = concat!(
    include_str!("now.lua"),
    include_str!("prelude.lua"),
    include_str!("slice.lua"),
    include_str!("entries.lua"),
    include_str!("share.lua")
);

/// `fleet.lua` after `now.lua` and `entries.lua`: no counter is read.
pub(super) const FLEET: &str = concat!(
    include_str!("now.lua"),
    include_str!("entries.lua"),
    include_str!("fleet.lua")
);

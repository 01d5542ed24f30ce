//! The compiled policies: a [`Domain`] per name, all of them in an immutable [`PolicySet`], and
//! the [`PolicyHandle`] that swaps a new set in on reload while readers keep the one they hold.
//! A domain's tree, and matching a request against it, live in `matcher`.

use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::matcher::{self, Domain};
use super::rule::Limit;

/// All loaded domains. Immutable; reloading builds a new one and swaps it in.
#[derive(Clone, Debug, Default)]
pub struct PolicySet {
    pub(super) domains: matcher::FastMap<String, Domain>,
    pub(super) files: usize,
    /// No policies were loaded yet (an xDS source before its first response), as opposed to a
    /// load that gave no domain.
    pub(super) pending: bool,
}

impl PolicySet {
    /// The set held before any policies arrived: no domain, and [`PolicySet::is_pending`].
    #[must_use]
    pub fn pending() -> Self {
        Self {
            pending: true,
            ..Self::default()
        }
    }

    /// Whether no policies were loaded yet (calls are then answered as the reference does
    /// before its first configuration).
    #[must_use]
    pub fn is_pending(&self) -> bool {
        self.pending
    }

    /// The domain named `name`.
    #[must_use]
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// All domains, sorted by name.
    #[must_use]
    pub fn domains(&self) -> Vec<&Domain> {
        let mut all: Vec<&Domain> = self.domains.values().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    /// Counts for a one-line summary.
    #[must_use]
    pub fn summary(&self) -> Summary {
        let mut s = Summary {
            files: self.files,
            domains: self.domains.len(),
            ..Summary::default()
        };
        s.costs = self.domains.values().map(|d| d.costs().count()).sum();
        for rule in self.domains.values().flat_map(Domain::rules) {
            match rule.limit {
                Limit::Unlimited => s.unlimited += 1,
                Limit::Limited(r) if r.requests_per_unit == 0 => s.bans += 1,
                Limit::Limited(_) => s.limited += 1,
            }
        }
        s
    }
}

/// Counts of what a [`PolicySet`] holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Files read.
    pub files: usize,
    /// Domains.
    pub domains: usize,
    /// Rules with a limit above zero.
    pub limited: usize,
    /// Rules with `requests_per_unit: 0`.
    pub bans: usize,
    /// Rules with `unlimited: true`.
    pub unlimited: usize,
    /// Cost nodes (not rules: they draw from an ancestor's).
    pub costs: usize,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} files, {} domains, {} rules ({} limited, {} bans, {} unlimited)",
            self.files,
            self.domains,
            self.limited + self.bans + self.unlimited,
            self.limited,
            self.bans,
            self.unlimited
        )?;
        if self.costs > 0 {
            write!(
                f,
                ", {} cost node{}",
                self.costs,
                if self.costs == 1 { "" } else { "s" }
            )?;
        }
        Ok(())
    }
}

/// The live policy set, swapped atomically on reload; readers never block.
#[derive(Debug, Clone)]
pub struct PolicyHandle(Arc<ArcSwap<PolicySet>>);

impl PolicyHandle {
    /// A handle holding `set`.
    #[must_use]
    pub fn new(set: PolicySet) -> Self {
        Self(Arc::new(ArcSwap::from_pointee(set)))
    }

    /// The current set; hold it for the whole of one request.
    #[must_use]
    pub fn load(&self) -> Arc<PolicySet> {
        self.0.load_full()
    }

    /// Replaces the current set.
    pub fn store(&self, set: PolicySet) {
        self.0.store(Arc::new(set));
    }

    /// Replaces the current set and returns the previous one (freeing a large set takes a
    /// while, so the caller chooses where that happens).
    pub fn swap(&self, set: PolicySet) -> Arc<PolicySet> {
        self.0.swap(Arc::new(set))
    }
}

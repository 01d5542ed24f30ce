//! A rate-limit request as the decision layer sees it, whatever transport it came by, and the
//! caps that keep a hostile or broken client from making one expensive. A request that breaks
//! a cap is refused with a [`RequestError`] naming what is wrong; nothing is charged for it.

use crate::policy::Unit;

/// A rate-limit request, as decoded from the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// The policy domain.
    pub domain: String,
    /// The descriptors, each decided against its own rule.
    pub descriptors: Vec<Descriptor>,
    /// The request-level cost; 0 means 1.
    pub hits_addend: u32,
}

impl Request {
    /// A request of plain descriptors, each from (key, value) entries, at the default cost
    /// (`hits_addend` 0, which counts as 1).
    #[must_use]
    pub fn from_entries(domain: &str, descriptors: &[&[(&str, &str)]]) -> Self {
        Self {
            domain: domain.into(),
            descriptors: descriptors
                .iter()
                .map(|entries| Descriptor {
                    entries: entries
                        .iter()
                        .map(|(k, v)| Entry {
                            key: (*k).into(),
                            value: (*v).into(),
                        })
                        .collect(),
                    ..Descriptor::default()
                })
                .collect(),
            hits_addend: 0,
        }
    }

    /// What descriptor `index` costs: its own `hits_addend` when set (0 = a check that consumes
    /// nothing), else the request's, where 0 means 1.
    #[must_use]
    pub fn cost(&self, index: usize) -> u64 {
        let request_cost = u64::from(self.hits_addend.max(1));
        self.descriptors
            .get(index)
            .and_then(|d| d.hits_addend)
            .unwrap_or(request_cost)
    }
}

/// One descriptor of a request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// Entries, in order; each matches one level of the policy tree.
    pub entries: Vec<Entry>,
    /// A per-request limit that replaces the configured one.
    pub limit: Option<Override>,
    /// This descriptor's cost, overriding the request's even when 0.
    pub hits_addend: Option<u64>,
    /// Refund the cost instead of charging it.
    pub is_negative_hits: bool,
}

/// One key/value entry of a descriptor.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    /// The key.
    pub key: String,
    /// The value (may be empty).
    pub value: String,
}

/// A request's own limit for one descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Override {
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

/// Caps on request size, so a hostile or broken client cannot make a request expensive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Most descriptors per request.
    pub max_descriptors: usize,
    /// Most entries per descriptor.
    pub max_entries: usize,
    /// Longest domain, in bytes.
    pub max_domain_bytes: usize,
    /// Longest entry key, in bytes.
    pub max_key_bytes: usize,
    /// Longest entry value, in bytes.
    pub max_value_bytes: usize,
}

impl Caps {
    /// Checks a request against the caps.
    ///
    /// # Errors
    ///
    /// The first [`RequestError`] found.
    pub fn validate(&self, req: &Request) -> Result<(), RequestError> {
        let caps = self;
        if req.domain.is_empty() {
            return Err(RequestError::EmptyDomain);
        }
        if req.domain.len() > caps.max_domain_bytes {
            return Err(RequestError::DomainTooLong {
                len: req.domain.len(),
                max: caps.max_domain_bytes,
            });
        }
        if req.descriptors.is_empty() {
            return Err(RequestError::NoDescriptors);
        }
        if req.descriptors.len() > caps.max_descriptors {
            return Err(RequestError::TooManyDescriptors {
                len: req.descriptors.len(),
                max: caps.max_descriptors,
            });
        }
        for (d, desc) in req.descriptors.iter().enumerate() {
            if desc.entries.is_empty() {
                return Err(RequestError::NoEntries { descriptor: d });
            }
            if desc.entries.len() > caps.max_entries {
                return Err(RequestError::TooManyEntries {
                    descriptor: d,
                    len: desc.entries.len(),
                    max: caps.max_entries,
                });
            }
            for (e, entry) in desc.entries.iter().enumerate() {
                if entry.key.is_empty() {
                    return Err(RequestError::EmptyKey {
                        descriptor: d,
                        entry: e,
                    });
                }
                for (field, len, max) in [
                    ("key", entry.key.len(), caps.max_key_bytes),
                    ("value", entry.value.len(), caps.max_value_bytes),
                ] {
                    if len > max {
                        return Err(RequestError::TooLong {
                            descriptor: d,
                            entry: e,
                            field,
                            len,
                            max,
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

impl Default for Caps {
    fn default() -> Self {
        Self {
            max_descriptors: 64,
            max_entries: 32,
            max_domain_bytes: 256,
            max_key_bytes: 256,
            max_value_bytes: 4096,
        }
    }
}

/// Why a request is refused as malformed. Nothing is charged for it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The domain is empty.
    #[error("rate limit domain must not be empty")]
    EmptyDomain,
    /// The domain is longer than allowed.
    #[error("domain is {len} bytes, more than the {max} allowed")]
    DomainTooLong {
        /// Its length.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// There are no descriptors.
    #[error("rate limit descriptor list must not be empty")]
    NoDescriptors,
    /// There are more descriptors than allowed.
    #[error("{len} descriptors, more than the {max} allowed")]
    TooManyDescriptors {
        /// How many.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// A descriptor has no entries.
    #[error("descriptors[{descriptor}] has no entries")]
    NoEntries {
        /// Its index.
        descriptor: usize,
    },
    /// A descriptor has more entries than allowed.
    #[error("descriptors[{descriptor}] has {len} entries, more than the {max} allowed")]
    TooManyEntries {
        /// Its index.
        descriptor: usize,
        /// How many.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// An entry's key is empty.
    #[error("descriptors[{descriptor}].entries[{entry}] has an empty key")]
    EmptyKey {
        /// Descriptor index.
        descriptor: usize,
        /// Entry index.
        entry: usize,
    },
    /// A `RateLimitOverride` names no known unit.
    #[error("descriptors[{descriptor}].limit.unit {value} is not a unit (expected SECOND..YEAR)")]
    UnknownUnit {
        /// Descriptor index.
        descriptor: usize,
        /// The value sent.
        value: i32,
    },
    /// An entry's key or value is longer than allowed.
    #[error(
        "descriptors[{descriptor}].entries[{entry}].{field} is {len} bytes, more than the {max} allowed"
    )]
    TooLong {
        /// Descriptor index.
        descriptor: usize,
        /// Entry index.
        entry: usize,
        /// `key` or `value`.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The cap.
        max: usize,
    },
}

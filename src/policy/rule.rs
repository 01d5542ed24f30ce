//! What a compiled policy is made of: units, rates, limits, rules and cost nodes, as matching
//! hands them to the decision. Plain values; `compile` builds them, nothing here reads YAML.

use crate::limiter::Quota;
use crate::limiter::gcra::NANOS_PER_SEC;

/// A descriptor's `metadata` map, as JSON values (the reference turns it into a protobuf
/// `Struct`; JSON is the same data model without the transport).
pub type Metadata = serde_json::Map<String, serde_json::Value>;

/// A time unit of `rate_limit.unit`. Months are 30 days and years 365, as in Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3 600 s.
    Hour,
    /// 86 400 s.
    Day,
    /// 604 800 s.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// Parses a unit name, ignoring case.
    #[must_use]
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name.to_ascii_lowercase().as_str() {
            "second" => Self::Second,
            "minute" => Self::Minute,
            "hour" => Self::Hour,
            "day" => Self::Day,
            "week" => Self::Week,
            "month" => Self::Month,
            "year" => Self::Year,
            _ => return None,
        })
    }

    /// The unit's length in seconds.
    #[must_use]
    pub const fn seconds(self) -> u64 {
        match self {
            Self::Second => 1,
            Self::Minute => 60,
            Self::Hour => 3_600,
            Self::Day => 86_400,
            Self::Week => 604_800,
            Self::Month => 2_592_000,
            Self::Year => 31_536_000,
        }
    }

    /// The unit's upper-case name, as Envoy spells it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Second => "SECOND",
            Self::Minute => "MINUTE",
            Self::Hour => "HOUR",
            Self::Day => "DAY",
            Self::Week => "WEEK",
            Self::Month => "MONTH",
            Self::Year => "YEAR",
        }
    }
}

/// A limited rate, as configured and as compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    /// `requests_per_unit` (0 bans).
    pub requests_per_unit: u32,
    /// `unit`.
    pub unit: Unit,
    /// `unit_multiplier`: the period is `unit × unit_multiplier`.
    pub unit_multiplier: u32,
    /// `burst`: the bucket capacity (defaults to `requests_per_unit`).
    pub burst: u32,
    /// Whether `burst` was written in the policy (false: inherited from `requests_per_unit`).
    pub burst_set: bool,
    /// `delay`: the longest a request that does not fit now may be held for its slot, in
    /// nanoseconds. 0 (the default, and the reference's behaviour): refused at once.
    pub max_delay_nanos: u64,
    /// The compiled quota.
    pub quota: Quota,
}

impl Rate {
    /// A rate of `requests_per_unit` per `unit` with the burst equal to it, as a request's
    /// `RateLimitOverride` asks for.
    #[must_use]
    pub fn per_unit(requests_per_unit: u32, unit: Unit) -> Self {
        let r = u64::from(requests_per_unit);
        let quota = Quota::new(unit.seconds() * NANOS_PER_SEC, r, r)
            .unwrap_or_else(|_| Quota::ban(unit.seconds() * NANOS_PER_SEC));
        Self {
            requests_per_unit,
            unit,
            unit_multiplier: 1,
            burst: requests_per_unit,
            burst_set: false,
            max_delay_nanos: 0,
            quota,
        }
    }
}

/// What a rule allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// `unlimited: true`: always OK, never counted.
    Unlimited,
    /// A GCRA limit.
    Limited(Rate),
}

/// A compiled `rate_limit` and the flags of its descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Stable identity: a hash of the domain and the descriptor path (keys and configured
    /// values). Unchanged across reloads while the path is unchanged, so counters survive.
    pub id: u128,
    /// Where it is in its file, e.g. `descriptors[1].descriptors[0]`, or for an entry of
    /// `rate_limits` e.g. `descriptors[1].rate_limits[0]`.
    pub path: String,
    /// The reference's stats key, e.g. `edge.generic_key_api.api_key`.
    pub stats_key: String,
    /// The levels of the stats key after the domain (`key_value`, or `key` for a key-only
    /// level), e.g. `["generic_key_api", "api_key"]`: the metric labels `key1`, `key2`.
    pub levels: Vec<String>,
    /// The limit.
    pub limit: Limit,
    /// `rate_limit.name`.
    pub name: Option<String>,
    /// `rate_limit.replaces[].name`.
    pub replaces: Vec<String>,
    /// `shadow_mode`.
    pub shadow_mode: bool,
    /// `quota_mode`.
    pub quota_mode: bool,
    /// `detailed_metric`.
    pub detailed_metric: bool,
    /// `value_to_metric`.
    pub value_to_metric: bool,
    /// For one of several limits of a node (`rate_limits` with two or more entries): the entry's
    /// name, which sets its `/rlconfig` line and metric labels apart from its siblings'.
    pub entry: Option<String>,
}

impl Rule {
    /// The stats key, with the entry's name in brackets for one of several limits of a node,
    /// e.g. `edge.user[user_day]`.
    #[must_use]
    pub fn qualified_key(&self) -> String {
        match &self.entry {
            Some(name) => format!("{}[{name}]", self.stats_key),
            None => self.stats_key.clone(),
        }
    }
}

/// A cost node: a descriptor with `cost` and no limit of its own, drawing `cost` tokens per hit
/// from the limits of its nearest ancestor that has any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cost {
    /// Tokens per hit (at least 1, at most the ancestor's smallest burst).
    pub cost: u64,
    /// Where it is in its file.
    pub path: String,
    /// Its stats key, e.g. `edge.user.route_search`.
    pub stats_key: String,
    /// The stats key of the ancestor whose buckets it draws from, e.g. `edge.user`.
    pub of: String,
}

//! The use case "may this request through?", free of any transport: [`Decider::decide`] takes a
//! [`Request`] and gives a [`Decision`] (or a [`DecideError`]). It owns the whole path: validate
//! against the caps, load the policy snapshot once, match (`plan`), count through the
//! [`Backend`], apply the operator's answer when the backend cannot decide, aggregate, build the
//! response headers, and record the metrics. The gRPC and JSON adapters only convert to and from
//! their wire forms and map errors.

mod counters;
pub mod headers;
mod metadata;
mod plan;
mod request;

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use serde::{Deserialize, Serialize};

use crate::limiter::{Backend, BackendError, Batch, Charge, LocalFallback, Op, Source};
use crate::metrics::{Metrics, RequestOutcome, RuleHit, Seen};
use crate::policy::{PolicyHandle, Rate, Rule};
pub use counters::{Counter, CounterError, CounterState};
pub use headers::{HeaderMode, HeaderOptions, LegacyNames};
use plan::{DescriptorPlan, Plan};
pub use request::{Caps, Descriptor, Entry, Override, Request, RequestError};

/// The answer when the backend cannot decide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OnBackendError {
    /// Answer OK (fail open).
    Allow,
    /// Answer OVER_LIMIT (fail closed).
    Deny,
    /// Answer gRPC UNAVAILABLE, so Envoy's `failure_mode_deny` decides.
    #[default]
    Error,
    /// Count in this node's memory at its share of each rate (rate/N, burst ceil(B/N)) until
    /// Redis answers again.
    Local,
}

/// How the decider answers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Request size caps.
    pub caps: Caps,
    /// Global shadow mode: never refuse, report as usual.
    pub shadow_mode: bool,
    /// Global quota mode (envoyproxy/ratelimit's `QUOTA_MODE`): every limited rule counts as
    /// `quota_mode`, so a request is refused only when all its quota descriptors are over.
    pub quota_mode: bool,
    /// The answer when the backend cannot decide.
    pub on_backend_error: OnBackendError,
    /// Fill [`Decision::dynamic_metadata`], in envoyproxy/ratelimit's shape.
    pub dynamic_metadata: bool,
    /// Response headers and bodies to add.
    pub headers: HeaderOptions,
    /// Fill [`Decision::trace`], for the trace of the call.
    pub traced: bool,
}

/// OK or over the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Within the limit.
    Ok,
    /// Over the limit.
    OverLimit,
}

/// Who answered a request's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AnsweredBy {
    /// Nobody: no counter applied (an unknown domain, no matching rule), or the request was
    /// refused before counting.
    #[default]
    None,
    /// The in-memory store.
    Memory,
    /// Redis.
    Redis,
    /// This node's leases of hot counters.
    Lease,
    /// The local store of `on_backend_error: local`, while Redis cannot decide.
    Local,
    /// Nobody could: the backend failed and `on_backend_error` answered `allow` or `deny`.
    Fallback,
}

impl AnsweredBy {
    /// Its lowercase name, as traces carry it.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Memory => "memory",
            Self::Redis => "redis",
            Self::Lease => "lease",
            Self::Local => "local",
            Self::Fallback => "fallback",
        }
    }
}

/// The answer for a whole request. It owns what it reports (the applied rule is shared, not
/// borrowed), so it outlives the snapshot it was decided on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request may go through.
    pub overall: Code,
    /// One status per request descriptor, in order.
    pub statuses: Vec<Status>,
    /// Response header fields to add, (name, value) in order (see [`headers`]).
    pub headers: Vec<(String, String)>,
    /// A body for a denial (`raw_body` on gRPC), empty for none.
    pub body: Vec<u8>,
    /// With [`Options::dynamic_metadata`], the response's dynamic metadata in
    /// envoyproxy/ratelimit's shape: `domain`, `descriptors` (each `entries` as `"key=value"`,
    /// an override as `limit` text, its own `hitsAddend` when set), the request's `hitsAddend`
    /// when not 0, and `metadata`, the merged `metadata` of the rules whose descriptors passed
    /// (first value wins), when not empty. `None` when off.
    pub dynamic_metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// With [`Options::traced`]: what the call's trace says of the decision. Boxed, so that
    /// an untraced decision, moved on every call, stays small.
    pub trace: Option<Box<DecisionTrace>>,
    /// Admitted at a slot still ahead: how long the answer is held, and what giving the slot
    /// back takes. `None` for an answer given at once. Boxed, as `trace`.
    pub hold: Option<Box<Held>>,
}

/// An admitted request whose answer waits for its slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// Nanoseconds from the decision to the slot.
    pub nanos: u64,
    /// The request's charges as refunds: what gives its slot back.
    refunds: Vec<Op>,
    /// The descriptors that wait for a slot.
    descriptors: Vec<usize>,
}

impl Held {
    /// The hold of an admitted `plan`, `nanos` long.
    fn of(plan: &Plan<'_>, batch: &Batch, nanos: u64) -> Self {
        // A refund's debt cap keeps the rule's whole delay, not the part this request could
        // wait, so that giving one slot back never cuts the later slots others hold.
        let refunds = plan
            .ops
            .iter()
            .zip(&plan.applied)
            .zip(&batch.outcomes)
            .filter(|((op, _), o)| op.charge == Charge::Ask && o.admitted && op.cost > 0)
            .map(|((op, applied), _)| Op {
                charge: Charge::Refund,
                quota: op.quota.with_max_delay(applied.rate.max_delay_nanos),
                ..*op
            })
            .collect();
        let descriptors = plan
            .descriptors
            .iter()
            .enumerate()
            .filter_map(|(i, planned)| match *planned {
                DescriptorPlan::Counted { start, end, .. } => batch.outcomes[start..end]
                    .iter()
                    .any(|o| o.admitted && o.hold > 0)
                    .then_some(i),
                _ => None,
            })
            .collect();
        Self {
            nanos,
            refunds,
            descriptors,
        }
    }
}

/// What a call's trace says of its decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionTrace {
    /// Who answered its counters.
    pub answered_by: AnsweredBy,
    /// When the decision began and ended waiting on a Redis round trip.
    pub redis_round_trip: Option<(SystemTime, SystemTime)>,
}

/// The answer for one descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// This descriptor's code.
    pub code: Code,
    /// The limit applied; `None` when no rule applied or the rule is unlimited.
    pub limit: Option<AppliedLimit>,
    /// Requests left (4294967295 for unlimited, 0 when no rule applied).
    pub remaining: u32,
    /// Whole seconds, rounded up: until the bucket is full again when admitted, until this
    /// request would be admitted when over. `None` when no limit applied.
    pub reset_seconds: Option<u64>,
}

impl Status {
    /// The status of a descriptor no rule applies to.
    const UNMATCHED: Self = Self {
        code: Code::Ok,
        limit: None,
        remaining: 0,
        reset_seconds: None,
    };
}

/// The limit a status reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppliedLimit {
    /// The rate.
    pub rate: Rate,
    /// The rule, or `None` for a request's override.
    pub rule: Option<Arc<Rule>>,
}

impl AppliedLimit {
    /// The rule's name, empty when it has none.
    #[must_use]
    pub fn name(&self) -> &str {
        self.rule
            .as_ref()
            .and_then(|r| r.name.as_deref())
            .unwrap_or("")
    }
}

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The request is malformed; nothing was charged.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The backend could not decide and the operator chose to answer with an error.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// No policies were loaded yet (an xDS source before its first response).
    #[error("no rate limit configuration loaded")]
    NoPolicies,
}

/// The decision use case over live policies and one backend.
#[derive(Debug, Clone)]
pub struct Decider {
    policies: PolicyHandle,
    backend: Backend,
    metrics: Arc<Metrics>,
    /// Shared, so that a clone (one per `/json` request, for one) copies no header names.
    options: Arc<Options>,
    /// With a Redis backend: the node's mode and who answered, and the local store
    /// `on_backend_error: local` counts in.
    local: Option<Arc<LocalFallback>>,
}

impl Decider {
    /// A decider over `policies`, counting in `backend`, recording into `metrics`.
    #[must_use]
    pub fn new(
        policies: PolicyHandle,
        backend: Backend,
        metrics: Arc<Metrics>,
        options: Options,
    ) -> Self {
        Self {
            policies,
            backend,
            metrics,
            options: Arc::new(options),
            local: None,
        }
    }

    /// This decider, keeping its backend mode and decision counts in `local`, and counting
    /// there while the backend cannot decide when `on_backend_error` is `local`.
    #[must_use]
    pub fn with_local(mut self, local: Arc<LocalFallback>) -> Self {
        self.local = Some(local);
        self
    }

    /// The local fallback, when there is one.
    #[must_use]
    pub fn local(&self) -> Option<&Arc<LocalFallback>> {
        self.local.as_ref()
    }

    /// Decides `req` on one policy snapshot and counts what it did.
    ///
    /// # Errors
    ///
    /// [`DecideError::Request`] for a malformed request (nothing is charged), or
    /// [`DecideError::Backend`] when the backend fails and `on_backend_error` is `error` (or
    /// `local` on a decider without a local fallback).
    pub async fn decide(&self, req: &Request) -> Result<Decision, DecideError> {
        self.decide_within(req, || 0).await
    }

    /// As [`Decider::decide`], for a caller that can hold its answer for up to `max_hold()`
    /// nanoseconds: a rule with a `delay` admits a request that does not fit now at its slot
    /// when that comes within both its delay and `max_hold()`, and the decision says how long
    /// to hold the answer ([`Decision::hold`]); past either, the request is refused as without a
    /// delay. `max_hold` is asked at most once, and only for a request an enforced delaying rule
    /// matched, so a caller can reserve its room for the hold there; 0 holds nothing.
    ///
    /// # Errors
    ///
    /// As [`Decider::decide`].
    pub async fn decide_within(
        &self,
        req: &Request,
        max_hold: impl FnOnce() -> u64,
    ) -> Result<Decision, DecideError> {
        let start = Instant::now();
        if let Err(e) = self.options.caps.validate(req) {
            self.metrics.request(RequestOutcome::Invalid);
            return Err(e.into());
        }
        let policies = self.policies.load();
        if policies.is_pending() {
            return Err(DecideError::NoPolicies);
        }
        let Some(domain) = policies.domain(&req.domain) else {
            let mut decision =
                self.respond(Code::Ok, vec![Status::UNMATCHED; req.descriptors.len()]);
            if self.options.dynamic_metadata {
                decision.dynamic_metadata = Some(metadata::build(req, []));
            }
            self.metrics.request(RequestOutcome::Ok);
            self.metrics
                .domain_not_found(&req.domain, req.descriptors.len() as u64);
            self.metrics.decided(start.elapsed());
            return Ok(decision);
        };
        let mut plan = plan::plan(
            req,
            domain,
            (self.options.shadow_mode, self.options.quota_mode),
        );
        plan::cut_delays(&mut plan, max_hold);
        let waiting = self.options.traced.then(SystemTime::now);
        let mut redis_round_trip = None;
        let (batch, answered_by) = match self.backend.count_from(&plan.ops).await {
            Ok((b, source)) => {
                if let (Some(start), Source::Redis) = (waiting, source) {
                    redis_round_trip = Some((start, SystemTime::now()));
                }
                // A request without ops never reached the backend: it says nothing of Redis.
                if !plan.ops.is_empty() {
                    self.answered();
                }
                let by = match source {
                    Source::None => AnsweredBy::None,
                    Source::Memory => AnsweredBy::Memory,
                    Source::Redis | Source::RedisCache => AnsweredBy::Redis,
                    Source::Lease => AnsweredBy::Lease,
                };
                (b, by)
            }
            Err(e) => {
                tracing::debug!(domain = %req.domain, error = %e.detail(), "backend failed");
                self.metrics.request(RequestOutcome::BackendError);
                match (self.options.on_backend_error, &self.local) {
                    (OnBackendError::Allow, _) => {
                        (Batch::fallback(&plan.ops, true), AnsweredBy::Fallback)
                    }
                    (OnBackendError::Deny, _) => {
                        (Batch::fallback(&plan.ops, false), AnsweredBy::Fallback)
                    }
                    (OnBackendError::Local, Some(local)) => {
                        if let Some(n) = local.enter() {
                            tracing::warn!(fleet_size = n, reason = %e.detail(), "redis cannot decide; counting locally at rate/N with burst ceil(B/N)");
                        }
                        (local.count(&plan.ops), AnsweredBy::Local)
                    }
                    (OnBackendError::Error | OnBackendError::Local, _) => return Err(e.into()),
                }
            }
        };
        let (overall, statuses) = plan::finish(&plan, &batch, self.options.shadow_mode);
        let mut decision = self.respond(overall, statuses);
        let hold = plan::hold(&plan, &batch, self.options.shadow_mode);
        if hold > 0 {
            decision.hold = Some(Box::new(Held::of(&plan, &batch, hold)));
        }
        if self.options.traced {
            decision.trace = Some(Box::new(DecisionTrace {
                answered_by,
                redis_round_trip,
            }));
        }
        if self.options.dynamic_metadata {
            let passed =
                plan.descriptors
                    .iter()
                    .zip(&decision.statuses)
                    .map(|(planned, status)| match *planned {
                        DescriptorPlan::Counted { metadata, .. } if status.code == Code::Ok => {
                            metadata
                        }
                        _ => None,
                    });
            decision.dynamic_metadata = Some(metadata::build(req, passed));
        }
        self.record(req, &plan, &batch, &decision, start);
        self.metrics.decided(start.elapsed());
        tracing::debug!(domain = %req.domain, overall = ?decision.overall, "decided");
        Ok(decision)
    }

    /// The backend answered a request: counted, and when the node counted locally and Redis
    /// itself answered (not only its over-limit cache), back to shared counting.
    fn answered(&self) {
        let Some(local) = &self.local else {
            return;
        };
        local.answered_by_redis();
        let redis_answered = match &self.backend {
            Backend::Redis(redis) => redis.answering(),
            Backend::Leased(leased) => leased.redis().answering(),
            Backend::Memory { .. } => true,
        };
        if local.is_local() && redis_answered && local.leave() {
            tracing::warn!(
                fleet_size = local.fleet_size(),
                "redis answers again; back to shared counting"
            );
        }
    }

    /// The metrics it records into, for what its transports count around it.
    #[must_use]
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Counts a request that could not even be read (a transport's decoding failed).
    pub fn count_malformed(&self) {
        self.metrics.request(RequestOutcome::Invalid);
    }

    /// A held decision refused instead, `left` nanoseconds before its slot (the server drains):
    /// OVER_LIMIT, each held descriptor refused with the wait still ahead of it, headers and
    /// body made again. With the in-memory backend its charges are given back, so the slot is
    /// free for another request; elsewhere (Redis, leases) the slot stays spent, which can only
    /// refuse more, never admit more.
    pub async fn refuse_held(&self, mut decision: Decision, left: u64) -> Decision {
        let Some(held) = decision.hold.take() else {
            return decision;
        };
        if matches!(self.backend, Backend::Memory { .. })
            && let Err(e) = self.backend.count(&held.refunds).await
        {
            tracing::debug!(error = %e.detail(), "a held request's slot was not given back");
        }
        let wait = Some(left.div_ceil(crate::limiter::gcra::NANOS_PER_SEC));
        decision.overall = Code::OverLimit;
        for &i in &held.descriptors {
            if let Some(status) = decision.statuses.get_mut(i) {
                status.code = Code::OverLimit;
                status.reset_seconds = status.reset_seconds.max(wait);
            }
        }
        headers::add(&mut decision, &self.options.headers);
        decision
    }

    /// The decision with its headers and body.
    fn respond(&self, overall: Code, statuses: Vec<Status>) -> Decision {
        let mut decision = Decision {
            overall,
            statuses,
            headers: Vec::new(),
            body: Vec::new(),
            dynamic_metadata: None,
            trace: None,
            hold: None,
        };
        headers::add(&mut decision, &self.options.headers);
        decision
    }

    /// Records the request's outcome and each counted descriptor's hits, per rule and among
    /// the rule's heaviest keys (by the entries its counter depends on, the rule's depth).
    fn record(
        &self,
        req: &Request,
        plan: &Plan<'_>,
        batch: &Batch,
        decision: &Decision,
        at: Instant,
    ) {
        self.metrics.request(match decision.overall {
            Code::Ok => RequestOutcome::Ok,
            Code::OverLimit => RequestOutcome::OverLimit,
        });
        for (desc, planned) in req.descriptors.iter().zip(&plan.descriptors) {
            let DescriptorPlan::Counted { start, end, .. } = *planned else {
                continue;
            };
            for i in start..end {
                let (op, outcome) = (&plan.ops[i], &batch.outcomes[i]);
                let plan::Applied {
                    rate,
                    rule: Some(rule),
                } = plan.applied[i]
                else {
                    continue;
                };
                if op.is_refund() {
                    continue;
                }
                let value = |i: usize| {
                    desc.entries
                        .get(i)
                        .map(|e| (e.key.as_str(), e.value.as_str()))
                };
                self.metrics.rule_hit(&RuleHit {
                    domain: &req.domain,
                    rule,
                    values: [value(0), value(1)],
                    // The rule's own depth: a cost node's request is deeper than its ancestor.
                    depth: rule.levels.len(),
                    hits: op.cost,
                    spent: op.charge == Charge::Spent,
                    denied: !outcome.admitted,
                    remaining: outcome.remaining.min(u64::from(u32::MAX)),
                    burst: u64::from(rate.burst),
                });
                let depth = rule.levels.len();
                self.metrics.hitters().record(
                    &Seen {
                        domain: &req.domain,
                        rule,
                        entries: desc
                            .entries
                            .iter()
                            .take(depth)
                            .map(|e| (e.key.as_str(), e.value.as_str())),
                        hits: op.cost,
                        denied: !outcome.admitted,
                        remaining: outcome.remaining,
                        wait: outcome.wait,
                    },
                    at,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The decision rules on the in-memory backend at a hand-driven clock (a Redis never
    //! connected for a failing backend), with no transport: global quota and shadow modes,
    //! caps, `replaces`, several limits and cost nodes charged all or nothing, hits_addend,
    //! dynamic metadata, headers, and the answer when the backend cannot decide. The wire form
    //! of a decision is `tests/it/service.rs`'s, matching the policy tests', GCRA's arithmetic
    //! `tests/it/gcra.rs`'s.

    use super::*;
    use crate::limiter::gcra::NANOS_PER_SEC;
    use crate::limiter::{ManualClock, MemoryStore, RedisConfig, RedisStore, RedisTime};
    use crate::policy::load_str;

    const POLICY: &str = r"
domain: d
descriptors:
  - key: a
    rate_limit: {name: broad, unit: minute, requests_per_unit: 1}
  - key: b
    rate_limit: {replaces: [{name: broad}], unit: minute, requests_per_unit: 5}
";

    fn decider(backend: Backend, options: Options) -> Decider {
        decider_of(POLICY, backend, options)
    }

    fn decider_of(policy: &str, backend: Backend, options: Options) -> Decider {
        let set = load_str(&[("p.yaml", policy)]).unwrap();
        Decider::new(
            PolicyHandle::new(set),
            backend,
            Arc::new(Metrics::install(10)),
            options,
        )
    }

    fn memory() -> Backend {
        Backend::memory(MemoryStore::new(), Arc::new(ManualClock::new(1 << 40)))
    }

    /// A Redis backend that was never connected: every call fails at once, no socket opened.
    fn unreachable() -> Backend {
        let config = RedisConfig {
            urls: vec!["redis://127.0.0.1:1".into()],
            cluster: false,
            key_prefix: "t:".into(),
            timeout: std::time::Duration::from_millis(5),
            connect_timeout: std::time::Duration::from_millis(5),
            breaker_failures: 0,
            breaker_cooldown: std::time::Duration::from_millis(5),
            deny_cache_keys: 0,
            sentinel: None,
            tls: crate::limiter::redis::RedisTls::default(),
            auth: crate::limiter::redis::RedisAuth::default(),
        };
        Backend::Redis(
            RedisStore::new(config, Arc::new(ManualClock::new(0)), RedisTime::Server).unwrap(),
        )
    }

    fn req(descs: &[&[(&str, &str)]]) -> Request {
        Request::from_entries("d", descs)
    }

    fn now<T>(f: impl std::future::Future<Output = T>) -> T {
        use futures_util::FutureExt;
        f.now_or_never().expect("no await on the memory path")
    }

    #[test]
    fn global_quota_mode_refuses_only_when_every_quota_descriptor_is_over() {
        let policy = r"
domain: d
descriptors:
  - key: x
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: y
    rate_limit: {unit: minute, requests_per_unit: 2}
";
        let decider = |quota_mode| {
            let options = Options {
                quota_mode,
                ..Options::default()
            };
            decider_of(policy, memory(), options)
        };
        let both = req(&[&[("x", "1")], &[("y", "1")]]);
        let d = decider(true);
        assert_eq!(now(d.decide(&both)).unwrap().overall, Code::Ok);
        // x is over, y still fits: admitted, x reported over.
        let second = now(d.decide(&both)).unwrap();
        assert_eq!(second.overall, Code::Ok);
        assert_eq!(
            (second.statuses[0].code, second.statuses[1].code),
            (Code::OverLimit, Code::Ok)
        );
        // Both over: refused.
        assert_eq!(now(d.decide(&both)).unwrap().overall, Code::OverLimit);
        // Without the switch the second request is refused by x alone.
        let d = decider(false);
        assert_eq!(now(d.decide(&both)).unwrap().overall, Code::Ok);
        assert_eq!(now(d.decide(&both)).unwrap().overall, Code::OverLimit);
    }

    #[test]
    fn caps_are_enforced_before_anything_is_counted() {
        let d = decider(
            memory(),
            Options {
                caps: Caps {
                    max_descriptors: 1,
                    max_entries: 1,
                    max_domain_bytes: 3,
                    max_key_bytes: 2,
                    max_value_bytes: 2,
                },
                ..Options::default()
            },
        );
        let err = |r: Request| now(d.decide(&r)).unwrap_err().to_string();
        let r = |domain: &str, descs: &[&[(&str, &str)]]| Request::from_entries(domain, descs);
        assert_eq!(
            err(r("", &[&[("a", "b")]])),
            "rate limit domain must not be empty"
        );
        assert_eq!(
            err(r("abcd", &[&[("a", "b")]])),
            "domain is 4 bytes, more than the 3 allowed"
        );
        assert_eq!(
            err(r("d", &[])),
            "rate limit descriptor list must not be empty"
        );
        assert!(err(r("d", &[&[("a", "b")], &[("a", "b")]])).contains("2 descriptors"));
        assert_eq!(err(r("d", &[&[]])), "descriptors[0] has no entries");
        assert!(err(r("d", &[&[("a", "b"), ("c", "d")]])).contains("2 entries"));
        assert_eq!(
            err(r("d", &[&[("", "b")]])),
            "descriptors[0].entries[0] has an empty key"
        );
        assert_eq!(
            err(r("d", &[&[("a", "bcd")]])),
            "descriptors[0].entries[0].value is 3 bytes, more than the 2 allowed"
        );
        // The one valid request is charged: the bucket of 1 per minute is then empty.
        assert_eq!(
            now(d.decide(&r("d", &[&[("a", "x")]]))).unwrap().overall,
            Code::Ok
        );
        assert_eq!(
            now(d.decide(&r("d", &[&[("a", "x")]]))).unwrap().overall,
            Code::OverLimit
        );
    }

    #[test]
    fn replaces_drops_the_named_rule() {
        let d = decider(memory(), Options::default());
        let decision = now(d.decide(&req(&[&[("a", "x")], &[("b", "y")]]))).unwrap();
        assert_eq!(decision.statuses[0].limit, None);
        assert_eq!(decision.statuses[0].remaining, 0);
        assert_eq!(decision.statuses[1].remaining, 4);
        assert_eq!(
            decision.statuses[1]
                .limit
                .as_ref()
                .unwrap()
                .rate
                .requests_per_unit,
            5
        );
    }

    #[test]
    fn an_unknown_domain_is_ok_and_counts_nothing() {
        let d = decider(memory(), Options::default());
        let decision = now(d.decide(&Request::from_entries("nope", &[&[("a", "x")]]))).unwrap();
        assert_eq!(decision.overall, Code::Ok);
        assert_eq!(decision.statuses, vec![Status::UNMATCHED]);
    }

    #[tokio::test]
    async fn a_failed_backend_gets_the_operators_answer() {
        let r = req(&[&[("a", "x")]]);
        let answer = |on_backend_error| {
            decider(
                unreachable(),
                Options {
                    on_backend_error,
                    ..Options::default()
                },
            )
        };
        let err = answer(OnBackendError::Error).decide(&r).await.unwrap_err();
        assert!(
            matches!(err, DecideError::Backend(BackendError::NotConnected)),
            "{err:?}"
        );
        let allowed = answer(OnBackendError::Allow).decide(&r).await.unwrap();
        assert_eq!(allowed.overall, Code::Ok);
        assert_eq!(allowed.statuses[0].code, Code::Ok);
        let denied = answer(OnBackendError::Deny).decide(&r).await.unwrap();
        assert_eq!(denied.overall, Code::OverLimit);
        assert_eq!(denied.statuses[0].code, Code::OverLimit);
        // One per minute: the emission interval, 60 s, is the wait.
        assert_eq!(denied.statuses[0].reset_seconds, Some(60));
        // A request that matches nothing never asks the backend, so it is decided even now.
        let unmatched = answer(OnBackendError::Error)
            .decide(&req(&[&[("zzz", "x")]]))
            .await
            .unwrap();
        assert_eq!(unmatched.overall, Code::Ok);
    }

    #[tokio::test]
    async fn local_mode_counts_at_the_nodes_share_while_redis_cannot_decide() {
        use crate::limiter::BackendMode;
        let clock = Arc::new(ManualClock::new(1 << 40));
        let local = Arc::new(LocalFallback::new(
            MemoryStore::new(),
            clock.clone(),
            Some(2),
        ));
        let options = Options {
            on_backend_error: OnBackendError::Local,
            ..Options::default()
        };
        let d = decider(unreachable(), options.clone()).with_local(Arc::clone(&local));
        // `b`: 5 a minute, so T = 12 s and B = 5; on one of two nodes T·N = 24 s, ceil(5/2) = 3.
        let r = req(&[&[("b", "x")]]);
        for left in [2, 1, 0] {
            let decision = d.decide(&r).await.unwrap();
            assert_eq!(
                first(&decision),
                (
                    Code::Ok,
                    String::new(),
                    left,
                    Some(72 - 24 * u64::from(left))
                )
            );
        }
        let over = d.decide(&r).await.unwrap();
        assert_eq!(over.overall, Code::OverLimit);
        assert_eq!(
            over.statuses[0].reset_seconds,
            Some(24),
            "one local interval"
        );
        clock.advance(24 * NANOS_PER_SEC);
        assert_eq!(d.decide(&r).await.unwrap().overall, Code::Ok);
        let figures = local.figures();
        assert_eq!(figures.mode, BackendMode::Local);
        assert_eq!(
            (figures.by_local, figures.by_redis, figures.fleet_size),
            (5, 0, 2)
        );
        // A request that matches nothing asks no store and changes no mode.
        d.decide(&req(&[&[("zzz", "x")]])).await.unwrap();
        assert_eq!(local.figures().by_local, 5);
        // Without a local store, `local` can only answer with the error.
        let bare = decider(unreachable(), options);
        assert!(matches!(
            bare.decide(&r).await,
            Err(DecideError::Backend(BackendError::NotConnected))
        ));
    }

    const LAYERED: &str = r"
domain: d
descriptors:
  - key: user
    rate_limits:
      - {name: per_second, unit: second, requests_per_unit: 3}
      - {name: per_day, unit: day, requests_per_unit: 4}
  - key: acct
    rate_limit: {name: budget, unit: minute, requests_per_unit: 100, burst: 20}
    descriptors:
      - key: route
        value: search
        cost: 10
      - key: route
        value: item
        cost: 1
";

    fn layered(options: Options) -> (Decider, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1 << 40));
        let set = load_str(&[("p.yaml", LAYERED)]).unwrap();
        let d = Decider::new(
            PolicyHandle::new(set),
            Backend::memory(MemoryStore::new(), clock.clone()),
            Arc::new(Metrics::install(10)),
            options,
        );
        (d, clock)
    }

    /// (code, limit name, remaining, reset seconds) of the first status.
    fn first(decision: &Decision) -> (Code, String, u32, Option<u64>) {
        let s = &decision.statuses[0];
        (
            s.code,
            s.limit
                .as_ref()
                .map_or_else(String::new, |l| l.name().to_string()),
            s.remaining,
            s.reset_seconds,
        )
    }

    fn header<'a>(decision: &'a Decision, name: &str) -> &'a str {
        decision
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map_or("", |(_, v)| v.as_str())
    }

    #[test]
    fn several_limits_on_one_node_are_all_or_nothing_and_report_the_tightest() {
        let (d, clock) = layered(Options {
            headers: HeaderOptions {
                mode: HeaderMode::Legacy,
                ..HeaderOptions::default()
            },
            ..Options::default()
        });
        let user = req(&[&[("user", "u")]]);
        // Three pass: per_second is the tighter one (fewer left) each time; it is full again
        // a second after the last (a third of a second, rounded up, per request).
        for (left, full) in [(2, 1), (1, 1), (0, 2)] {
            let r = now(d.decide(&user)).unwrap();
            assert_eq!(first(&r), (Code::Ok, "per_second".into(), left, Some(full)));
        }
        // The per-second limit refuses while the daily one still has room; the status and the
        // headers name it.
        let r = now(d.decide(&user)).unwrap();
        assert_eq!(r.overall, Code::OverLimit);
        assert_eq!(
            first(&r),
            (Code::OverLimit, "per_second".into(), 0, Some(1))
        );
        assert_eq!(header(&r, "RateLimit-Limit"), "3");
        // A second later the per-second bucket is full again, and the daily one has exactly one
        // left: the refusal charged it nothing. It is now the tighter.
        clock.advance(NANOS_PER_SEC);
        let r = now(d.decide(&user)).unwrap();
        assert_eq!(r.overall, Code::Ok);
        assert_eq!(first(&r), (Code::Ok, "per_day".into(), 0, Some(86_399)));
        assert_eq!(header(&r, "RateLimit-Limit"), "4");
        assert_eq!(header(&r, "RateLimit-Remaining"), "0");
        // The daily one refuses though the per-second ones pass: it is the one reported, with
        // its own wait (a quarter of a day after the first request, a second ago).
        let r = now(d.decide(&user)).unwrap();
        assert_eq!(r.overall, Code::OverLimit);
        assert_eq!(
            first(&r),
            (Code::OverLimit, "per_day".into(), 0, Some(21_599))
        );
        assert_eq!(header(&r, "RateLimit-Limit"), "4");
    }

    const DELAYS: &str = r"
domain: d
descriptors:
  - key: user
    rate_limits:
      - {name: slow, unit: second, requests_per_unit: 2, burst: 1, delay: 1s}
      - {name: fast, unit: second, requests_per_unit: 10, burst: 1, delay: 200ms}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 10, burst: 1, delay: 1s}
";

    /// A delay of ten seconds: more than four periods of debt past the bucket.
    const LONG_DELAY: &str = "
domain: d
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 10, burst: 1, delay: 10s}
";

    fn held(d: &Decision) -> u64 {
        d.hold.as_ref().map_or(0, |h| h.nanos)
    }

    #[test]
    fn several_delaying_rules_hold_for_the_last_slot_and_charge_all_or_nothing() {
        let ms = NANOS_PER_SEC / 1_000;
        let clock = Arc::new(ManualClock::new(1 << 40));
        let d = decider_of(
            DELAYS,
            Backend::memory(MemoryStore::new(), clock.clone()),
            Options::default(),
        );
        let user = req(&[&[("user", "u")]]);
        let first = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!((first.overall, held(&first)), (Code::Ok, 0));
        // slow's slot is 500 ms away, fast's 100 ms: held for the later one.
        let second = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!((second.overall, held(&second)), (Code::Ok, 500 * ms));
        // slow's next slot is 1 s away (within its delay), fast's 200 ms (within its delay).
        let third = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!((third.overall, held(&third)), (Code::Ok, 1_000 * ms));
        // slow would wait 1.5 s: refused with its wait, and fast is charged nothing.
        let fourth = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!(fourth.overall, Code::OverLimit);
        assert_eq!(fourth.statuses[0].reset_seconds, Some(2));
        assert!(fourth.hold.is_none());
        // A caller that cannot wait is refused, and charged nothing either.
        clock.advance(1_000 * ms);
        let hasty = now(d.decide_within(&user, || 100 * ms)).unwrap();
        assert_eq!(hasty.overall, Code::OverLimit);
        let patient = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!((patient.overall, held(&patient)), (Code::Ok, 500 * ms));
        // Plain `decide` never holds: a delaying rule refuses what does not fit now.
        assert_eq!(now(d.decide(&user)).unwrap().overall, Code::OverLimit);
    }

    #[test]
    fn shadow_rules_and_global_shadow_mode_never_hold() {
        let d = decider_of(DELAYS, memory(), Options::default());
        let shadow = req(&[&[("shadow", "s")]]);
        for _ in 0..3 {
            let r = now(d.decide_within(&shadow, || u64::MAX)).unwrap();
            assert_eq!((r.overall, held(&r)), (Code::Ok, 0));
        }
        let global = decider_of(
            DELAYS,
            memory(),
            Options {
                shadow_mode: true,
                ..Options::default()
            },
        );
        let user = req(&[&[("user", "u")]]);
        for _ in 0..3 {
            let r = now(global.decide_within(&user, || u64::MAX)).unwrap();
            assert_eq!((r.overall, held(&r)), (Code::Ok, 0));
        }
    }

    #[test]
    fn the_room_to_hold_is_asked_only_for_a_request_an_enforced_delaying_rule_matched() {
        let d = decider_of(DELAYS, memory(), Options::default());
        let asked = std::cell::Cell::new(0);
        let room = || {
            asked.set(asked.get() + 1);
            u64::MAX
        };
        for entries in [&[("shadow", "s")][..], &[("nobody", "n")][..]] {
            now(d.decide_within(&req(&[entries]), room)).unwrap();
        }
        assert_eq!(asked.get(), 0, "no enforced rule delays these");
        // Two delaying rules on one descriptor, and a second descriptor: asked once.
        let two = req(&[&[("user", "u")], &[("user", "v")]]);
        now(d.decide_within(&two, room)).unwrap();
        assert_eq!(asked.get(), 1);
    }

    #[test]
    fn spend_recorded_on_a_delaying_rule_never_gives_away_the_held_slots() {
        let ms = NANOS_PER_SEC / 1_000;
        let d = decider_of(LONG_DELAY, memory(), Options::default());
        let user = req(&[&[("user", "u")]]);
        // One at once, then slots every 100 ms up to 10 s ahead, well past four periods.
        let mut last = 0;
        for _ in 0..100 {
            let r = now(d.decide_within(&user, || u64::MAX)).unwrap();
            assert_eq!(r.overall, Code::Ok);
            last = held(&r);
        }
        assert_eq!(last, 9_900 * ms);
        // Spend reported after the work, and a refund, by callers that cannot be held.
        now(d.decide(&costed(&[("user", "u", 1)]))).unwrap();
        let mut refund = req(&[&[("user", "u")]]);
        refund.descriptors[0].is_negative_hits = true;
        now(d.decide(&refund)).unwrap();
        // The spend and the refund cancel: the next slot comes after every one already
        // claimed, 100 ms after the last, not within four periods of now.
        let next = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!((next.overall, held(&next)), (Code::Ok, 10_000 * ms));
        let past = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!(
            past.overall,
            Code::OverLimit,
            "10.1 s ahead: past the delay"
        );
    }

    #[test]
    fn a_slot_given_back_at_the_drain_never_cuts_the_later_slots_held() {
        let ms = NANOS_PER_SEC / 1_000;
        let d = decider_of(LONG_DELAY, memory(), Options::default());
        let user = req(&[&[("user", "u")]]);
        now(d.decide_within(&user, || u64::MAX)).unwrap();
        // Held 100 ms by a caller that could wait 200 ms; then others claim slots to 9.9 s.
        let short = now(d.decide_within(&user, || 200 * ms)).unwrap();
        assert_eq!(held(&short), 100 * ms);
        for _ in 0..98 {
            now(d.decide_within(&user, || u64::MAX)).unwrap();
        }
        now(d.refuse_held(short, 50 * ms));
        // One slot came back: the next is 9.9 s ahead, not within four periods of now.
        let next = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!((next.overall, held(&next)), (Code::Ok, 9_900 * ms));
    }

    #[test]
    fn a_held_request_refused_at_the_drain_gives_its_slot_back() {
        let ms = NANOS_PER_SEC / 1_000;
        let d = decider_of(DELAYS, memory(), Options::default());
        let user = req(&[&[("user", "u")]]);
        now(d.decide_within(&user, || u64::MAX)).unwrap();
        let second = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!(held(&second), 500 * ms);
        let refused = now(d.refuse_held(second, 400 * ms));
        assert_eq!(refused.overall, Code::OverLimit);
        assert_eq!(refused.statuses[0].code, Code::OverLimit);
        assert_eq!(refused.statuses[0].reset_seconds, Some(1));
        assert!(refused.hold.is_none());
        // The slot is free again: the next request takes it, 500 ms on, not 1 s.
        let next = now(d.decide_within(&user, || u64::MAX)).unwrap();
        assert_eq!(held(&next), 500 * ms);
    }

    #[test]
    fn cost_nodes_share_the_ancestors_budget_at_their_cost() {
        let (d, _clock) = layered(Options::default());
        let search = || req(&[&[("acct", "a"), ("route", "search")]]);
        let item = || req(&[&[("acct", "a"), ("route", "item")]]);
        let acct = || req(&[&[("acct", "a")]]);
        let left = |r: &Request| first(&now(d.decide(r)).unwrap());
        assert_eq!(left(&search()), (Code::Ok, "budget".into(), 10, Some(6)));
        assert_eq!(left(&item()).2, 9);
        assert_eq!(left(&acct()).2, 8);
        // Eight left, search costs ten: refused (two more come in 1.2 s), nothing charged.
        assert_eq!(
            left(&search()),
            (Code::OverLimit, "budget".into(), 8, Some(2))
        );
        assert_eq!(left(&item()).2, 7);
        // Another account has its own budget.
        assert_eq!(left(&req(&[&[("acct", "b"), ("route", "search")]])).2, 10);
        // A refund gives back the cost node's cost.
        let mut refund = item();
        refund.descriptors[0].is_negative_hits = true;
        assert_eq!(left(&refund).0, Code::Ok);
        assert_eq!(left(&acct()).2, 7);
        // A descriptor's hits_addend of 0 checks only.
        let mut check = search();
        check.descriptors[0].hits_addend = Some(0);
        assert_eq!(left(&check).2, 7);
    }

    const USAGE: &str = r"
domain: d
descriptors:
  - key: user
    rate_limit: {name: usage, unit: hour, requests_per_unit: 21}
  - key: tokens
    rate_limit: {name: tokens, unit: minute, requests_per_unit: 1000}
";

    /// A request whose descriptors carry their own cost, as Envoy's `apply_on_stream_done`
    /// sends them (a check has `hits_addend: 0`).
    fn costed(descs: &[(&str, &str, u64)]) -> Request {
        let mut r = Request::from_entries("d", &[]);
        r.descriptors = descs
            .iter()
            .map(|&(key, value, cost)| Descriptor {
                entries: vec![Entry {
                    key: key.into(),
                    value: value.into(),
                }],
                hits_addend: Some(cost),
                ..Descriptor::default()
            })
            .collect();
        r
    }

    #[test]
    fn spend_reported_after_the_work_is_recorded_past_the_limit() {
        let clock = Arc::new(ManualClock::new(1 << 40));
        let headers = HeaderOptions {
            mode: HeaderMode::Draft,
            ..HeaderOptions::default()
        };
        let d = decider_of(
            USAGE,
            Backend::memory(MemoryStore::new(), clock.clone()),
            Options {
                headers,
                ..Options::default()
            },
        );
        // Envoy Gateway's UsageRateLimit: 21 an hour, request cost 0, response cost 10.
        let mut codes = Vec::new();
        for _ in 0..4 {
            let check = now(d.decide(&costed(&[("user", "u", 0)]))).unwrap();
            codes.push(check.overall);
            if check.overall == Code::Ok {
                now(d.decide(&costed(&[("user", "u", 10)]))).unwrap();
            }
        }
        assert_eq!(codes, [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit]);
        // 30 recorded against 21: nine of debt at T = 171.43 s, and the check says so.
        let check = now(d.decide(&costed(&[("user", "u", 0)]))).unwrap();
        assert_eq!(
            first(&check),
            (Code::OverLimit, "usage".into(), 0, Some(1543))
        );
        assert!(header(&check, "RateLimit").contains("r=0"), "{check:?}");
        // The report that crossed the budget was answered over the limit, and recorded.
        let mut fresh = costed(&[("user", "v", 15)]);
        assert_eq!(now(d.decide(&fresh)).unwrap().overall, Code::Ok);
        let crossing = now(d.decide(&fresh)).unwrap();
        assert_eq!(crossing.overall, Code::OverLimit);
        assert_eq!(crossing.statuses[0].remaining, 0);
        fresh.descriptors[0].hits_addend = Some(0);
        assert_eq!(now(d.decide(&fresh)).unwrap().overall, Code::OverLimit);

        // A plain request (no cost of its own) that is refused still charges nothing.
        let mut plain = req(&[&[("tokens", "t")]]);
        plain.hits_addend = 1_200;
        assert_eq!(first(&now(d.decide(&plain)).unwrap()).0, Code::OverLimit);
        plain.hits_addend = 1;
        assert_eq!(first(&now(d.decide(&plain)).unwrap()).2, 999);

        // A report charges each of its descriptors, even when one is over: no all or nothing
        // for spend already made. The other key is untouched by the first's debt.
        let both = costed(&[("tokens", "a", 5_000), ("tokens", "b", 100)]);
        let r = now(d.decide(&both)).unwrap();
        assert_eq!(r.overall, Code::OverLimit);
        assert_eq!(
            (r.statuses[0].code, r.statuses[1].code),
            (Code::OverLimit, Code::Ok)
        );
        assert_eq!(r.statuses[1].remaining, 900);
        // Five budgets past an empty bucket: refused for four minutes, to the second.
        let a = costed(&[("tokens", "a", 0)]);
        assert_eq!(first(&now(d.decide(&a)).unwrap()).3, Some(240));
        clock.advance(240 * NANOS_PER_SEC - 1);
        assert_eq!(now(d.decide(&a)).unwrap().overall, Code::OverLimit);
        clock.advance(1);
        assert_eq!(now(d.decide(&a)).unwrap().overall, Code::Ok);
        assert_eq!(
            first(&now(d.decide(&costed(&[("tokens", "b", 0)]))).unwrap()).2,
            1_000
        );
    }

    #[test]
    fn hits_addend_multiplies_a_cost() {
        let (d, _clock) = layered(Options::default());
        let mut search = req(&[&[("acct", "a"), ("route", "search")]]);
        search.hits_addend = 2;
        assert_eq!(first(&now(d.decide(&search)).unwrap()).2, 0);
        let mut item = req(&[&[("acct", "b"), ("route", "item")]]);
        item.descriptors[0].hits_addend = Some(3);
        assert_eq!(first(&now(d.decide(&item)).unwrap()).2, 17);
        // The request's hits_addend 0 means 1, times the cost.
        search.hits_addend = 0;
        search.descriptors[0].entries[0].value = "c".into();
        assert_eq!(first(&now(d.decide(&search)).unwrap()).2, 10);
    }

    const WITH_METADATA: &str = r"
domain: d
descriptors:
  - key: one
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {name: one, only_one: 1, nested: {from: one}}
  - key: two
    rate_limit: {unit: minute, requests_per_unit: 5}
    metadata: {name: two, nested: {from: two, extra: 2}}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {shadow: yes}
  - key: quota
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {quota: left}
  - key: free
    rate_limit: {unlimited: true}
    metadata: {free: never}
";

    fn with_metadata(options: Options) -> Decider {
        let set = load_str(&[("p.yaml", WITH_METADATA)]).unwrap();
        Decider::new(
            PolicyHandle::new(set),
            memory(),
            Arc::new(Metrics::install(10)),
            Options {
                dynamic_metadata: true,
                ..options
            },
        )
    }

    fn merged(d: &Decision) -> Option<&serde_json::Value> {
        d.dynamic_metadata
            .as_ref()
            .expect("dynamic metadata")
            .get("metadata")
    }

    #[test]
    fn dynamic_metadata_merges_the_rules_that_passed() {
        use serde_json::json;
        let d = with_metadata(Options::default());
        let both = req(&[&[("one", "a")], &[("two", "b")], &[("free", "c")]]);
        let first = now(d.decide(&both)).unwrap();
        assert_eq!(
            first.dynamic_metadata,
            json!({
                "domain": "d",
                "descriptors": [{"entries": ["one=a"]}, {"entries": ["two=b"]}, {"entries": ["free=c"]}],
                "metadata": {"name": "one", "only_one": 1, "nested": {"from": "one", "extra": 2}},
            })
            .as_object()
            .cloned()
        );
        // `one` is now over its limit: the request is refused, and only `two`, which passed, gives
        // its metadata (the unlimited rule never does).
        let second = now(d.decide(&both)).unwrap();
        assert_eq!(second.overall, Code::OverLimit);
        assert_eq!(
            merged(&second),
            Some(&json!({"name": "two", "nested": {"from": "two", "extra": 2}}))
        );
        // A shadow-mode rule passes even over its limit; a quota rule over its limit does not.
        let modes = req(&[&[("shadow", "s")], &[("quota", "q")]]);
        now(d.decide(&modes)).unwrap();
        let over = now(d.decide(&modes)).unwrap();
        assert_eq!(over.statuses[0].code, Code::Ok);
        assert_eq!(over.statuses[1].code, Code::OverLimit);
        assert_eq!(merged(&over), Some(&json!({"shadow": "yes"})));
        // hitsAddend: the request's only when not 0, a descriptor's whenever set.
        let mut costly = req(&[&[("two", "z")]]);
        costly.hits_addend = 2;
        costly.descriptors[0].hits_addend = Some(0);
        let m = now(d.decide(&costly)).unwrap().dynamic_metadata.unwrap();
        assert_eq!(m["hitsAddend"], json!(2));
        assert_eq!(
            m["descriptors"],
            json!([{"entries": ["two=z"], "hitsAddend": 0}])
        );
        // An unknown domain still describes the request, with no metadata.
        let m = now(d.decide(&Request::from_entries("nope", &[&[("one", "a")]])))
            .unwrap()
            .dynamic_metadata
            .unwrap();
        assert_eq!(m["domain"], json!("nope"));
        assert!(!m.contains_key("metadata"));
    }

    #[test]
    fn under_global_shadow_mode_a_rule_over_its_limit_does_not_pass() {
        let d = with_metadata(Options {
            shadow_mode: true,
            ..Options::default()
        });
        let one = req(&[&[("one", "a")]]);
        assert!(merged(&now(d.decide(&one)).unwrap()).is_some());
        let over = now(d.decide(&one)).unwrap();
        assert_eq!(over.overall, Code::Ok);
        assert_eq!(over.statuses[0].code, Code::OverLimit);
        assert_eq!(merged(&over), None);
    }

    #[test]
    fn dynamic_metadata_is_absent_when_off() {
        let set = load_str(&[("p.yaml", WITH_METADATA)]).unwrap();
        let d = Decider::new(
            PolicyHandle::new(set),
            memory(),
            Arc::new(Metrics::install(10)),
            Options::default(),
        );
        assert_eq!(
            now(d.decide(&req(&[&[("one", "a")]])))
                .unwrap()
                .dynamic_metadata,
            None
        );
    }

    #[test]
    fn replaces_drops_one_entry_of_several_and_an_entry_can_replace() {
        let policy = r"
domain: d
descriptors:
  - key: user
    rate_limits:
      - {name: tight, unit: minute, requests_per_unit: 2}
      - {name: loose, unit: minute, requests_per_unit: 9, replaces: [{name: other}]}
  - key: vip
    rate_limit: {name: vip, unit: minute, requests_per_unit: 50, replaces: [{name: tight}]}
  - key: other
    rate_limit: {name: other, unit: minute, requests_per_unit: 1}
";
        let set = load_str(&[("p.yaml", policy)]).unwrap();
        let d = Decider::new(
            PolicyHandle::new(set),
            memory(),
            Arc::new(Metrics::install(10)),
            Options::default(),
        );
        // With vip, `tight` is dropped: `loose` alone is charged and reported.
        // (9 a minute: full again one interval, 6.67 s rounded up to the ns, per request later.)
        for (left, full) in [(8, 7), (7, 14), (6, 21)] {
            let r = now(d.decide(&req(&[&[("user", "u")], &[("vip", "x")]]))).unwrap();
            assert_eq!(first(&r), (Code::Ok, "loose".into(), left, Some(full)));
        }
        // Without it, `tight` was never charged: it has both of its 2.
        let r = now(d.decide(&req(&[&[("user", "u")], &[("other", "o")]]))).unwrap();
        assert_eq!(first(&r), (Code::Ok, "tight".into(), 1, Some(30)));
        // `loose` replaced `other`, so that was not charged either.
        assert_eq!(r.statuses[1].limit, None);
    }
}

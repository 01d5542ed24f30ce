//! A quota stream's messages as the server reads and writes them, with each bucket id as the
//! bytes a stream keeps it as ([`crate::rlqs::key`]) and no ordered map of strings built on the
//! way in or out.
//!
//! - [`UsageReports`] reads a `RateLimitQuotaUsageReports` as prost's generated message does.
//!   A message in its plain form, as Envoy writes it, is read in one pass over its bytes: known
//!   fields only, each message field once, every key of a bucket id once, every length and
//!   string sound. Any other message, and so every error, is read by the full reading, through
//!   prost's own field functions and in the same order: the same fields, the same errors with
//!   the same field paths, the same recursion limit, unknown fields skipped, a repeated bucket
//!   id merged into one and a repeated key's last value kept.
//! - [`Answer`] writes a `RateLimitQuotaResponse`, byte for byte as prost writes the message
//!   [`Answer::to_pb`] makes.

use std::ops::Range;
use std::time::Duration;

use prost::bytes::{Buf, BufMut};
use prost::encoding::{self, DecodeContext, WireType};
use prost::{DecodeError, Message};

use crate::pb::rate_limit_quota_response::BucketAction;
use crate::pb::rate_limit_quota_response::bucket_action::{
    self, AbandonAction, QuotaAssignmentAction,
};
use crate::pb::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports, RateLimitStrategy,
    rate_limit_strategy,
};
use crate::rlqs::key::{self, Flat};
use crate::rlqs::{self, Action, ActionKind};

/// One message of a quota stream.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct UsageReports {
    /// `domain`: set on a stream's first message.
    pub domain: String,
    /// `bucket_quota_usages`, in order.
    pub usages: Vec<Usage>,
}

/// One `BucketQuotaUsage`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Usage {
    /// `bucket_id`'s entries as kept ([`key::flatten`]); empty when it has none or is absent.
    pub bucket: Flat,
    /// How many entries `bucket` has.
    pub entries: usize,
    /// `time_elapsed`, when set.
    pub time_elapsed: Option<prost_types::Duration>,
    /// `num_requests_allowed`.
    pub num_requests_allowed: u64,
    /// `num_requests_denied`.
    pub num_requests_denied: u64,
}

impl UsageReports {
    /// Decodes one message, as `RateLimitQuotaUsageReports::decode` would.
    ///
    /// # Errors
    ///
    /// prost's error for bytes that are not that message.
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        match plain::reports(buf) {
            Some(reports) => Ok(reports),
            None => Self::decode_in_full(buf),
        }
    }

    /// [`UsageReports::decode`] through prost's field functions, whatever the message's form.
    fn decode_in_full(mut buf: &[u8]) -> Result<Self, DecodeError> {
        let mut out = Self::default();
        let mut usage = UsageScratch::default();
        let ctx = DecodeContext::default();
        while buf.has_remaining() {
            let (tag, wire_type) = encoding::decode_key(&mut buf)?;
            match tag {
                1 => encoding::string::merge(wire_type, &mut out.domain, &mut buf, ctx.clone())
                    .map_err(|e| at(e, REPORTS, "domain"))?,
                2 => {
                    // `message::merge_repeated`, with one scratch value for every element
                    // (clear: new, or left so by `take`).
                    encoding::check_wire_type(WireType::LengthDelimited, wire_type)
                        .and_then(|()| {
                            encoding::message::merge(wire_type, &mut usage, &mut buf, ctx.clone())
                        })
                        .map_err(|e| at(e, REPORTS, "bucket_quota_usages"))?;
                    out.usages.push(usage.take());
                }
                _ => encoding::skip_field(wire_type, tag, &mut buf, ctx.clone())?,
            }
        }
        Ok(out)
    }
}

/// prost's reading of a message, in these terms: [`UsageReports::decode`] of a message's bytes
/// is this of `RateLimitQuotaUsageReports::decode` of them.
impl From<RateLimitQuotaUsageReports> for UsageReports {
    fn from(m: RateLimitQuotaUsageReports) -> Self {
        Self {
            domain: m.domain,
            usages: m
                .bucket_quota_usages
                .into_iter()
                .map(|u| {
                    let bucket = u.bucket_id.map(|b| b.bucket).unwrap_or_default();
                    Usage {
                        bucket: key::flat(&bucket),
                        entries: bucket.len(),
                        time_elapsed: u.time_elapsed,
                        num_requests_allowed: u.num_requests_allowed,
                        num_requests_denied: u.num_requests_denied,
                    }
                })
                .collect(),
        }
    }
}

/// One `RateLimitQuotaResponse`: `actions`, each assignment to live for `ttl`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Its bucket actions, in order.
    pub actions: Vec<Action>,
    /// `assignment_time_to_live` of every assignment.
    pub ttl: Duration,
}

impl Answer {
    /// Writes the message into `buf`: for each action its bucket id from the id's bytes, then
    /// the action as prost writes it, written once for a run of actions of one kind (a renewal
    /// of a stream's buckets, or a share that all of them moved to).
    pub fn encode(&self, buf: &mut impl BufMut) {
        let mut kind = None;
        let mut action = Vec::new();
        for a in &self.actions {
            if kind != Some(a.kind) {
                action.clear();
                action_pb(a.kind, self.ttl).encode(&mut action);
                kind = Some(a.kind);
            }
            let id = bucket_id_len(&a.bucket);
            encoding::encode_key(1, WireType::LengthDelimited, buf);
            encoding::encode_varint(action_len(id, action.len()) as u64, buf);
            encoding::encode_key(1, WireType::LengthDelimited, buf);
            encoding::encode_varint(id as u64, buf);
            for (k, v) in key::raw_entries(&a.bucket) {
                Entry::encode(k, v, buf);
            }
            buf.put_slice(&action);
        }
    }

    /// The bytes [`Answer::encode`] writes.
    #[must_use]
    pub fn encoded_len(&self) -> usize {
        self.actions
            .iter()
            .map(|a| {
                let action = action_pb(a.kind, self.ttl).encoded_len();
                let len = action_len(bucket_id_len(&a.bucket), action);
                encoding::key_len(1) + encoding::encoded_len_varint(len as u64) + len
            })
            .sum()
    }

    /// The message as prost's generated type, whose encoding is [`Answer::encode`]'s.
    #[must_use]
    pub fn to_pb(&self) -> RateLimitQuotaResponse {
        RateLimitQuotaResponse {
            bucket_action: self
                .actions
                .iter()
                .map(|a| BucketAction {
                    bucket_id: Some(BucketId {
                        bucket: key::bucket_id(&a.bucket),
                    }),
                    bucket_action: Some(action_pb(a.kind, self.ttl)),
                })
                .collect(),
        }
    }
}

/// The length of a `BucketAction` of a bucket id of `id` bytes and an action of `action` bytes.
fn action_len(id: usize, action: usize) -> usize {
    encoding::key_len(1) + encoding::encoded_len_varint(id as u64) + id + action
}

/// The length of the `BucketId` whose bytes are `flat`.
fn bucket_id_len(flat: &[u8]) -> usize {
    key::raw_entries(flat)
        .map(|(k, v)| Entry::field_len(k, v))
        .sum()
}

/// An action's kind on the wire.
fn action_pb(kind: ActionKind, ttl: Duration) -> bucket_action::BucketAction {
    match kind {
        ActionKind::Abandon => bucket_action::BucketAction::AbandonAction(AbandonAction {}),
        ActionKind::Assign(strategy) => {
            bucket_action::BucketAction::QuotaAssignmentAction(QuotaAssignmentAction {
                assignment_time_to_live: prost_types::Duration::try_from(ttl).ok(),
                rate_limit_strategy: Some(strategy_pb(strategy)),
            })
        }
    }
}

fn strategy_pb(strategy: rlqs::Strategy) -> RateLimitStrategy {
    use rate_limit_strategy::{BlanketRule, Strategy as Pb};
    let strategy = match strategy {
        rlqs::Strategy::AllowAll => Pb::BlanketRule(BlanketRule::AllowAll.into()),
        rlqs::Strategy::DenyAll => Pb::BlanketRule(BlanketRule::DenyAll.into()),
        rlqs::Strategy::TokenBucket(b) => Pb::TokenBucket(crate::pb::TokenBucket {
            max_tokens: b.max_tokens,
            tokens_per_fill: Some(b.tokens_per_fill),
            fill_interval: Some(prost_types::Duration {
                seconds: i64::try_from(b.fill_interval_secs).unwrap_or(i64::MAX),
                nanos: 0,
            }),
            name: String::new(),
        }),
    };
    RateLimitStrategy {
        strategy: Some(strategy),
    }
}

const REPORTS: &str = "RateLimitQuotaUsageReports";
const USAGE: &str = "BucketQuotaUsage";

/// `error` with the field it arose in, as prost's generated code adds it.
fn at(mut error: DecodeError, message: &'static str, field: &'static str) -> DecodeError {
    error.push(message, field);
    error
}

/// The one-pass reading of a message in its plain form (the module's docs). Each function reads
/// one message's bytes and says `None` of anything it does not read exactly as prost would, for
/// the full reading to read or refuse.
mod plain {
    use smallvec::SmallVec;

    use super::{Flat, Usage, UsageReports, key};

    const VARINT: u8 = 0;
    const LEN: u8 = 2;

    /// The bytes of one message, read from the front.
    struct Fields<'a>(&'a [u8]);

    impl<'a> Fields<'a> {
        /// The next field's tag and wire type, when its key takes one byte (tags under 16).
        fn key(&mut self) -> Option<(u8, u8)> {
            let (&first, rest) = self.0.split_first()?;
            if first >= 0x80 {
                return None;
            }
            self.0 = rest;
            Some((first >> 3, first & 7))
        }

        /// A varint, as prost reads it: at most ten bytes, the tenth 0 or 1. Nearly every one
        /// of a usage message (its lengths, tags' values, counts under 128) takes one byte.
        fn varint(&mut self) -> Option<u64> {
            if let Some((&b, rest)) = self.0.split_first()
                && b < 0x80
            {
                self.0 = rest;
                return Some(u64::from(b));
            }
            let mut value = 0u64;
            for (i, &b) in self.0.iter().take(10).enumerate() {
                value |= u64::from(b & 0x7f) << (7 * i);
                if b < 0x80 {
                    if i == 9 && b > 1 {
                        return None;
                    }
                    self.0 = &self.0[i + 1..];
                    return Some(value);
                }
            }
            None
        }

        /// A length-delimited field's bytes.
        fn bytes(&mut self) -> Option<&'a [u8]> {
            let len = usize::try_from(self.varint()?).ok()?;
            if len > self.0.len() {
                return None;
            }
            let (bytes, rest) = self.0.split_at(len);
            self.0 = rest;
            Some(bytes)
        }

        /// A string field's bytes, when they are UTF-8: ASCII, as nearly every id is, is told
        /// by a cheaper check.
        fn string(&mut self) -> Option<&'a [u8]> {
            let bytes = self.bytes()?;
            (bytes.is_ascii() || std::str::from_utf8(bytes).is_ok()).then_some(bytes)
        }
    }

    /// A `RateLimitQuotaUsageReports`.
    pub(super) fn reports(buf: &[u8]) -> Option<UsageReports> {
        let mut fields = Fields(buf);
        let mut out = UsageReports {
            domain: String::new(),
            usages: Vec::with_capacity(usages_in(buf)),
        };
        while !fields.0.is_empty() {
            match fields.key()? {
                // A string field seen again replaces what it held, as prost's does.
                (1, LEN) => {
                    let domain = std::str::from_utf8(fields.bytes()?).ok()?;
                    domain.clone_into(&mut out.domain);
                }
                (2, LEN) => out.usages.push(usage(fields.bytes()?)?),
                _ => return None,
            }
        }
        Some(out)
    }

    /// How many usages a message holds, counted by skipping over its fields, so that its list
    /// is sized once: no more than one for every two bytes of the message, so never more than
    /// reading it would push. A field the plain reading declines ends the count.
    fn usages_in(buf: &[u8]) -> usize {
        let mut fields = Fields(buf);
        let mut n = 0;
        while let Some((tag, LEN)) = fields.key() {
            if fields.bytes().is_none() {
                break;
            }
            n += usize::from(tag == 2);
        }
        n
    }

    /// A `BucketQuotaUsage`.
    fn usage(buf: &[u8]) -> Option<Usage> {
        let mut fields = Fields(buf);
        let (mut bucket, mut elapsed) = (None, None);
        let (mut allowed, mut denied) = (0, 0);
        while !fields.0.is_empty() {
            match fields.key()? {
                // A message field seen again is merged into the first: the full reading's.
                (1, LEN) if bucket.is_none() => bucket = Some(fields.bytes()?),
                (2, LEN) if elapsed.is_none() => elapsed = Some(duration(fields.bytes()?)?),
                (3, VARINT) => allowed = fields.varint()?,
                (4, VARINT) => denied = fields.varint()?,
                _ => return None,
            }
        }
        let (bucket, entries) = match bucket {
            Some(b) => bucket_id(b)?,
            None => (Flat::default(), 0),
        };
        Some(Usage {
            bucket,
            entries,
            time_elapsed: elapsed,
            num_requests_allowed: allowed,
            num_requests_denied: denied,
        })
    }

    /// A `google.protobuf.Duration`; its fields are `int64` and `int32` varints, which prost
    /// casts down.
    fn duration(buf: &[u8]) -> Option<prost_types::Duration> {
        let mut fields = Fields(buf);
        let mut d = prost_types::Duration::default();
        while !fields.0.is_empty() {
            match fields.key()? {
                (1, VARINT) => d.seconds = fields.varint()? as i64,
                (2, VARINT) => d.nanos = fields.varint()? as i32,
                _ => return None,
            }
        }
        Some(d)
    }

    /// A `BucketId`'s map, as its bytes kept ([`key::flatten`]) and how many entries it has.
    fn bucket_id(buf: &[u8]) -> Option<(Flat, usize)> {
        let mut fields = Fields(buf);
        let mut entries: SmallVec<[(&[u8], &[u8]); 4]> = SmallVec::new();
        while !fields.0.is_empty() {
            match fields.key()? {
                (1, LEN) => entries.push(entry(fields.bytes()?)?),
                _ => return None,
            }
        }
        entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
        if entries.windows(2).any(|pair| pair[0].0 == pair[1].0) {
            return None;
        }
        Some((key::flat_of(entries.iter().copied()), entries.len()))
    }

    /// One entry of the map: its key and value, each empty when absent.
    fn entry(buf: &[u8]) -> Option<(&[u8], &[u8])> {
        let mut fields = Fields(buf);
        let (mut key, mut value): (&[u8], &[u8]) = (b"", b"");
        while !fields.0.is_empty() {
            match fields.key()? {
                (1, LEN) => key = fields.string()?,
                (2, LEN) => value = fields.string()?,
                _ => return None,
            }
        }
        Some((key, value))
    }
}

/// A `BucketQuotaUsage` while it is decoded.
#[derive(Debug, Default)]
struct UsageScratch {
    bucket: Option<BucketScratch>,
    time_elapsed: Option<prost_types::Duration>,
    num_requests_allowed: u64,
    num_requests_denied: u64,
    /// Kept across usages, for its buffers.
    spare: BucketScratch,
}

impl UsageScratch {
    /// The usage decoded, leaving this one clear.
    fn take(&mut self) -> Usage {
        let (bucket, entries) = match &mut self.bucket {
            Some(b) => {
                let entries = b.settle();
                (b.flat(), entries)
            }
            None => (Flat::default(), 0),
        };
        let usage = Usage {
            bucket,
            entries,
            time_elapsed: self.time_elapsed.take(),
            num_requests_allowed: self.num_requests_allowed,
            num_requests_denied: self.num_requests_denied,
        };
        self.clear();
        usage
    }
}

impl Message for UsageScratch {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if let Some(bucket) = &self.bucket {
            encoding::message::encode(1, bucket, buf);
        }
        if let Some(elapsed) = &self.time_elapsed {
            encoding::message::encode(2, elapsed, buf);
        }
        if self.num_requests_allowed != 0 {
            encoding::uint64::encode(3, &self.num_requests_allowed, buf);
        }
        if self.num_requests_denied != 0 {
            encoding::uint64::encode(4, &self.num_requests_denied, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => {
                let bucket = self
                    .bucket
                    .get_or_insert_with(|| std::mem::take(&mut self.spare));
                encoding::message::merge(wire_type, bucket, buf, ctx)
                    .map_err(|e| at(e, USAGE, "bucket_id"))
            }
            2 => encoding::message::merge(
                wire_type,
                self.time_elapsed.get_or_insert_with(Default::default),
                buf,
                ctx,
            )
            .map_err(|e| at(e, USAGE, "time_elapsed")),
            3 => encoding::uint64::merge(wire_type, &mut self.num_requests_allowed, buf, ctx)
                .map_err(|e| at(e, USAGE, "num_requests_allowed")),
            4 => encoding::uint64::merge(wire_type, &mut self.num_requests_denied, buf, ctx)
                .map_err(|e| at(e, USAGE, "num_requests_denied")),
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        self.bucket
            .as_ref()
            .map_or(0, |b| encoding::message::encoded_len(1, b))
            + self
                .time_elapsed
                .as_ref()
                .map_or(0, |d| encoding::message::encoded_len(2, d))
            + if self.num_requests_allowed == 0 {
                0
            } else {
                encoding::uint64::encoded_len(3, &self.num_requests_allowed)
            }
            + if self.num_requests_denied == 0 {
                0
            } else {
                encoding::uint64::encoded_len(4, &self.num_requests_denied)
            }
    }

    fn clear(&mut self) {
        if let Some(mut bucket) = self.bucket.take() {
            bucket.clear();
            self.spare = bucket;
        }
        self.time_elapsed = None;
        self.num_requests_allowed = 0;
        self.num_requests_denied = 0;
    }
}

/// A `BucketId` while it is decoded: its entries in the order they came, their strings in one
/// buffer.
#[derive(Debug, Default)]
struct BucketScratch {
    strings: Vec<u8>,
    /// Each entry's key and value, in `strings`.
    entries: Vec<(Range<usize>, Range<usize>)>,
    entry: Entry,
}

impl BucketScratch {
    fn key(&self, entry: &(Range<usize>, Range<usize>)) -> &[u8] {
        &self.strings[entry.0.clone()]
    }

    fn value(&self, entry: &(Range<usize>, Range<usize>)) -> &[u8] {
        &self.strings[entry.1.clone()]
    }

    /// Puts the entries as the map holds them: ordered by key, and each key's last value only.
    /// Returns how many there are.
    fn settle(&mut self) -> usize {
        let strings = &self.strings;
        let key = |e: &(Range<usize>, Range<usize>)| &strings[e.0.clone()];
        // Equal keys stay in the order they came (their strings' place), with no allocation.
        self.entries
            .sort_unstable_by(|a, b| key(a).cmp(key(b)).then(a.0.start.cmp(&b.0.start)));
        self.entries.dedup_by(|later, kept| {
            let same = key(later) == key(kept);
            if same {
                std::mem::swap(later, kept);
            }
            same
        });
        self.entries.len()
    }

    /// The entries' bytes, as [`key::flatten`] writes their map once [`Self::settle`]d.
    fn flat(&self) -> Flat {
        key::flat_of(self.entries.iter().map(|e| (self.key(e), self.value(e))))
    }
}

impl Message for BucketScratch {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        for e in &self.entries {
            Entry::encode(self.key(e), self.value(e), buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if tag != 1 {
            return encoding::skip_field(wire_type, tag, buf, ctx);
        }
        // A map entry is read as a message: the wire type checked, then one level deeper.
        self.entry.clear();
        encoding::message::merge(wire_type, &mut self.entry, buf, ctx)
            .map_err(|e| at(e, "BucketId", "bucket"))?;
        let start = self.strings.len();
        self.strings.extend_from_slice(self.entry.key.as_bytes());
        let middle = self.strings.len();
        self.strings.extend_from_slice(self.entry.value.as_bytes());
        self.entries
            .push((start..middle, middle..self.strings.len()));
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        self.entries
            .iter()
            .map(|e| Entry::field_len(self.key(e), self.value(e)))
            .sum()
    }

    fn clear(&mut self) {
        self.strings.clear();
        self.entries.clear();
        self.entry.clear();
    }
}

/// One entry of a `BucketId`'s map: its key and value, each empty when absent.
#[derive(Debug, Default)]
struct Entry {
    key: String,
    value: String,
}

impl Entry {
    /// The encoded length of an entry of `key` and `value` (a field left out when empty).
    fn len_of(key: &[u8], value: &[u8]) -> usize {
        let field = |tag, s: &[u8]| {
            if s.is_empty() {
                0
            } else {
                encoding::key_len(tag) + encoding::encoded_len_varint(s.len() as u64) + s.len()
            }
        };
        field(1, key) + field(2, value)
    }

    /// The length of the entry as a field of its `BucketId` (tag 1).
    fn field_len(key: &[u8], value: &[u8]) -> usize {
        let len = Self::len_of(key, value);
        encoding::key_len(1) + encoding::encoded_len_varint(len as u64) + len
    }

    /// Writes the entry as a field of its `BucketId`, as prost writes a map's entry.
    fn encode(key: &[u8], value: &[u8], buf: &mut impl BufMut) {
        encoding::encode_key(1, WireType::LengthDelimited, buf);
        encoding::encode_varint(Self::len_of(key, value) as u64, buf);
        Self::encode_fields(key, value, buf);
    }

    fn encode_fields(key: &[u8], value: &[u8], buf: &mut impl BufMut) {
        for (tag, s) in [(1, key), (2, value)] {
            if !s.is_empty() {
                encoding::encode_key(tag, WireType::LengthDelimited, buf);
                encoding::encode_varint(s.len() as u64, buf);
                buf.put_slice(s);
            }
        }
    }
}

impl Message for Entry {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        Self::encode_fields(self.key.as_bytes(), self.value.as_bytes(), buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => encoding::string::merge(wire_type, &mut self.key, buf, ctx),
            2 => encoding::string::merge(wire_type, &mut self.value, buf, ctx),
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        Self::len_of(self.key.as_bytes(), self.value.as_bytes())
    }

    fn clear(&mut self) {
        self.key.clear();
        self.value.clear();
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use prost::Message;

    use super::*;
    use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;

    /// A field as it may come on the wire, in any order and any number of times.
    #[derive(Debug, Clone)]
    enum Field {
        Domain(String),
        Usage(Vec<UsageField>),
        Unknown(u32, Vec<u8>),
    }

    #[derive(Debug, Clone)]
    enum UsageField {
        /// A `bucket_id`, its entries each with a key and a value or not.
        Bucket(Vec<(Option<String>, Option<String>)>),
        Elapsed(i64, i32),
        Allowed(u64),
        Denied(u64),
        Unknown(u32, Vec<u8>),
    }

    fn len_field(tag: u32, body: &[u8], out: &mut Vec<u8>) {
        encoding::encode_key(tag, WireType::LengthDelimited, out);
        encoding::encode_varint(body.len() as u64, out);
        out.extend_from_slice(body);
    }

    fn encode_usage(fields: &[UsageField]) -> Vec<u8> {
        let mut out = Vec::new();
        for f in fields {
            match f {
                UsageField::Bucket(entries) => {
                    let mut bucket = Vec::new();
                    for (k, v) in entries {
                        let mut entry = Vec::new();
                        if let Some(k) = k {
                            encoding::string::encode(1, k, &mut entry);
                        }
                        if let Some(v) = v {
                            encoding::string::encode(2, v, &mut entry);
                        }
                        len_field(1, &entry, &mut bucket);
                    }
                    len_field(1, &bucket, &mut out);
                }
                UsageField::Elapsed(seconds, nanos) => {
                    let d = prost_types::Duration {
                        seconds: *seconds,
                        nanos: *nanos,
                    };
                    encoding::message::encode(2, &d, &mut out);
                }
                UsageField::Allowed(n) => encoding::uint64::encode(3, n, &mut out),
                UsageField::Denied(n) => encoding::uint64::encode(4, n, &mut out),
                UsageField::Unknown(tag, raw) => unknown(*tag, raw, &mut out),
            }
        }
        out
    }

    /// An unknown field `tag` (5 and up) of a wire type picked by `raw`'s length.
    fn unknown(tag: u32, raw: &[u8], out: &mut Vec<u8>) {
        match raw.len() % 4 {
            0 => encoding::uint64::encode(tag, &(raw.len() as u64 * 977), out),
            1 => len_field(tag, raw, out),
            2 => encoding::fixed32::encode(tag, &7, out),
            _ => {
                encoding::encode_key(tag, WireType::StartGroup, out);
                encoding::uint64::encode(1, &3, out);
                encoding::encode_key(tag, WireType::EndGroup, out);
            }
        }
    }

    fn encode(fields: &[Field]) -> Vec<u8> {
        let mut out = Vec::new();
        for f in fields {
            match f {
                Field::Domain(d) => encoding::string::encode(1, d, &mut out),
                Field::Usage(u) => len_field(2, &encode_usage(u), &mut out),
                Field::Unknown(tag, raw) => unknown(*tag, raw, &mut out),
            }
        }
        out
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![Just(String::new()), "[a-c]{1,2}", ".{0,3}"]
    }

    fn usage_field() -> impl Strategy<Value = UsageField> {
        prop_oneof![
            4 => proptest::collection::vec(
                (proptest::option::of(text()), proptest::option::of(text())),
                0..4,
            )
            .prop_map(UsageField::Bucket),
            1 => (any::<i64>(), any::<i32>()).prop_map(|(s, n)| UsageField::Elapsed(s, n)),
            1 => any::<u64>().prop_map(UsageField::Allowed),
            1 => any::<u64>().prop_map(UsageField::Denied),
            1 => (5u32..40, proptest::collection::vec(any::<u8>(), 0..6))
                .prop_map(|(t, r)| UsageField::Unknown(t, r)),
        ]
    }

    fn field() -> impl Strategy<Value = Field> {
        prop_oneof![
            1 => text().prop_map(Field::Domain),
            4 => proptest::collection::vec(usage_field(), 0..5).prop_map(Field::Usage),
            1 => (3u32..40, proptest::collection::vec(any::<u8>(), 0..6))
                .prop_map(|(t, r)| Field::Unknown(t, r)),
        ]
    }

    /// A message's bytes: well formed, then perhaps cut short or with one byte changed.
    fn bytes() -> impl Strategy<Value = Vec<u8>> {
        let well_formed = || proptest::collection::vec(field(), 0..5).prop_map(|f| encode(&f));
        prop_oneof![
            3 => well_formed(),
            1 => (well_formed(), any::<prop::sample::Index>())
                .prop_map(|(b, at)| b[..at.index(b.len() + 1)].to_vec()),
            1 => (well_formed(), any::<prop::sample::Index>(), any::<u8>()).prop_map(
                |(mut b, at, byte)| {
                    if !b.is_empty() {
                        let i = at.index(b.len());
                        b[i] = byte;
                    }
                    b
                }
            ),
            1 => proptest::collection::vec(any::<u8>(), 0..24),
        ]
    }

    /// What prost's generated message makes of `bytes`, in this module's terms.
    fn by_prost(bytes: &[u8]) -> Result<UsageReports, String> {
        RateLimitQuotaUsageReports::decode(bytes)
            .map(UsageReports::from)
            .map_err(|e| e.to_string())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// Fields in any order and number, merged bucket ids, repeated keys, unknown fields,
        /// and bytes cut short or changed: the same message or the same error as prost's.
        #[test]
        fn decodes_what_prost_decodes_and_refuses_what_it_refuses(bytes in bytes()) {
            let ours = UsageReports::decode(&bytes).map_err(|e| e.to_string());
            prop_assert_eq!(ours, by_prost(&bytes));
        }

        /// The one-pass reading reads what the full reading reads, or leaves it to it.
        #[test]
        fn the_plain_reading_reads_as_the_full_reading_or_not_at_all(bytes in bytes()) {
            if let Some(plain) = plain::reports(&bytes) {
                prop_assert_eq!(Ok(plain), UsageReports::decode_in_full(&bytes));
            }
        }
    }

    /// A message as Envoy's filter writes one: a domain, then each bucket's usage with its id
    /// (here of two entries, not in key order), a span and its counts.
    #[test]
    fn a_message_as_envoy_writes_it_is_read_in_one_pass() {
        let usage = |tenant: &str, seconds: i64| BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: [("tenant", tenant), ("name", "chat")]
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect(),
            }),
            time_elapsed: Some(prost_types::Duration { seconds, nanos: 0 }),
            num_requests_allowed: 7,
            num_requests_denied: 300,
        };
        let message = RateLimitQuotaUsageReports {
            domain: "quota".to_owned(),
            bucket_quota_usages: vec![usage("t1", 1), usage("t2", 0)],
        };
        let mut bytes = Vec::new();
        // Written by hand in the order Envoy's protobuf writes: the map's entries in its own
        // (hashed) order, here name after tenant.
        len_field(1, b"quota", &mut bytes);
        for u in &message.bucket_quota_usages {
            let mut id = Vec::new();
            for k in ["tenant", "name"] {
                let mut entry = Vec::new();
                len_field(1, k.as_bytes(), &mut entry);
                let value = &u.bucket_id.as_ref().expect("an id").bucket[k];
                len_field(2, value.as_bytes(), &mut entry);
                len_field(1, &entry, &mut id);
            }
            let mut body = Vec::new();
            len_field(1, &id, &mut body);
            len_field(
                2,
                &u.time_elapsed.expect("a span").encode_to_vec(),
                &mut body,
            );
            body.extend([0x18, 7, 0x20, 0xac, 0x02]);
            len_field(2, &body, &mut bytes);
        }
        let plain = plain::reports(&bytes).expect("read in one pass");
        // Counted before they are read: the list is allocated once.
        assert_eq!(plain.usages.capacity(), 2);
        assert_eq!(plain, UsageReports::from(message));
        assert_eq!(
            key::entries(&plain.usages[0].bucket),
            [("name", "chat"), ("tenant", "t1")]
        );
        assert_eq!(Ok(plain), UsageReports::decode_in_full(&bytes));
    }

    /// What the one-pass reading leaves to the full reading: an unknown field, a bucket id
    /// given twice, a key given twice, and a string that is not UTF-8.
    #[test]
    fn a_message_not_in_its_plain_form_is_left_to_the_full_reading() {
        let k = |s: &str| Some(s.to_owned());
        let plain = encode(&[Field::Usage(vec![UsageField::Bucket(vec![(
            k("a"),
            k("1"),
        )])])]);
        assert!(plain::reports(&plain).is_some());
        for fields in [
            vec![Field::Unknown(9, vec![1])],
            vec![Field::Usage(vec![
                UsageField::Bucket(vec![(k("a"), k("1"))]),
                UsageField::Bucket(vec![(k("b"), k("2"))]),
            ])],
            vec![Field::Usage(vec![UsageField::Bucket(vec![
                (k("a"), k("1")),
                (k("a"), k("2")),
            ])])],
        ] {
            let bytes = encode(&fields);
            assert!(plain::reports(&bytes).is_none(), "{fields:?}");
            assert_eq!(
                UsageReports::decode(&bytes).map_err(|e| e.to_string()),
                by_prost(&bytes)
            );
        }
        let mut not_utf8 = Vec::new();
        len_field(1, &[0xff], &mut not_utf8);
        assert!(plain::reports(&not_utf8).is_none());
        assert!(UsageReports::decode(&not_utf8).is_err());
        // A value past ASCII is read in one pass when it is UTF-8, and left when it is not.
        let id = |value: &[u8]| {
            let (mut entry, mut bucket, mut usage, mut bytes) = (vec![], vec![], vec![], vec![]);
            len_field(1, b"k", &mut entry);
            len_field(2, value, &mut entry);
            len_field(1, &entry, &mut bucket);
            len_field(1, &bucket, &mut usage);
            len_field(2, &usage, &mut bytes);
            bytes
        };
        let accented = id("caf\u{e9}".as_bytes());
        let read = plain::reports(&accented).expect("UTF-8 past ASCII");
        assert_eq!(key::entries(&read.usages[0].bucket), [("k", "caf\u{e9}")]);
        assert_eq!(Ok(read), UsageReports::decode_in_full(&accented));
        let cut = id(&"caf\u{e9}".as_bytes()[..4]);
        assert!(plain::reports(&cut).is_none());
        assert_eq!(
            UsageReports::decode(&cut).map_err(|e| e.to_string()),
            by_prost(&cut)
        );
    }

    fn action() -> impl Strategy<Value = Action> {
        let kind = prop_oneof![
            Just(ActionKind::Abandon),
            Just(ActionKind::Assign(crate::rlqs::Strategy::AllowAll)),
            Just(ActionKind::Assign(crate::rlqs::Strategy::DenyAll)),
            (any::<u32>(), any::<u32>(), any::<u64>()).prop_map(|(max, fill, secs)| {
                ActionKind::Assign(crate::rlqs::Strategy::TokenBucket(
                    crate::rlqs::TokenBucket {
                        max_tokens: max,
                        tokens_per_fill: fill,
                        fill_interval_secs: secs,
                    },
                ))
            }),
        ];
        let id = proptest::collection::btree_map(text(), text(), 0..4);
        (id, kind).prop_map(|(id, kind)| Action {
            bucket: key::flat(&id),
            kind,
        })
    }

    proptest! {
        /// Any actions, any ids (empty keys and values among them), any TTL: prost's bytes.
        #[test]
        fn an_answer_is_written_as_prost_writes_its_message(
            actions in proptest::collection::vec(action(), 0..5),
            ttl_ms in any::<u32>(),
        ) {
            let answer = Answer { actions, ttl: Duration::from_millis(u64::from(ttl_ms)) };
            let mut ours = Vec::new();
            answer.encode(&mut ours);
            prop_assert_eq!(ours.len(), answer.encoded_len());
            prop_assert_eq!(ours, answer.to_pb().encode_to_vec());
        }
    }

    #[test]
    fn a_repeated_bucket_id_is_merged_and_a_repeated_key_keeps_its_last_value() {
        let k = |s: &str| Some(s.to_owned());
        let bytes = encode(&[Field::Usage(vec![
            UsageField::Bucket(vec![(k("b"), k("1")), (k("a"), k("x"))]),
            UsageField::Allowed(3),
            UsageField::Bucket(vec![(k("b"), k("2")), (None, k("empty key"))]),
        ])]);
        let ours = UsageReports::decode(&bytes).expect("decodes");
        let entries: Vec<_> = key::entries(&ours.usages[0].bucket);
        assert_eq!(
            entries,
            vec![("", "empty key"), ("a", "x"), ("b", "2")],
            "ordered by key, the last value of b"
        );
        assert_eq!(ours.usages[0].entries, 3);
        assert_eq!(ours.usages[0].num_requests_allowed, 3);
        assert_eq!(Ok(ours), by_prost(&bytes));
    }

    #[test]
    fn a_string_that_is_not_utf8_is_refused_with_its_field() {
        let mut bucket = Vec::new();
        len_field(1, &[0x0a, 0x01, 0xff], &mut bucket);
        let mut usage = Vec::new();
        len_field(1, &bucket, &mut usage);
        let mut bytes = Vec::new();
        len_field(2, &usage, &mut bytes);
        let err = UsageReports::decode(&bytes)
            .expect_err("not UTF-8")
            .to_string();
        assert!(err.contains("not UTF-8"), "{err}");
        assert!(err.contains("BucketId.bucket"), "{err}");
        assert_eq!(Err(err), by_prost(&bytes));
    }

    #[test]
    fn groups_nested_past_the_recursion_limit_are_refused_as_prost_refuses_them() {
        let mut inner = Vec::new();
        for _ in 0..120 {
            encoding::encode_key(9, WireType::StartGroup, &mut inner);
        }
        for _ in 0..120 {
            encoding::encode_key(9, WireType::EndGroup, &mut inner);
        }
        let mut bucket = Vec::new();
        len_field(1, &inner, &mut bucket);
        let mut usage = Vec::new();
        len_field(1, &bucket, &mut usage);
        let mut bytes = Vec::new();
        len_field(2, &usage, &mut bytes);
        let ours = UsageReports::decode(&bytes).map_err(|e| e.to_string());
        assert!(
            ours.as_ref().is_err_and(|e| e.contains("recursion")),
            "{ours:?}"
        );
        assert_eq!(ours, by_prost(&bytes));
    }

    #[test]
    fn the_scratch_messages_encode_what_they_decoded() {
        let k = |s: &str| Some(s.to_owned());
        let fields = vec![
            UsageField::Bucket(vec![(k("b"), k("1")), (k("a"), None)]),
            UsageField::Elapsed(1, 5),
            UsageField::Allowed(7),
            UsageField::Denied(2),
        ];
        let bytes = encode_usage(&fields);
        let mut usage = UsageScratch::default();
        usage.merge(&bytes[..]).expect("decodes");
        let again = usage.encode_to_vec();
        assert_eq!(again.len(), usage.encoded_len());
        assert_eq!(
            RateLimitQuotaUsageReports::decode(
                &[&[0x12, again.len() as u8][..], &again].concat()[..]
            )
            .expect("prost reads it"),
            RateLimitQuotaUsageReports::decode(
                &[&[0x12, bytes.len() as u8][..], &bytes].concat()[..]
            )
            .expect("prost reads the original"),
        );
    }
}

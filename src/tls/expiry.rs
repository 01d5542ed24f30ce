//! When a served certificate stops working: its validity window read from the certificate
//! itself ([`validity`]), judged against the wall clock ([`Expiry::judge`]), logged where an
//! operator looks, and published as [`NOT_AFTER_METRIC`]. Expired or not yet valid is an
//! `error` every time such a pair is loaded (verifying clients refuse it); ending within
//! [`WARN_WITHIN`] a `warn`, at most once a day per certificate. A certificate whose validity
//! cannot be read is reported as such and served as rustls accepted it.

use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The gauge of each served certificate's end of validity, in Unix seconds.
pub const NOT_AFTER_METRIC: &str = "sluice_tls_certificate_not_after_timestamp_seconds";

/// A certificate this close to its end is logged at `warn`, once a day.
pub const WARN_WITHIN: Duration = Duration::from_secs(14 * 86_400);

const DAY: Duration = Duration::from_secs(86_400);

/// A certificate's validity window, in Unix seconds, both ends included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    /// `notBefore`.
    pub not_before: i64,
    /// `notAfter`.
    pub not_after: i64,
}

/// How a validity window stands at an instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Past `notAfter`.
    Expired,
    /// Before `notBefore`.
    NotYetValid,
    /// Valid, and ends within [`WARN_WITHIN`].
    EndsSoon,
    /// Valid for longer.
    Valid,
}

impl Validity {
    /// How this window stands at `now` (Unix seconds).
    #[must_use]
    pub fn at(&self, now: i64) -> Standing {
        let soon = i64::try_from(WARN_WITHIN.as_secs()).unwrap_or(i64::MAX);
        if now > self.not_after {
            Standing::Expired
        } else if now < self.not_before {
            Standing::NotYetValid
        } else if self.not_after - now <= soon {
            Standing::EndsSoon
        } else {
            Standing::Valid
        }
    }
}

/// The wall clock in Unix seconds.
#[must_use]
pub fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// One served certificate's expiry as logged and published: `certificate` names it in logs and
/// in the gauge's label (`grpc`, `redis_client`).
#[derive(Debug)]
pub struct Expiry {
    certificate: &'static str,
    judged: Mutex<Judged>,
}

/// What an [`Expiry`] last saw.
#[derive(Debug, Default)]
struct Judged {
    /// A fingerprint of the certificate last judged (0: none yet).
    print: u64,
    /// When the last periodic report was logged.
    warned: Option<Instant>,
}

impl Expiry {
    /// The expiry of the certificate labelled `certificate`.
    #[must_use]
    pub const fn new(certificate: &'static str) -> Self {
        Self {
            certificate,
            judged: Mutex::new(Judged {
                print: 0,
                warned: None,
            }),
        }
    }

    /// Judges the certificate `der`, served from `file`, at `now`. One not judged before (at
    /// start-up, after a rotation) has its end published, and is logged at `error` when expired
    /// or not yet valid, at `warn` when it ends soon. The one judged before (a periodic check)
    /// is logged again at most once a day while it is not plainly valid.
    pub fn judge(&self, file: &Path, der: &[u8], now: i64) {
        let print = xxhash_rust::xxh3::xxh3_64(der);
        // A panic under this lock leaves a record that is still whole (two plain fields), so
        // a poisoned lock is taken as it is: every later certificate is still judged.
        let mut judged = self.judged.lock().unwrap_or_else(PoisonError::into_inner);
        let fresh = std::mem::replace(&mut judged.print, print) != print;
        let Some(v) = validity(der) else {
            if fresh {
                tracing::warn!(certificate = self.certificate, file = %file.display(), "cannot read the certificate's validity; its expiry is not watched");
            }
            return;
        };
        if fresh {
            // f64: a gauge's type; Unix seconds are exact in it for 285 million years.
            metrics::gauge!(NOT_AFTER_METRIC, "certificate" => self.certificate)
                .set(v.not_after as f64);
        }
        let standing = v.at(now);
        if standing == Standing::Valid {
            return;
        }
        // A new certificate is reported at once; then once a day.
        let due = fresh || judged.warned.is_none_or(|at| at.elapsed() >= DAY);
        if due {
            judged.warned = Some(Instant::now());
            self.report(file, v, standing);
        }
    }

    fn report(&self, file: &Path, v: Validity, standing: Standing) {
        let (file, not_before, not_after) = (file.display(), date(v.not_before), date(v.not_after));
        match standing {
            Standing::Valid => {}
            Standing::Expired => tracing::error!(
                certificate = self.certificate, file = %file, %not_after,
                "TLS certificate has expired: peers that verify it refuse the connection"
            ),
            Standing::NotYetValid => tracing::error!(
                certificate = self.certificate, file = %file, %not_before,
                "TLS certificate is not valid yet: peers that verify it refuse the connection"
            ),
            Standing::EndsSoon => tracing::warn!(
                certificate = self.certificate, file = %file, %not_after,
                "TLS certificate expires within {} days", WARN_WITHIN.as_secs() / 86_400
            ),
        }
    }
}

/// An instant in Unix seconds as `YYYY-MM-DDTHH:MM:SSZ`.
#[must_use]
pub fn date(unix: i64) -> String {
    let (days, secs) = (unix.div_euclid(86_400), unix.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3_600,
        secs / 60 % 60,
        secs % 60
    )
}

/// Days from 1970-01-01 to a civil date (Howard Hinnant's days_from_civil).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The validity of a DER certificate (the first of a served chain), read by a small reader of
/// the fixed path `Certificate → tbsCertificate → validity` (RFC 5280, 4.1):
/// `Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL, serialNumber,
/// signature, issuer, validity SEQUENCE { notBefore, notAfter }, ... } ... }`. `None` for
/// anything else.
#[must_use]
pub fn validity(der: &[u8]) -> Option<Validity> {
    let (cert, _) = element(der, 0x30)?;
    let (mut tbs, _) = element(cert, 0x30)?;
    if tbs.first() == Some(&0xa0) {
        tbs = skip(tbs)?; // version
    }
    tbs = skip(tbs)?; // serialNumber
    tbs = skip(tbs)?; // signature
    tbs = skip(tbs)?; // issuer
    let (window, _) = element(tbs, 0x30)?;
    let (not_before, rest) = time(window)?;
    let (not_after, _) = time(rest)?;
    Some(Validity {
        not_before,
        not_after,
    })
}

/// The contents of the element at the start of `der` if its tag is `tag`, and what follows it.
fn element(der: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&t, rest) = der.split_first()?;
    if t != tag {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// What follows the element at the start of `der`, whatever its tag.
fn skip(der: &[u8]) -> Option<&[u8]> {
    element(der, *der.first()?).map(|(_, rest)| rest)
}

/// A `Time` (UTCTime `YYMMDDHHMMSSZ` or GeneralizedTime `YYYYMMDDHHMMSSZ`) in Unix seconds, and
/// what follows it.
fn time(der: &[u8]) -> Option<(i64, &[u8])> {
    let tag = *der.first()?;
    let (text, rest) = element(der, tag)?;
    let (year, text) = match (tag, text.len()) {
        // RFC 5280, 4.1.2.5.1: YY of 50 or more is 19YY, else 20YY.
        (0x17, 13) => {
            let yy = digits(&text[..2])?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &text[2..])
        }
        (0x18, 15) => (digits(&text[..4])?, &text[4..]),
        _ => return None,
    };
    if text[10] != b'Z' {
        return None;
    }
    let (month, day) = (digits(&text[0..2])?, digits(&text[2..4])?);
    let (h, m, s) = (
        digits(&text[4..6])?,
        digits(&text[6..8])?,
        digits(&text[8..10])?,
    );
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || m > 59 || s > 60 {
        return None;
    }
    let unix = days_from_civil(year, month, day) * 86_400 + h * 3_600 + m * 60 + s;
    Some((unix, rest))
}

fn digits(text: &[u8]) -> Option<i64> {
    text.iter().try_fold(0i64, |acc, b| {
        b.is_ascii_digit().then(|| acc * 10 + i64::from(b - b'0'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip_through_days() {
        for (y, m, d, unix) in [
            (1970, 1, 1, 0),
            (2000, 2, 29, 951_782_400),
            (2026, 12, 2, 1_796_169_600),
            (2049, 12, 31, 2_524_521_600),
            (1950, 1, 1, -631_152_000),
        ] {
            assert_eq!(days_from_civil(y, m, d) * 86_400, unix, "{y}-{m}-{d}");
            assert_eq!(date(unix), format!("{y:04}-{m:02}-{d:02}T00:00:00Z"));
        }
    }

    #[test]
    fn utc_and_generalized_times_are_read() {
        let utc = b"\x17\x0d261202143000Z";
        assert_eq!(time(utc), Some((1_796_221_800, &[][..])));
        let old = b"\x17\x0d500101000000Z";
        assert_eq!(time(old).map(|t| t.0), Some(-631_152_000));
        let generalized = b"\x18\x0f20991231235959Z";
        assert_eq!(
            time(generalized).map(|t| date(t.0)),
            Some("2099-12-31T23:59:59Z".into())
        );
        for bad in [
            &b"\x17\x0d261302143000Z"[..],
            b"\x17\x0d26120214300aZ",
            b"\x17\x0d261202143000+",
            b"\x17\x0e261202143000Z",
            b"\x19\x0d261202143000Z",
            b"\x17\x0d2612",
            b"",
        ] {
            assert_eq!(time(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn standing_at_the_ends_of_the_window() {
        let v = Validity {
            not_before: 1_000,
            not_after: 1_000_000,
        };
        assert_eq!(v.at(999), Standing::NotYetValid);
        assert_eq!(v.at(1_000), Standing::EndsSoon);
        assert_eq!(v.at(1_000_000), Standing::EndsSoon);
        assert_eq!(v.at(1_000_001), Standing::Expired);
        let long = Validity {
            not_before: 0,
            not_after: 100 * 86_400,
        };
        assert_eq!(long.at(0), Standing::Valid);
        assert_eq!(long.at(86 * 86_400), Standing::EndsSoon);
    }

    #[test]
    fn a_panic_under_the_lock_does_not_stop_the_judging() {
        let expiry = Expiry::new("grpc");
        let poisoned = std::panic::catch_unwind(|| {
            let _held = expiry.judged.lock().unwrap();
            panic!("a panic while the record is held");
        });
        assert!(poisoned.is_err() && expiry.judged.is_poisoned());
        expiry.judge(Path::new("cert.pem"), b"not a certificate", 0);
        let judged = expiry.judged.lock().unwrap_or_else(PoisonError::into_inner);
        assert_eq!(
            judged.print,
            xxhash_rust::xxh3::xxh3_64(b"not a certificate"),
            "the certificate was judged"
        );
    }

    #[test]
    fn truncated_and_hostile_der_is_refused_without_panicking() {
        assert_eq!(validity(&[]), None);
        assert_eq!(validity(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(validity(&[0x30, 0x03, 0x30, 0x01]), None);
        for n in 0..=255u8 {
            let _ = validity(&[0x30, n, 0x30, n, 0xa0, n, 0x02, 1, 0]);
        }
    }
}

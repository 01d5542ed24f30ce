//! Waiting for a slot instead of taking a refusal ([`RateLimitClient::acquire`]): for callers
//! that would rather be late than refused, such as a batch job calling an API that bills per
//! call. Each ask carries the caller's remaining patience as its `grpc-timeout`, so a server
//! whose rule delays (`delay:` in the policy) may hold the answer until the request's slot and
//! answer `OK` then; a refusal names its wait (`duration_until_reset`), and the caller sleeps
//! exactly that long and asks again. Past the caller's longest wait it stops with
//! [`AcquireError::TooLong`] at once, without sleeping first. It adds no jitter: a refused
//! acquirer is a paced job, not a crowd (crowds use [`super::Backoff`]).

use std::future::Future;
use std::time::Duration;

use super::{Answer, Descriptor, RateLimitClient};

/// The least pause after a refusal, should a server state a wait of zero: asking again at once
/// would only be refused again.
pub const MIN_PAUSE: Duration = Duration::from_millis(1);

/// A slot acquired, and what it cost the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acquired {
    /// From the call to `acquire` to its slot: the server's hold and the refusals' waits.
    pub waited: Duration,
    /// Refusals taken (each followed by its wait) before the slot.
    pub refusals: u32,
    /// Whether sluice did not answer and the open failure policy let the request go.
    pub failed_open: bool,
}

/// Why no slot was acquired.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum AcquireError {
    /// The next slot is further away than the caller may wait: refused with `wait` after
    /// `waited` already spent, against the caller's `max_wait`.
    #[error(
        "the next slot is {wait:?} away, and {waited:?} already waited; past the {max_wait:?} \
         this caller may wait"
    )]
    TooLong {
        /// The wait the last refusal (or the closed failure policy) named.
        wait: Duration,
        /// Time already spent in `acquire`.
        waited: Duration,
        /// The caller's longest wait.
        max_wait: Duration,
    },
}

impl RateLimitClient {
    /// Waits for a slot of one request (cost 1) with these descriptors, for at most
    /// `max_wait`. A server that delays holds the answer until the slot; a refusal is slept
    /// off (its exact wait) and asked again. When sluice does not answer, the failure policy
    /// answers as in [`check`](Self::check): open goes ahead, closed waits its wait.
    ///
    /// Each ask's `grpc-timeout` is the time left and the client's call deadline, so that the
    /// answer has time to arrive: a server may hold it until its deadline less its margin, and
    /// a slot that close to the end returns up to one call deadline past `max_wait`.
    ///
    /// # Errors
    ///
    /// [`AcquireError::TooLong`] as soon as a refusal's wait would end past `max_wait`.
    pub async fn acquire(
        &self,
        descriptors: &[Descriptor],
        max_wait: Duration,
    ) -> Result<Acquired, AcquireError> {
        self.acquire_hits(descriptors, 1, max_wait).await
    }

    /// As [`acquire`](Self::acquire), for a request that costs `hits`.
    ///
    /// # Errors
    ///
    /// [`AcquireError::TooLong`] as soon as a refusal's wait would end past `max_wait`.
    pub async fn acquire_hits(
        &self,
        descriptors: &[Descriptor],
        hits: u32,
        max_wait: Duration,
    ) -> Result<Acquired, AcquireError> {
        let start = tokio::time::Instant::now();
        let clock = Clock {
            elapsed: || start.elapsed(),
            sleep: tokio::time::sleep,
        };
        pace(&clock, max_wait, |patience| async move {
            // The call may take the remaining patience (the server's hold) and its own deadline.
            match self
                .ask(descriptors, hits, patience.saturating_add(self.deadline))
                .await
            {
                Ok(answer) => {
                    self.answered();
                    Asked::Answer(answer)
                }
                // Open goes ahead; closed is a refusal with the policy's wait.
                Err(error) => match self.failed(&error) {
                    Answer::Allowed => Asked::FailedOpen,
                    refused => Asked::Answer(refused),
                },
            }
        })
        .await
    }
}

/// What one ask got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    /// The server's answer (or the closed policy's refusal).
    Answer(Answer),
    /// No answer; the open policy lets the request go.
    FailedOpen,
}

/// The time `pace` runs on: tokio's, or a test's.
struct Clock<E, S> {
    /// Time since `acquire` began.
    elapsed: E,
    /// Sleeps for a duration.
    sleep: S,
}

/// The loop of `acquire`: `ask(patience)` with the time left, until allowed, sleeping each
/// refusal's wait; stops before a sleep that would end past `max_wait`.
async fn pace<E, S, Z, F, Fut>(
    clock: &Clock<E, S>,
    max_wait: Duration,
    mut ask: F,
) -> Result<Acquired, AcquireError>
where
    E: Fn() -> Duration,
    S: Fn(Duration) -> Z,
    Z: Future<Output = ()>,
    F: FnMut(Duration) -> Fut,
    Fut: Future<Output = Asked>,
{
    let mut refusals = 0;
    loop {
        let asked = ask(max_wait.saturating_sub((clock.elapsed)())).await;
        let waited = (clock.elapsed)();
        let wait = match asked {
            Asked::Answer(Answer::Allowed) | Asked::FailedOpen => {
                return Ok(Acquired {
                    waited,
                    refusals,
                    failed_open: asked == Asked::FailedOpen,
                });
            }
            Asked::Answer(Answer::Refused { wait }) => wait.max(MIN_PAUSE),
        };
        if waited.saturating_add(wait) > max_wait {
            return Err(AcquireError::TooLong {
                wait,
                waited,
                max_wait,
            });
        }
        refusals += 1;
        (clock.sleep)(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use futures_util::FutureExt;

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A scripted server on a hand-driven clock: each ask takes the next (hold, answer),
    /// records when it was asked and the patience it was given, and moves the clock by the hold;
    /// a sleep moves it by its length.
    struct Script {
        answers: RefCell<Vec<(Duration, Answer)>>,
        asked: RefCell<Vec<(Duration, Duration)>>,
        now: Cell<Duration>,
    }

    impl Script {
        fn new(mut answers: Vec<(Duration, Answer)>) -> Self {
            answers.reverse();
            Self {
                answers: RefCell::new(answers),
                asked: RefCell::new(Vec::new()),
                now: Cell::new(Duration::ZERO),
            }
        }

        fn ask(&self, patience: Duration) -> std::future::Ready<Asked> {
            self.asked.borrow_mut().push((self.now.get(), patience));
            let (hold, answer) = self.answers.borrow_mut().pop().expect("scripted");
            self.now.set(self.now.get() + hold);
            std::future::ready(Asked::Answer(answer))
        }

        /// `pace` against this script, on its clock (never pending: nothing here waits).
        fn pace(&self, max_wait: Duration) -> Result<Acquired, AcquireError> {
            let clock = Clock {
                elapsed: || self.now.get(),
                sleep: |d: Duration| {
                    self.now.set(self.now.get() + d);
                    std::future::ready(())
                },
            };
            pace(&clock, max_wait, |p| self.ask(p))
                .now_or_never()
                .expect("ready")
        }
    }

    fn refused(ms: u64) -> Answer {
        Answer::Refused {
            wait: Duration::from_millis(ms),
        }
    }

    #[test]
    fn a_refusal_is_slept_off_exactly_and_asked_again_with_the_time_left() {
        let s = Script::new(vec![
            (Duration::ZERO, refused(300)),
            (Duration::ZERO, refused(200)),
            (Duration::ZERO, Answer::Allowed),
        ]);
        let got = s.pace(Duration::from_secs(1)).unwrap();
        assert_eq!(got.waited, 500 * MS);
        assert_eq!((got.refusals, got.failed_open), (2, false));
        assert_eq!(
            *s.asked.borrow(),
            [
                (Duration::ZERO, 1_000 * MS),
                (300 * MS, 700 * MS),
                (500 * MS, 500 * MS)
            ]
        );
    }

    #[test]
    fn a_held_answer_is_a_slot_without_a_refusal() {
        let s = Script::new(vec![(250 * MS, Answer::Allowed)]);
        let got = s.pace(Duration::from_secs(1)).unwrap();
        assert_eq!((got.waited, got.refusals), (250 * MS, 0));
    }

    #[test]
    fn a_wait_past_the_longest_stops_at_once_and_says_so() {
        let s = Script::new(vec![
            (Duration::ZERO, refused(600)),
            (100 * MS, refused(400)),
        ]);
        let err = s.pace(Duration::from_secs(1)).unwrap_err();
        // 600 ms slept, 100 ms held, then 400 ms more would end at 1.1 s: stop at 700 ms.
        assert_eq!(
            err,
            AcquireError::TooLong {
                wait: 400 * MS,
                waited: 700 * MS,
                max_wait: Duration::from_secs(1)
            }
        );
        assert_eq!(s.now.get(), 700 * MS, "no sleep before giving up");
        assert!(err.to_string().contains("past the 1s this caller may wait"));
        // A wait that ends exactly at the longest is still waited.
        let s = Script::new(vec![
            (Duration::ZERO, refused(1_000)),
            (Duration::ZERO, Answer::Allowed),
        ]);
        let got = s.pace(Duration::from_secs(1)).unwrap();
        assert_eq!((got.waited, got.refusals), (1_000 * MS, 1));
    }

    #[test]
    fn a_zero_wait_still_pauses_and_an_open_failure_goes_ahead() {
        let s = Script::new(vec![
            (Duration::ZERO, refused(0)),
            (Duration::ZERO, Answer::Allowed),
        ]);
        assert_eq!(s.pace(Duration::from_secs(1)).unwrap().waited, MIN_PAUSE);
        let clock = Clock {
            elapsed: || Duration::ZERO,
            sleep: |_| std::future::ready(()),
        };
        let open = pace(&clock, Duration::from_secs(1), |_| {
            std::future::ready(Asked::FailedOpen)
        })
        .now_or_never()
        .expect("ready")
        .unwrap();
        assert!(open.failed_open);
        assert_eq!(open.refusals, 0);
    }
}

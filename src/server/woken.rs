//! Futures a task waits on beside its main one, polled only when they asked to be. Each has a
//! bit in one word, set by its own waker before it wakes the task, so that a task woken for
//! its main future (a quota stream's next message) polls none of the others, and one woken for
//! another polls that one alone.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Wake, Waker};

use futures_util::task::AtomicWaker;

/// The bits set since the task last looked, and the task to wake when one is set.
#[derive(Debug, Default)]
struct Shared {
    bits: AtomicU32,
    task: AtomicWaker,
}

/// The waker given to the future of one bit.
struct BitWaker {
    shared: Arc<Shared>,
    bit: u32,
}

impl Wake for BitWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Release: whatever the future did before its wake is seen by the poll the bit asks for.
        self.shared.bits.fetch_or(self.bit, Ordering::Release);
        self.shared.task.wake();
    }
}

/// The wakers of up to 32 futures, by place, and which of them were woken.
#[derive(Debug)]
pub(crate) struct Woken {
    shared: Arc<Shared>,
    wakers: Vec<Waker>,
}

impl Woken {
    /// The wakers of `n` futures (at most 32), every one marked woken, so that each is polled
    /// once at first.
    pub(crate) fn new(n: u32) -> Self {
        assert!(n <= u32::BITS, "at most {} futures", u32::BITS);
        let all = u32::MAX.checked_shr(u32::BITS - n).unwrap_or(0);
        let shared = Arc::new(Shared {
            bits: AtomicU32::new(all),
            task: AtomicWaker::new(),
        });
        let wakers = (0..n)
            .map(|i| {
                Waker::from(Arc::new(BitWaker {
                    shared: Arc::clone(&shared),
                    bit: 1 << i,
                }))
            })
            .collect();
        Self { shared, wakers }
    }

    /// The futures woken since the last look, each to be polled with [`Woken::context`]; from
    /// now on a wake of any of them wakes `cx`'s task. A future looked at but not polled is
    /// [`Woken::mark`]ed again.
    pub(crate) fn take(&self, cx: &Context<'_>) -> u32 {
        // The task first: a wake after the bits are taken finds it.
        self.shared.task.register(cx.waker());
        // Acquire: pairs with the wakes' Release.
        self.shared.bits.swap(0, Ordering::Acquire)
    }

    /// Marks the futures of `bits` woken, as after a change that moves what one waits for.
    pub(crate) fn mark(&self, bits: u32) {
        self.shared.bits.fetch_or(bits, Ordering::Relaxed);
    }

    /// The context to poll the future at place `i` with.
    pub(crate) fn context(&self, i: u32) -> Context<'_> {
        Context::from_waker(&self.wakers[i as usize])
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// Counts its wakes.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_future_is_looked_at_once_at_first_and_then_only_when_woken() {
        let task = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&task));
        let cx = Context::from_waker(&waker);
        let woken = Woken::new(3);
        assert_eq!(woken.take(&cx), 0b111, "all at first");
        assert_eq!(woken.take(&cx), 0, "none since");
        woken.context(1).waker().wake_by_ref();
        assert_eq!(task.0.load(Ordering::Relaxed), 1, "the task was woken");
        assert_eq!(woken.take(&cx), 0b010);
        woken.context(0).waker().wake_by_ref();
        woken.context(2).waker().wake_by_ref();
        assert_eq!(woken.take(&cx), 0b101);
        woken.mark(0b100);
        assert_eq!(woken.take(&cx), 0b100, "marked by hand");
        assert_eq!(woken.take(&cx), 0);
    }

    #[test]
    fn thirty_two_futures_have_a_bit_each() {
        let task = Arc::new(Count::default());
        let waker = Waker::from(task);
        let woken = Woken::new(32);
        assert_eq!(woken.take(&Context::from_waker(&waker)), u32::MAX);
        assert_eq!(Woken::new(0).take(&Context::from_waker(&waker)), 0);
    }
}

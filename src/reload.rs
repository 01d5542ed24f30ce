//! Hot reload: turns changes to the policy directory (a file added, changed or removed, or a
//! Kubernetes ConfigMap's `..data` symlink swapped to a new directory) and SIGHUP into one
//! debounced reload: load → validate → swap atomically.
//!
//! A load that fails keeps the running policies, logs every problem and counts the failure;
//! requests never see a partial set. Counters live in the store under rule identities, so rules
//! that did not change keep their state, and a rule whose rate changed has its stored debt capped
//! to the new bucket at its next decision (no fresh burst for everyone).
//!
//! The load runs on the blocking pool and only the swap happens on the runtime: a 15 MB policy
//! file takes seconds to compile, and no request waits for it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::policy::{self, LoadOptions, PolicyError, PolicyHandle, PolicySet, Summary};

/// Quiet time after the last change before reloading: editors and the kubelet write in bursts.
pub const DEBOUNCE: Duration = Duration::from_millis(250);

/// The longest a burst of changes can postpone a reload.
const MAX_DELAY: Duration = Duration::from_secs(2);

/// Reloads one policy directory into one handle.
#[derive(Debug, Clone)]
pub struct Reloader {
    dir: PathBuf,
    options: LoadOptions,
    policies: PolicyHandle,
    metrics: Arc<Metrics>,
}

impl Reloader {
    /// A reloader of `dir` into `policies`.
    #[must_use]
    pub fn new(dir: &Path, policies: PolicyHandle, metrics: Arc<Metrics>) -> Self {
        Self {
            dir: dir.to_path_buf(),
            options: LoadOptions::default(),
            policies,
            metrics,
        }
    }

    /// Loads with `options` (by default an empty directory is refused).
    #[must_use]
    pub fn with_options(mut self, options: LoadOptions) -> Self {
        self.options = options;
        self
    }

    /// Loads the directory and, if every file is valid, swaps the new set in, all on the calling
    /// thread (the watcher's reloads load on the blocking pool instead).
    ///
    /// # Errors
    ///
    /// [`PolicyError`] listing every problem; the running policies are kept.
    pub fn apply(&self) -> Result<Summary, PolicyError> {
        let loaded = policy::load_dir_with(&self.dir, self.options);
        self.install(loaded).map(|(summary, _old)| summary)
    }

    /// Swaps a loaded set in (or logs and counts why not): the previous set, to be dropped by
    /// the caller wherever suits it.
    fn install(
        &self,
        loaded: Result<PolicySet, PolicyError>,
    ) -> Result<(Summary, Arc<PolicySet>), PolicyError> {
        match loaded {
            Ok(set) => {
                let summary = set.summary();
                let old = self.policies.swap(set);
                self.metrics.policy_load(true, true);
                tracing::info!(policies = %self.dir.display(), %summary, "policies reloaded");
                Ok((summary, old))
            }
            Err(e) => {
                self.metrics.policy_load(false, true);
                tracing::warn!(policies = %self.dir.display(), error = %e, "policy reload rejected; keeping the running policies");
                Err(e)
            }
        }
    }

    /// One reload from the runtime: load on the blocking pool, swap here, drop the previous set
    /// on the blocking pool too (freeing a large set takes a while).
    async fn reload(&self) {
        let this = self.clone();
        self.reload_with(move || policy::load_dir_with(&this.dir, this.options))
            .await;
    }

    async fn reload_with<F>(&self, load: F)
    where
        F: FnOnce() -> Result<PolicySet, PolicyError> + Send + 'static,
    {
        let loaded = match tokio::task::spawn_blocking(load).await {
            Ok(loaded) => loaded,
            Err(e) => {
                self.metrics.policy_load(false, true);
                tracing::error!(policies = %self.dir.display(), error = %e, "policy reload failed; keeping the running policies");
                return;
            }
        };
        if let Ok((_, old)) = self.install(loaded) {
            tokio::task::spawn_blocking(move || drop(old));
        }
    }

    /// Watches the directory (when `watch`) and SIGHUP until `stop`, reloading after each
    /// debounced burst of changes. Falls back to SIGHUP alone if the directory cannot be watched.
    pub async fn run(self, watch: bool, stop: CancellationToken) {
        let (tx, mut rx) = mpsc::unbounded_channel::<()>();
        let _watcher = if watch {
            match self.watch(tx.clone()) {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!(policies = %self.dir.display(), error = %e, "cannot watch the policy directory; reload with SIGHUP");
                    None
                }
            }
        } else {
            None
        };
        spawn_sighup(tx, stop.clone());
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                got = rx.recv() => if got.is_none() { return },
            }
            // Debounce: wait for a quiet spell, but not forever.
            let deadline = tokio::time::Instant::now() + MAX_DELAY;
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(DEBOUNCE) => break,
                    got = rx.recv() => if got.is_none() || tokio::time::Instant::now() >= deadline { break },
                }
            }
            self.reload().await;
        }
    }

    fn watch(&self, tx: mpsc::UnboundedSender<()>) -> notify::Result<RecommendedWatcher> {
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                match event {
                    // Reads (including our own) are not changes.
                    Ok(e) if matches!(e.kind, EventKind::Access(_)) => {}
                    Ok(_) | Err(_) => {
                        let _ = tx.send(());
                    }
                }
            })?;
        watcher.watch(&self.dir, RecursiveMode::NonRecursive)?;
        Ok(watcher)
    }
}

#[cfg(unix)]
fn spawn_sighup(tx: mpsc::UnboundedSender<()>, stop: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP");
            return;
        }
    };
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                got = hup.recv() => {
                    if got.is_none() { return }
                    tracing::info!("SIGHUP: reloading policies");
                    if tx.send(()).is_err() { return }
                }
            }
        }
    });
}

#[cfg(not(unix))]
fn spawn_sighup(_tx: mpsc::UnboundedSender<()>, _stop: CancellationToken) {}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    use super::*;

    fn write(dir: &Path, file: &str, domain: &str) {
        let tmp = dir.join(".tmp");
        std::fs::write(&tmp, format!("domain: {domain}\n")).unwrap();
        std::fs::rename(&tmp, dir.join(file)).unwrap();
    }

    fn reloader(dir: &Path) -> (Reloader, PolicyHandle) {
        let handle = PolicyHandle::new(policy::load_dir(dir).unwrap());
        let metrics = Arc::new(Metrics::install(10));
        (Reloader::new(dir, handle.clone(), metrics), handle)
    }

    /// The load runs off the runtime: on a single-threaded runtime, another task runs while a
    /// load is in progress (here, a load that waits for that task, up to 10 s).
    #[tokio::test(flavor = "current_thread")]
    async fn the_load_does_not_hold_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a.yaml", "before");
        let (reloader, handle) = reloader(dir.path());
        write(dir.path(), "a.yaml", "after");
        let other_ran = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&other_ran);
        // Relaxed: the flag is the only data shared, and nothing is published through it.
        tokio::spawn(async move { flag.store(true, Ordering::Relaxed) });
        let seen = Arc::clone(&other_ran);
        let this = reloader.clone();
        reloader
            .reload_with(move || {
                let deadline = Instant::now() + Duration::from_secs(10);
                while !seen.load(Ordering::Relaxed) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                policy::load_dir(&this.dir)
            })
            .await;
        assert!(
            other_ran.load(Ordering::Relaxed),
            "no other task ran during the load"
        );
        assert!(handle.load().domain("after").is_some());
    }
}

//! Hot reload: changes to the policy directory (a file added, changed or removed, a ConfigMap's
//! `..data` symlink swapped, the directory replaced or recreated) and SIGHUP become one
//! debounced reload: load → validate → swap atomically. A failed load keeps the running
//! policies, logs every problem and counts the failure; requests never see a partial set. Rules
//! that did not change keep their counters (stored under rule identities); a changed rate caps
//! the stored debt at the next decision, so no fresh burst. Every [`RESCAN_INTERVAL`] the
//! directory's [`Fingerprint`] catches what inotify misses. Loads run on the blocking pool: no
//! request waits for a large policy file to compile.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::{LoadResult, LoadTrigger, Metrics};
use crate::policy::{self, LoadOptions, PolicyError, PolicyHandle, PolicySet, Summary};

/// Quiet time after the last change before reloading: editors and the kubelet write in bursts.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

/// The longest a burst of changes can postpone a reload.
const MAX_DELAY: Duration = Duration::from_secs(2);

/// How often a watched directory is compared with what the last load read, to catch what the
/// watcher missed. Short enough to follow a replaced directory within seconds, long enough to
/// cost nothing (one listing and a `stat` per policy file).
pub const RESCAN_INTERVAL: Duration = Duration::from_secs(2);

/// Reloads one policy directory into one handle.
#[derive(Debug, Clone)]
pub struct Reloader {
    dir: PathBuf,
    options: LoadOptions,
    policies: PolicyHandle,
    metrics: Arc<Metrics>,
    rescan: Duration,
    /// The directory as it was when this reloader was made, just after the startup load.
    initial: Fingerprint,
}

impl Reloader {
    /// A reloader of `dir` into `policies`, made right after they were loaded: the re-scan
    /// compares the directory with what it is now.
    #[must_use]
    pub fn new(dir: &Path, policies: PolicyHandle, metrics: Arc<Metrics>) -> Self {
        Self {
            dir: dir.to_path_buf(),
            options: LoadOptions::default(),
            policies,
            metrics,
            rescan: RESCAN_INTERVAL,
            initial: Fingerprint::of(dir, LoadOptions::default().files),
        }
    }

    /// Loads with `options` (by default an empty directory is refused).
    #[must_use]
    pub fn with_options(mut self, options: LoadOptions) -> Self {
        self.options = options;
        self.initial = Fingerprint::of(&self.dir, options.files);
        self
    }

    /// Swaps a loaded set in (or logs and counts why not): the previous set, to be dropped by
    /// the caller wherever suits it.
    fn install(
        &self,
        loaded: Result<PolicySet, PolicyError>,
    ) -> Result<(Summary, Arc<PolicySet>), PolicyError> {
        let swapped = self.metrics.swap_policies(&self.policies, loaded);
        match &swapped {
            Ok((summary, _)) => {
                tracing::info!(policies = %self.dir.display(), %summary, "policies reloaded");
            }
            Err(e) => {
                tracing::warn!(policies = %self.dir.display(), error = %e, "policy reload rejected; keeping the running policies");
            }
        }
        swapped
    }

    /// What a load of the directory would read now.
    fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.dir, self.options.files)
    }

    /// One reload from the runtime: fingerprint and load on the blocking pool, swap here, drop
    /// the previous set on the blocking pool too (freeing a large set takes a while). Returns
    /// the fingerprint taken just before the load, or `None` if the load did not finish.
    async fn reload(&self) -> Option<Fingerprint> {
        let this = self.clone();
        self.reload_with(move || {
            let fingerprint = this.fingerprint();
            (fingerprint, policy::load_dir_with(&this.dir, this.options))
        })
        .await
    }

    async fn reload_with<F>(&self, load: F) -> Option<Fingerprint>
    where
        F: FnOnce() -> (Fingerprint, Result<PolicySet, PolicyError>) + Send + 'static,
    {
        let (fingerprint, loaded) = match tokio::task::spawn_blocking(load).await {
            Ok(done) => done,
            Err(e) => {
                self.metrics
                    .policy_loaded(LoadResult::Failure, LoadTrigger::Reload);
                tracing::error!(policies = %self.dir.display(), error = %e, "policy reload failed; keeping the running policies");
                return None;
            }
        };
        if let Ok((_, old)) = self.install(loaded) {
            tokio::task::spawn_blocking(move || drop(old));
        }
        Some(fingerprint)
    }

    /// Watches the directory (when `watch`) and SIGHUP until `stop`, reloading after each
    /// debounced burst of changes, and re-scanning every [`RESCAN_INTERVAL`] for changes the
    /// watcher missed. Falls back to SIGHUP and the re-scan if the directory cannot be watched.
    pub async fn run(self, watch: bool, stop: CancellationToken) {
        let (tx, mut rx) = mpsc::unbounded_channel::<()>();
        let mut dir_watch = if watch {
            DirWatch::new(&self.dir, tx.clone())
        } else {
            None
        };
        spawn_sighup(tx, stop.clone());
        let mut last = self.initial.clone();
        let mut rescan =
            tokio::time::interval_at(tokio::time::Instant::now() + self.rescan, self.rescan);
        rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                got = rx.recv() => {
                    if got.is_none() { return }
                    // Debounce: wait for a quiet spell, but not forever.
                    let deadline = tokio::time::Instant::now() + MAX_DELAY;
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => return,
                            () = tokio::time::sleep(DEBOUNCE) => break,
                            got = rx.recv() => if got.is_none() || tokio::time::Instant::now() >= deadline { break },
                        }
                    }
                }
                _ = rescan.tick(), if watch => {
                    let Some(now) = self.scan().await else { continue };
                    if now == last {
                        if let Some(w) = &mut dir_watch && !w.armed {
                            w.rearm();
                        }
                        continue;
                    }
                    tracing::info!(policies = %self.dir.display(), "policy directory changed (found by re-scan); reloading");
                }
            }
            if let Some(w) = &mut dir_watch {
                w.rearm();
            }
            if let Some(fingerprint) = self.reload().await {
                last = fingerprint;
            }
        }
    }

    /// The fingerprint, taken on the blocking pool.
    async fn scan(&self) -> Option<Fingerprint> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.fingerprint())
            .await
            .ok()
    }
}

/// What a load of a policy directory reads, cheaply: for each entry named as a policy file, its
/// name and, following symlinks as the loader does, its type, length, modification time and
/// inode (or why it cannot be read); or why the directory cannot be listed. Two equal
/// fingerprints mean a load would read the same files, short of a rewrite that keeps the inode,
/// the length and the modification time (which the watcher sees).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Fingerprint(Result<Vec<Entry>, std::io::ErrorKind>);

/// A policy file's name and, if it can be read, its identity and version.
type Entry = (OsString, Result<Stamp, std::io::ErrorKind>);

/// One file's identity and version.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp {
    kind: std::fs::FileType,
    len: u64,
    modified: Option<SystemTime>,
    inode: (u64, u64),
}

impl Fingerprint {
    /// The fingerprint of the policy files of `dir` now, as `files` selects them.
    fn of(dir: &Path, files: policy::Files) -> Self {
        let files = match policy::policy_files(dir, files) {
            Ok(files) => files,
            Err(PolicyError::Dir { source, .. }) => return Self(Err(source.kind())),
            Err(_) => return Self(Err(std::io::ErrorKind::Other)),
        };
        Self(Ok(files
            .into_iter()
            .map(|path| {
                let stamp = std::fs::metadata(&path)
                    .map(|m| Stamp {
                        kind: m.file_type(),
                        len: m.len(),
                        modified: m.modified().ok(),
                        inode: inode(&m),
                    })
                    .map_err(|e| e.kind());
                (path.file_name().unwrap_or_default().to_os_string(), stamp)
            })
            .collect()))
    }
}

#[cfg(unix)]
fn inode(m: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (m.dev(), m.ino())
}

#[cfg(not(unix))]
fn inode(_m: &std::fs::Metadata) -> (u64, u64) {
    (0, 0)
}

/// The watch on the policy directory and its parent (both non-recursive), which survives the
/// directory being replaced: an event on the parent counts only when it names the directory,
/// and the directory's own watch is added again before every reload, since a replaced directory
/// is a new inode and a removed one may come back. Inotify still misses some changes (a file
/// symlinked from elsewhere rewritten in place, a directory mounted over): the rescan's
/// fingerprint (one listing and one `stat` per policy file) is what catches those.
struct DirWatch {
    /// The directory, absolute, as the watcher names it in events.
    dir: PathBuf,
    watcher: RecommendedWatcher,
    /// Whether the directory itself is being watched (it may not exist for a while).
    armed: bool,
}

impl DirWatch {
    /// Watches `dir` and its parent, or logs why not (SIGHUP and the re-scan still work).
    fn new(dir: &Path, tx: mpsc::UnboundedSender<()>) -> Option<Self> {
        match Self::try_new(dir, tx) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(policies = %dir.display(), error = %e, "cannot watch the policy directory; reloading on SIGHUP and re-scan");
                None
            }
        }
    }

    fn try_new(dir: &Path, tx: mpsc::UnboundedSender<()>) -> notify::Result<Self> {
        let dir = std::path::absolute(dir).map_err(notify::Error::io)?;
        let ours = dir.clone();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                match event {
                    // Reads (including our own) are not changes.
                    Ok(e) if matches!(e.kind, EventKind::Access(_)) => {}
                    // The parent's other entries are none of our business.
                    Ok(e) if !e.need_rescan() && !e.paths.iter().any(|p| p.starts_with(&ours)) => {}
                    Ok(_) | Err(_) => {
                        let _ = tx.send(());
                    }
                }
            })?;
        // Without the parent, a replaced directory is found by the re-scan alone.
        if let Some(parent) = dir.parent()
            && let Err(e) = watcher.watch(parent, RecursiveMode::NonRecursive)
        {
            tracing::warn!(policies = %dir.display(), error = %e, "cannot watch the policy directory's parent");
        }
        let mut w = Self {
            dir,
            watcher,
            armed: false,
        };
        w.rearm();
        Ok(w)
    }

    /// Watches the directory afresh: after a replacement the old watch follows the old inode
    /// (or is gone with it), so it is dropped and the path watched again.
    fn rearm(&mut self) {
        if self.armed {
            let _ = self.watcher.unwatch(&self.dir);
        }
        self.armed = match self.watcher.watch(&self.dir, RecursiveMode::NonRecursive) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(policies = %self.dir.display(), error = %e, "policy directory not watched yet");
                false
            }
        };
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

    async fn eventually(timeout: Duration, check: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        while !check() {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    fn reloader(dir: &Path) -> (Reloader, PolicyHandle) {
        let handle = PolicyHandle::new(policy::load_dir(dir).unwrap());
        let metrics = Arc::new(Metrics::install(10));
        (Reloader::new(dir, handle.clone(), metrics), handle)
    }

    /// The watcher alone (no re-scan) follows the directory through a replacement by rename and
    /// through removal and re-creation, and keeps following it afterwards.
    #[tokio::test]
    async fn the_watch_is_rearmed_on_a_replaced_directory() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("policies");
        std::fs::create_dir(&dir).unwrap();
        write(&dir, "p.yaml", "zero");
        let (reloader, handle) = reloader(&dir);
        let reloader = Reloader {
            rescan: Duration::from_secs(3_600),
            ..reloader
        };
        let stop = CancellationToken::new();
        let task = tokio::spawn(reloader.run(true, stop.clone()));
        let has = |domain: &'static str| {
            let handle = handle.clone();
            move || handle.load().domain(domain).is_some()
        };
        let within = Duration::from_secs(5);
        // Watching has begun once an edit is seen (the task starts at some point after spawn).
        let started = Instant::now();
        while !has("one")() {
            assert!(started.elapsed() < within, "the watcher never started");
            write(&dir, "p.yaml", "one");
            eventually(Duration::from_millis(500), has("one")).await;
        }

        let new = parent.path().join("policies.new");
        let old = parent.path().join("policies.old");
        std::fs::create_dir(&new).unwrap();
        write(&new, "p.yaml", "two");
        std::fs::rename(&dir, &old).unwrap();
        std::fs::rename(&new, &dir).unwrap();
        std::fs::remove_dir_all(&old).unwrap();
        assert!(eventually(within, has("two")).await, "replaced by rename");
        write(&dir, "p.yaml", "three");
        assert!(eventually(within, has("three")).await, "edit after rename");

        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::create_dir(&dir).unwrap();
        write(&dir, "p.yaml", "four");
        assert!(
            eventually(within, has("four")).await,
            "removed and recreated"
        );
        write(&dir, "p.yaml", "five");
        assert!(
            eventually(within, has("five")).await,
            "edit after re-creation"
        );
        stop.cancel();
        task.await.unwrap();
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
        let fingerprint = reloader
            .reload_with(move || {
                let deadline = Instant::now() + Duration::from_secs(10);
                while !seen.load(Ordering::Relaxed) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                (this.fingerprint(), policy::load_dir(&this.dir))
            })
            .await;
        assert!(
            other_ran.load(Ordering::Relaxed),
            "no other task ran during the load"
        );
        assert_eq!(
            fingerprint,
            Some(Fingerprint::of(dir.path(), policy::Files::Yaml))
        );
        assert!(handle.load().domain("after").is_some());
    }

    #[test]
    fn the_fingerprint_changes_with_what_a_load_reads() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write(d, "a.yaml", "a");
        let first = Fingerprint::of(d, policy::Files::Yaml);
        assert_eq!(
            first,
            Fingerprint::of(d, policy::Files::Yaml),
            "stable while nothing changes"
        );
        std::fs::write(d.join("README.md"), "not a policy").unwrap();
        assert_eq!(
            first,
            Fingerprint::of(d, policy::Files::Yaml),
            "other names do not count"
        );
        write(d, "a.yaml", "b");
        let second = Fingerprint::of(d, policy::Files::Yaml);
        assert_ne!(first, second, "rewritten (a new inode)");
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("gone.yaml", d.join("b.yaml")).unwrap();
            assert_ne!(
                second,
                Fingerprint::of(d, policy::Files::Yaml),
                "a dangling symlink counts"
            );
        }
        assert_ne!(
            Fingerprint::of(&d.join("missing"), policy::Files::Yaml),
            second
        );
    }
}

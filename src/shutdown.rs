//! The process's stop signal: a future that resolves on SIGTERM or SIGINT. The server takes any
//! future as its stop trigger, so tests use a channel instead.

/// Resolves when the process is asked to stop (SIGTERM or SIGINT, or Ctrl-C off Unix).
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!(signal = "SIGTERM", "stop requested"),
                    _ = int.recv() => tracing::info!(signal = "SIGINT", "stop requested"),
                }
                return;
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot install signal handlers; using Ctrl-C only");
            }
        }
    }
    if tokio::signal::ctrl_c().await.is_ok() {
        tracing::info!(signal = "ctrl-c", "stop requested");
    } else {
        std::future::pending::<()>().await;
    }
}

//! An etcd backend that connects when its cluster first answers: what
//! [`EtcdBuilder::build`] makes.
//!
//! A lazily built etcd client does not fit here: with credentials it
//! authenticates while being built, which fails while the cluster is down,
//! and a client whose channel was set up against a refusing endpoint may
//! need a few failed calls before it sends again. So the client is built
//! only once the cluster answers: every call until then
//! makes sure a connection exists, one attempt at a time and not more
//! often than every [`RETRY_EVERY`], each bounded by the request timeout,
//! and fails as `unavailable` while none does. A client that connected
//! once keeps reconnecting by itself.
//!
//! What a `Locker` reads when it is built is right from the start: the
//! capabilities are those of the same builder's backend (its minimum TTL
//! the declared or default one, as a lazy start assumes), and the loss feed
//! is made here and handed to the connection when it is made.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use crate::connection::{Connected, MinTtl};
use crate::EtcdBuilder;
use lock_core::{backend::LossFeed, BackendError, Capabilities};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

/// The least time between two connection attempts.
pub(crate) const RETRY_EVERY: Duration = Duration::from_millis(500);

/// An etcd backend that connects when its cluster first answers.
pub(crate) struct Deferred {
    builder: EtcdBuilder,
    capabilities: Capabilities,
    shown: Arc<str>,
    connected: Arc<OnceLock<Connected>>,
    /// Handed to `Locker`s before the cluster answers, and to the
    /// connection once it does.
    feed: LossFeed,
    attempts: Mutex<Attempts>,
}

/// The connection attempts made so far.
#[derive(Default)]
struct Attempts {
    /// When the last one started.
    started: Option<Instant>,
    /// The task running the last one.
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deferred")
            .field("url", &self.shown)
            .field("connected", &self.connected.get())
            .finish_non_exhaustive()
    }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        if let Some(task) = self.attempts().task.take() {
            task.abort();
        }
    }
}

impl Deferred {
    /// Wraps `builder`, whose cluster is not contacted yet; `capabilities`
    /// are those of its backend, `shown` its endpoints with credentials masked.
    pub(crate) fn new(builder: EtcdBuilder, capabilities: Capabilities, shown: String) -> Self {
        Self {
            builder,
            capabilities,
            shown: shown.into(),
            connected: Arc::default(),
            feed: LossFeed::new(),
            attempts: Mutex::default(),
        }
    }

    fn attempts(&self) -> MutexGuard<'_, Attempts> {
        // Each critical section leaves the record whole: poison carries no half-state.
        self.attempts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The connected backend, if the cluster has answered.
    pub(crate) fn connected(&self) -> Option<&Connected> {
        self.connected.get()
    }

    /// What a `Locker` reads when it is built: the capabilities of the
    /// builder's backend, known before the cluster answers.
    pub(crate) fn capabilities(&self) -> Capabilities {
        self.capabilities.clone()
    }

    /// The feed through which lost shared leases are reported, now and
    /// once connected.
    pub(crate) fn feed(&self) -> LossFeed {
        self.feed.clone()
    }

    /// The builder this backend connects with.
    pub(crate) fn builder(&self) -> &EtcdBuilder {
        &self.builder
    }

    fn unavailable(&self, why: &str) -> BackendError {
        BackendError::unavailable(format!(
            "etcd at {} has not answered yet ({why}); lock calls fail closed until it does",
            self.shown
        ))
    }

    /// The connected backend, connecting it if this call may try now.
    ///
    /// The attempt runs in a task of its own, so that it ends by its bound
    /// whatever becomes of the call that started it, and no lock is held
    /// across an await. Cancel safe.
    pub(crate) async fn backend(&self) -> Result<&Connected, BackendError> {
        if let Some(b) = self.connected.get() {
            return Ok(b);
        }
        let limit = self.builder.request_timeout();
        let outcome = {
            let mut attempts = self.attempts();
            let running = attempts.task.as_ref().is_some_and(|t| !t.is_finished());
            let since = attempts.started.map(|at| at.elapsed());
            // An attempt that outlived twice its bound is stuck: replace it.
            if running && since.is_some_and(|s| s <= limit * 2) {
                return Err(self.unavailable("a connection attempt is under way"));
            }
            if !running && since.is_some_and(|s| s < RETRY_EVERY) {
                return Err(self.unavailable("the last attempt failed moments ago"));
            }
            if let Some(stuck) = attempts.task.take() {
                stuck.abort();
            }
            let (tx, rx) = oneshot::channel();
            let (builder, connected) = (self.builder.clone(), Arc::clone(&self.connected));
            let shown = Arc::clone(&self.shown);
            let feed = self.feed.clone();
            // The connection must not raise the minimum TTL above the
            // capabilities already handed out: every acquire of a `Locker`
            // built on them would be refused. A cluster whose minimum is
            // higher grants longer leases than asked, which only delays the
            // takeover of an abandoned lock.
            let min_ttl = MinTtl::Keep(self.capabilities.min_ttl);
            attempts.started = Some(Instant::now());
            attempts.task = Some(tokio::spawn(async move {
                let answer = match tokio::time::timeout(
                    limit,
                    Connected::connect(builder, min_ttl, feed),
                )
                .await
                {
                    Ok(Ok(backend)) => {
                        info!(url = %shown, "etcd answers; lock calls go through from now on");
                        let _ = connected.set(backend);
                        Ok(())
                    }
                    Ok(Err(e)) => {
                        if !e.kind().is_unavailable() {
                            warn!(url = %shown, error = %e, "etcd answered but refused the connection");
                        }
                        Err(e)
                    }
                    Err(_) => Err(BackendError::timeout(format!(
                        "connecting to etcd at {shown} took over {limit:?}"
                    ))),
                };
                let _ = tx.send(answer);
            }));
            rx
        };
        match tokio::time::timeout(limit, outcome).await {
            Ok(Ok(Ok(()))) => self
                .connected
                .get()
                .ok_or_else(|| self.unavailable("the connection was lost at once")),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(self.unavailable("the connection attempt was abandoned")),
            Err(_) => Err(BackendError::timeout(format!(
                "connecting to etcd at {} took over {limit:?}",
                self.shown
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, TcpListener};

    use lock_core::backend::ReleaseOutcome;
    use lock_core::{BackendErrorKind, LockBackend, LockName, OwnerToken, TickStore};

    use super::*;
    use crate::EtcdBackend;

    /// A loopback port nothing listens on (bound, then released).
    fn refusing_port() -> u16 {
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port")
    }

    #[tokio::test]
    async fn fails_closed_once_per_interval_before_the_cluster_answers() {
        let url = format!("etcd://u:s3cret@127.0.0.1:{}", refusing_port());
        let builder = EtcdBuilder::from_url(&url).expect("a valid URL");
        let capabilities = builder.lazy_capabilities();
        let deferred =
            EtcdBackend::deferred(Deferred::new(builder, capabilities.clone(), "shown".into()));
        assert_eq!(
            deferred.capabilities(),
            capabilities,
            "known before connecting"
        );
        assert!(deferred.loss_feed().is_some(), "known before connecting");
        let (name, owner) = (
            LockName::new("deferred").expect("name"),
            OwnerToken::generate().expect("token"),
        );
        assert_eq!(
            deferred.release(&name, &owner).await.expect("no call"),
            ReleaseOutcome::NotHeld,
            "nothing can be held before the first connection"
        );
        let first = deferred
            .try_acquire(&name, &owner, Duration::from_secs(5))
            .await
            .expect_err("the cluster is down");
        assert!(first.kind().is_unavailable(), "{first}");
        // At once again: no second attempt within the retry interval.
        let second = deferred
            .is_completed(&name, 1)
            .await
            .expect_err("still down");
        assert_eq!(second.kind(), BackendErrorKind::Unavailable);
        assert!(second.to_string().contains("moments ago"), "{second}");
        for e in [&first, &second] {
            assert!(!format!("{e} {e:?}").contains("s3cret"), "{e}");
        }
        assert!(deferred.min_ttl() == capabilities.min_ttl);
    }
}

//! An in-process [`LockBackend`]: the embedded default.
//!
//! Locks live in a map shared by every clone of one [`MemoryBackend`], so
//! several [`Locker`](lock_core::Locker)s over clones of it behave like
//! replicas sharing one lock server. Expiry uses tokio's clock, which lets
//! tests pause and advance time exactly.
//!
//! It coordinates tasks of one process only: use it for single-replica
//! deployments, development and tests, and a server backend for more replicas.
//!
//! With the `test-util` feature, the saboteur methods `MemoryBackend::steal`
//! and `MemoryBackend::expire` change a lease behind its holder's back, the
//! way another client or an operator could on a real server, and
//! `Intercepted` changes some of its calls for a test (a stall, a count, a
//! refusal) while the others stay the memory backend's own.
#![forbid(unsafe_code)]

mod inspect;
#[cfg(feature = "test-util")]
mod intercept;
mod ticks;
mod waiters;

#[cfg(feature = "test-util")]
pub use intercept::{Counting, Intercept, Intercepted, Renewal};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{
    async_trait,
    backend::{
        AcquireAttempt, Expiry, Lease, LeaseStatus, LocalTicks, ReleaseOutcome, ReleaseSignal,
        RenewRequest,
    },
    BackendError, BackendErrorKind, Capabilities, ForceOutcome, Holder, HolderPage, Identity,
    LockBackend, LockName, OwnerToken, MAX_TTL,
};
use tokio::time::{sleep_until, Instant};

use crate::waiters::{Subscription, Waiters};

/// Expired entries are purged on acquire once the map holds more than this
/// many entries, and more than twice as many as the last purge left.
const PURGE_THRESHOLD: usize = 1024;

/// The in-process lock backend. Clones share the same locks.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use std::time::Duration;
/// use lock_core::{Locker, LockName, LockOptions};
/// use lock_memory::MemoryBackend;
///
/// let backend = MemoryBackend::new();
/// let a = Locker::builder().with_backend(backend.clone()).with_registry(&Default::default()).build()?;
/// let b = Locker::builder().with_backend(backend).with_registry(&Default::default()).build()?;
/// let name = LockName::new("job")?;
/// let opts = LockOptions::new(Duration::from_secs(5));
/// let guard = a.try_lock(&name, &opts).await?;
/// assert!(b.try_lock(&name, &opts).await.is_err());
/// guard.release().await?;
/// assert!(b.try_lock(&name, &opts).await.is_ok());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryBackend {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    fence: AtomicU64,
    ticks: LocalTicks,
}

impl Shared {
    /// The next fencing token. One counter for all names: strictly
    /// increasing per name as required, without keeping a counter per name
    /// ever used.
    fn next_fence(&self) -> u64 {
        self.fence.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section is a single map update, so a poisoned lock
        // cannot hold a half-applied change.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug, Default)]
struct State {
    locks: HashMap<LockName, Entry>,
    /// Leases freed by a forced release, by name: the freed owner and until
    /// when its renewals answer `Forced` (its lease's expiry).
    forced: HashMap<LockName, (OwnerToken, Instant)>,
    waiters: Waiters,
    /// How many entries the last purge left behind.
    purged_to: usize,
    /// Purges run so far, to test that they stay rare.
    #[cfg(test)]
    purges: usize,
}

#[derive(Debug, Clone)]
struct Entry {
    owner: OwnerToken,
    expires_at: Instant,
    fence: u64,
    /// Who took it and when, for inspections.
    meta: inspect::Meta,
}

/// When a lease taken or renewed at `now` for `ttl` expires. A TTL past
/// [`MAX_TTL`] is refused as the `Locker` refuses it, so that no caller of
/// the trait can overflow the clock.
fn expiry(now: Instant, ttl: Duration) -> Result<Instant, BackendError> {
    let refused = || {
        BackendError::new(
            BackendErrorKind::Config,
            format!("a TTL of {ttl:?} is longer than the longest lock TTL, {MAX_TTL:?}"),
        )
    };
    if ttl > MAX_TTL {
        return Err(refused());
    }
    now.checked_add(ttl).ok_or_else(refused)
}

impl State {
    /// The live entry for `name`, dropping it if it has expired.
    fn live(&mut self, name: &LockName, now: Instant) -> Option<&mut Entry> {
        if self.locks.get(name).is_some_and(|e| e.expires_at <= now) {
            self.locks.remove(name);
        }
        self.locks.get_mut(name)
    }

    fn status(&mut self, name: &LockName, owner: &OwnerToken, now: Instant) -> LeaseStatus {
        if self.was_forced(name, owner, now) {
            return LeaseStatus::Forced;
        }
        match self.live(name, now) {
            Some(e) if e.owner == *owner => LeaseStatus::Held,
            Some(_) => LeaseStatus::Stolen,
            None => LeaseStatus::Expired,
        }
    }

    fn renew(
        &mut self,
        name: &LockName,
        owner: &OwnerToken,
        expires_at: Instant,
        now: Instant,
    ) -> LeaseStatus {
        let status = self.status(name, owner, now);
        if status == LeaseStatus::Held {
            if let Some(e) = self.locks.get_mut(name) {
                e.expires_at = expires_at;
                e.meta.renewed(std::time::SystemTime::now());
            }
        }
        status
    }

    fn wake(&mut self, name: &LockName) {
        self.waiters.wake(name);
    }

    /// Drops expired entries once the map has doubled since the last purge.
    /// Purging at every acquire above a fixed size would scan every live
    /// lease per acquire: a scheduler keeping tens of thousands of finished
    /// ticks' locks as completion marks made each acquire cost a full scan.
    /// Doubling keeps the cost per acquire constant on average, and the map
    /// at most about twice its live size.
    fn purge_if_grown(&mut self, now: Instant) {
        let bound = self.purged_to.saturating_mul(2).max(PURGE_THRESHOLD);
        if self.locks.len() <= bound {
            return;
        }
        self.locks.retain(|_, e| e.expires_at > now);
        self.forced.retain(|_, (_, until)| *until > now);
        self.purged_to = self.locks.len();
        #[cfg(test)]
        {
            self.purges += 1;
        }
    }
}

impl MemoryBackend {
    fn acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        holder: Option<&Identity>,
    ) -> Result<AcquireAttempt, BackendError> {
        let now = Instant::now();
        let expires_at = expiry(now, ttl)?;
        let mut st = self.state();
        st.purge_if_grown(now);
        if st.live(name, now).is_some() {
            return Ok(AcquireAttempt::HeldElsewhere);
        }
        let fence = self.shared.next_fence();
        let meta = inspect::Meta::new(holder.cloned());
        st.locks.insert(
            name.clone(),
            Entry {
                owner: *owner,
                expires_at,
                fence,
                meta,
            },
        );
        Ok(AcquireAttempt::Acquired(Lease::new(Some(fence))))
    }

    /// An empty backend.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state()
    }

    /// Test hook (saboteur): hands `name` to a new owner for `ttl`, as another client
    /// overwriting the key would. Returns the thief's token, or `None` if the
    /// lock was not held.
    #[cfg(feature = "test-util")]
    pub fn steal(&self, name: &LockName, ttl: Duration) -> Option<OwnerToken> {
        let thief = OwnerToken::generate().ok()?;
        let now = Instant::now();
        let mut st = self.state();
        st.live(name, now)?;
        let entry = Entry {
            owner: thief,
            expires_at: expiry(now, ttl).ok()?,
            fence: self.shared.next_fence(),
            meta: inspect::Meta::new(None),
        };
        st.locks.insert(name.clone(), entry);
        Some(thief)
    }

    /// Test hook (saboteur): deletes `name` as if its TTL had run out. Returns whether a
    /// live lease was removed.
    #[cfg(feature = "test-util")]
    pub fn expire(&self, name: &LockName) -> bool {
        let now = Instant::now();
        let mut st = self.state();
        let removed = st.live(name, now).is_some();
        st.locks.remove(name);
        st.wake(name);
        removed
    }

    /// Test hook: the owner currently holding `name`, if any.
    #[cfg(feature = "test-util")]
    pub fn holder(&self, name: &LockName) -> Option<OwnerToken> {
        self.state().live(name, Instant::now()).map(|e| e.owner)
    }

    /// Test hook: how many names have a waiter entry, live or not. A backend
    /// that forgets abandoned waits keeps this at the number of live waits.
    #[cfg(feature = "test-util")]
    pub fn waiter_entries(&self) -> usize {
        self.state().waiters.len()
    }

    /// How many live leases exist.
    pub fn live_leases(&self) -> usize {
        let now = Instant::now();
        self.state()
            .locks
            .values()
            .filter(|e| e.expires_at > now)
            .count()
    }
}

#[async_trait]
impl LockBackend for MemoryBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(Expiry::Ttl)
            .with_fencing(true)
            .with_batch_renew(true)
            .with_release_notify(true)
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.acquire(name, owner, ttl, None)
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        let now = Instant::now();
        let expires_at = expiry(now, ttl)?;
        Ok(self.state().renew(name, owner, expires_at, now))
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        Ok(self.state().status(name, owner, Instant::now()))
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        let now = Instant::now();
        let mut st = self.state();
        match st.status(name, owner, now) {
            LeaseStatus::Held => {
                st.locks.remove(name);
                st.wake(name);
                Ok(ReleaseOutcome::Released)
            }
            _ => Ok(ReleaseOutcome::NotHeld),
        }
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        let now = Instant::now();
        let expiries = requests
            .iter()
            .map(|r| expiry(now, r.ttl))
            .collect::<Result<Vec<_>, _>>()?;
        let mut st = self.state();
        Ok(requests
            .iter()
            .zip(expiries)
            .map(|(r, at)| st.renew(&r.name, &r.owner, at, now))
            .collect())
    }

    async fn try_acquire_as(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        holder: &Identity,
    ) -> Result<AcquireAttempt, BackendError> {
        self.acquire(name, owner, ttl, Some(holder))
    }

    async fn describe(&self, name: &LockName) -> Result<Option<Holder>, BackendError> {
        Ok(self.state().describe(name, Instant::now()))
    }

    async fn list(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage, BackendError> {
        Ok(self.state().list(prefix, cursor, limit, Instant::now()))
    }

    async fn force_release(
        &self,
        name: &LockName,
        expected_token: u64,
    ) -> Result<ForceOutcome, BackendError> {
        Ok(self.state().force(name, expected_token, Instant::now()))
    }

    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        let now = Instant::now();
        let mut st = self.state();
        let expires_at = st.live(name, now).map(|e| e.expires_at);
        let notify = st.waiters.subscribe(name);
        drop(st);
        // Created after the state lock is dropped: its drop takes that lock.
        let subscription = Subscription::new(&self.shared, name.clone(), Arc::clone(&notify));
        let mut notified = Box::pin(notify.notified_owned());
        notified.as_mut().enable();
        Ok(Some(ReleaseSignal::new(async move {
            // Owned by the signal: however the wait ends, dropping the
            // signal counts this waiter out of the name's entry.
            let _subscription = subscription;
            // A lease that simply runs out wakes nobody; its expiry instant does.
            match expires_at {
                Some(at) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = sleep_until(at) => {}
                    }
                }
                None => notified.await,
            }
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> LockName {
        LockName::new(s).expect("valid name")
    }

    #[tokio::test(start_paused = true)]
    async fn expires_after_ttl_and_compares_on_owner() -> Result<(), Box<dyn std::error::Error>> {
        let b = MemoryBackend::new();
        let (a, other) = (OwnerToken::generate()?, OwnerToken::generate()?);
        let n = name("x");
        let ttl = Duration::from_secs(1);
        assert!(matches!(
            b.try_acquire(&n, &a, ttl).await?,
            AcquireAttempt::Acquired(_)
        ));
        assert_eq!(
            b.try_acquire(&n, &other, ttl).await?,
            AcquireAttempt::HeldElsewhere
        );
        assert_eq!(b.renew(&n, &other, ttl).await?, LeaseStatus::Stolen);
        assert_eq!(b.release(&n, &other).await?, ReleaseOutcome::NotHeld);
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(b.check(&n, &a).await?, LeaseStatus::Held);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(b.check(&n, &a).await?, LeaseStatus::Expired);
        assert_eq!(b.renew(&n, &a, ttl).await?, LeaseStatus::Expired);
        assert_eq!(
            b.holder(&n),
            None,
            "an expired lease is never re-created by renew"
        );
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn purges_stay_rare_with_many_live_leases_and_drop_expired_ones(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let b = MemoryBackend::new();
        let owner = OwnerToken::generate()?;
        let long = Duration::from_secs(3600);
        for i in 0..20_000 {
            b.try_acquire(&name(&format!("live/{i}")), &owner, long)
                .await?;
        }
        let purges = b.state().purges;
        // One purge per doubling past the threshold: 1024 -> 20,000 is 5.
        assert!(
            purges <= 5,
            "{purges} purges for 20,000 live acquires: a purge per acquire scans every lease"
        );
        for i in 0..30_000 {
            b.try_acquire(&name(&format!("short/{i}")), &owner, Duration::from_secs(1))
                .await?;
            if i % 1000 == 999 {
                tokio::time::advance(Duration::from_secs(2)).await;
            }
        }
        let len = b.state().locks.len();
        assert!(
            len <= 2 * 20_000 + 1000,
            "{len} entries for 20,000 live leases: expired ones are not purged"
        );
        assert_eq!(b.live_leases(), 20_000);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_wait_leaves_no_waiter_entry() -> Result<(), Box<dyn std::error::Error>> {
        let b = MemoryBackend::new();
        let n = name("x");
        let entries = |b: &MemoryBackend| b.state().waiters.len();
        let (first, second) = (
            b.subscribe_release(&n).await?,
            b.subscribe_release(&n).await?,
        );
        assert_eq!(entries(&b), 1, "one entry per name, however many wait");
        drop(first);
        assert_eq!(entries(&b), 1, "the second wait is still live");
        drop(second);
        assert_eq!(entries(&b), 0, "the last wait took the entry with it");
        // A waiter of a woken generation must not count down a newer one.
        let old = b.subscribe_release(&n).await?;
        b.state().wake(&n);
        let new = b.subscribe_release(&n).await?;
        drop(old);
        assert_eq!(entries(&b), 1, "the newer wait keeps its entry");
        drop(new);
        assert_eq!(entries(&b), 0);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn release_wakes_a_subscriber() -> Result<(), Box<dyn std::error::Error>> {
        let b = MemoryBackend::new();
        let a = OwnerToken::generate()?;
        let n = name("x");
        b.try_acquire(&n, &a, Duration::from_secs(60)).await?;
        let signal = b.subscribe_release(&n).await?.ok_or("memory notifies")?;
        let start = Instant::now();
        let b2 = b.clone();
        let n2 = n.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let _ = b2.release(&n2, &a).await;
        });
        signal.await;
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        Ok(())
    }
}

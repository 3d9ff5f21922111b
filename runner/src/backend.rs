//! From `--backend` or `LOCK_URL` to the lock backend.

use distlock::{Locks, LOCK_URL};

use crate::exit::{self, Failure};

/// Connects to the backend `--backend` names, or `LOCK_URL`. Unlike a
/// service, the runner has no unlocked mode: without either it refuses to
/// run, since a command run "under a lock" that is none is worse than no run.
/// A server that is down at start is not an error here: each acquisition
/// then fails closed (exec exits 69; cron skips the tick and retries).
pub(crate) async fn connect(backend: Option<&str>) -> Result<Locks, Failure> {
    let from_env = std::env::var(LOCK_URL).ok().filter(|u| !u.is_empty());
    let url = backend.map(str::to_owned).or(from_env).ok_or_else(|| {
        Failure::usage(format!(
            "no backend: pass --backend URL or set {LOCK_URL} (redis://, postgres://, etcd://)"
        ))
    })?;
    let policy = distlock::Policy::from_vars(Some(&url), Some("true"))
        .map_err(|e| Failure::usage(e.to_string()))?;
    distlock::from_policy(&policy)
        .await
        .map_err(|e| Failure::from_lock(&e, exit::UNAVAILABLE))
}

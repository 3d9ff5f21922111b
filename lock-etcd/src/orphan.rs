//! An acquire whose caller stops waiting still runs to its answer, and a
//! key it put is then deleted.
//!
//! Dropping the future of a sent transaction does not take it back: etcd
//! may apply the put after the caller has gone, and after the release the
//! caller's `Locker` sends to clean up (two calls on one channel are
//! separate streams, proposed to raft in whatever order the server's
//! goroutines reach it). Such a key sits on the shared lease, which every
//! other lock of the TTL keeps alive: held by nobody, for as long as this
//! process holds any lock. So the acquire is a
//! [`Detachable`](lock_core::detach::Detachable) whose clean-up, if its
//! caller went, deletes the key it took.

use lock_core::{backend::AcquireAttempt, BackendError, LockBackend, LockName, OwnerToken};
use tracing::{debug, warn};

use crate::connection::Connected;

/// The clean-up of an acquire of `name` for `owner` that answered after its
/// caller had gone: releases the lock if the acquire took it. (An error was
/// handled inside the acquire: a put whose answer is lost is kept to delete.)
pub(crate) async fn undo_if_taken(
    backend: Connected,
    name: LockName,
    owner: OwnerToken,
    outcome: Result<AcquireAttempt, BackendError>,
) {
    if !matches!(outcome, Ok(AcquireAttempt::Acquired(_))) {
        return;
    }
    match LockBackend::release(&backend, &name, &owner).await {
        Ok(_) => {
            debug!(lock = %name, "deleted the key an acquire put after its caller had gone");
        }
        Err(e) => {
            warn!(lock = %name, error = %e, "an acquire answered after its caller had gone and its key could not be deleted; it is kept to delete");
        }
    }
}

//! The operator's calls on a [`Locker`]: who holds a lock, which locks are
//! held, and a forced release. They go to the backend once, without retries:
//! an operator sees a failure and decides.

use crate::inspect::{validate_prefix, ForceOutcome, Holder, HolderPage, MAX_LIST_PAGE};
use crate::{Error, LockName, Locker, Result};

impl Locker {
    /// Who holds `name` now (identity, fencing token, when taken, renewed
    /// and due to expire), or `None` when it is free. Changes nothing.
    ///
    /// The answer can be stale the moment it returns: show it to people,
    /// never use it to decide whether to write. Cancel safe (a read).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] without a backend; [`Error::Backend`] when the
    /// backend failed or does not offer inspection
    /// ([`BackendErrorKind::Unsupported`](crate::BackendErrorKind::Unsupported)).
    pub async fn describe(&self, name: &LockName) -> Result<Option<Holder>> {
        let backend = self.admin_backend()?;
        Ok((**backend).describe(name).await?)
    }

    /// One page of the held locks whose names start with `prefix` (empty:
    /// every lock of this backend), at most `limit` of them (lowered to
    /// [`MAX_LIST_PAGE`], raised to 1). Pass the page's
    /// [`next`](HolderPage::next) back as `cursor` for the next page; a lock
    /// held throughout the listing appears on one page. Changes nothing.
    /// Cancel safe (a read).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a prefix no lock name can start with
    /// (wildcards, control characters, too long); [`Error::Config`] without a
    /// backend; [`Error::Backend`] when the backend failed, refused the
    /// cursor, or does not offer listing.
    pub async fn list(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage> {
        validate_prefix(prefix)?;
        let backend = self.admin_backend()?;
        let limit = limit.clamp(1, MAX_LIST_PAGE);
        Ok((**backend).list(prefix, cursor, limit).await?)
    }

    /// Frees `name` if the lease holding it carries the fencing token
    /// `expected_token` (read it with [`Locker::describe`]), so a successor
    /// is never freed by mistake. The freed holder learns it at its next
    /// renewal, as [`LossReason::Forced`](crate::LossReason::Forced): its
    /// guarded work is cancelled as for any loss. The next holder's token is
    /// higher.
    ///
    /// Not cancel safe in effect: dropped midway, the release may have
    /// happened; describe the lock to find out.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] without a backend; [`Error::Backend`] when the
    /// backend failed, is not permitted (an access right the read-only
    /// calls do not need), or does not offer forced release.
    pub async fn force_release(
        &self,
        name: &LockName,
        expected_token: u64,
    ) -> Result<ForceOutcome> {
        let backend = self.admin_backend()?;
        let outcome = (**backend).force_release(name, expected_token).await?;
        if outcome == ForceOutcome::Released {
            tracing::warn!(lock = %name, token = expected_token, "lock released by force; its holder will report it lost (forced)");
        }
        Ok(outcome)
    }

    fn admin_backend(&self) -> Result<&std::sync::Arc<dyn crate::LockBackend>> {
        self.backend().ok_or_else(|| {
            Error::Config(
                "this Locker has no backend (unlocked mode): there is no shared lock to inspect"
                    .to_owned(),
            )
        })
    }
}

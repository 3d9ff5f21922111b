//! What a limiter does when its store fails.

use std::num::NonZeroU32;

/// What a limiter does with a request when its store times out, refuses the
/// connection or answers with any error (and while its circuit breaker is
/// open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Refuse the request: [`Limiter::check`](crate::Limiter::check) returns
    /// [`Error::StoreUnavailable`](crate::Error::StoreUnavailable), which the
    /// tower layer answers with 503 and `Retry-After`. For limits that guard
    /// against abuse where an outage must be loud.
    Deny,
    /// Admit the request unchecked (counted as a fallback).
    Allow,
    /// Decide in this process's memory at a share of each limit: each limit's
    /// rate and burst divided by `replicas` (the burst at least 1), so `N`
    /// replicas together admit about one limit, not `N` of them. Counted as
    /// fallbacks.
    Fallback {
        /// The number of replicas sharing the limit.
        replicas: NonZeroU32,
    },
}

impl OnStoreError {
    /// A per-process fallback at the full limit: the reference deployment's
    /// fail open, right for one replica.
    pub const FALLBACK: Self = Self::Fallback {
        replicas: NonZeroU32::MIN,
    };

    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Deny => "deny",
            Self::Allow => "allow",
            Self::Fallback { .. } => "fallback",
        }
    }
}

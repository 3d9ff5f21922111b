//! A Redis [`LockBackend`](lock_core::LockBackend): `SET NX PX` with a
//! fencing counter, Lua compare-and-renew and compare-and-delete, pub/sub
//! release notification, and a [`TickStore`](lock_core::TickStore).
//!
//! # What it does
//!
//! - **Acquire** is one Lua script: if the key is free it increments the
//!   fencing counter and sets `<prefix><name>` to the 128-bit owner token
//!   with a millisecond TTL, returning the counter value as the fencing
//!   token. The lock and its token are set together or not at all.
//! - **Renew** extends the TTL only if the key still holds our token, and
//!   tells a vanished key (`expired`) from a foreign token (`stolen`).
//!   **Check** compares without extending. **Release** deletes only our own
//!   key and publishes on the name's channel so waiters wake at once. None
//!   of them ever creates a key.
//! - **Batch renewal**: one script renews every lease a `Locker` holds in one
//!   round trip.
//! - **Release notification**: waiters subscribe to the name's channel on one
//!   shared subscriber connection; where pub/sub is refused or down they poll.
//! - Scripts are sent by SHA; after `SCRIPT FLUSH` or a restart the call is
//!   repeated once with the script body on `NOSCRIPT`, invisibly to callers.
//! - The connection reconnects after errors. Every call is bounded by the
//!   operation timeout, so a stalled (paused, partitioned) server gives
//!   [`BackendErrorKind::Timeout`](lock_core::BackendErrorKind::Timeout)
//!   errors rather than a hang, and an unreachable one gives `Unavailable`:
//!   the `Locker` then skips the job (fail closed).
//!
//! # Guarantees and their limits
//!
//! - **One primary.** Mutual exclusion holds while that primary keeps its
//!   data. Redis replication is asynchronous: on failover the promoted
//!   replica may not have the lock key yet, and a second client can acquire
//!   while the first still believes it holds the lock. A restart without
//!   persistence loses every key the same way; the holder finds out at its
//!   next renewal (reported as `expired`).
//! - **Fencing tokens are the defence** against that and against paused
//!   holders: pass [`LeaseHandle::fencing_token`](lock_core::LeaseHandle::fencing_token)
//!   to the resource you write to and have it reject tokens lower than the
//!   highest it has seen. One counter (`<prefix>#fence`) serves every name,
//!   so tokens are strictly increasing per name. They come from the same
//!   server, so a failover that loses writes can also make them go backwards:
//!   a resource that must survive failover needs tokens from a store of its own.
//! - **No Redlock.** This crate does not spread a lock over several
//!   independent primaries; its safety under clock and pause faults is
//!   contested and it is not tested here.
//! - Redis Cluster is not supported: the batch renewal script touches keys in
//!   many slots.
//!
//! # Keys and least privilege
//!
//! Everything lives under the key prefix (default `lock:`): lock keys
//! `<prefix><name>`, the counter `<prefix>#fence`, ticks `<prefix>#tick:<job>`,
//! and release channels named like the lock keys. A user limited to the
//! prefix is enough:
//!
//! ```text
//! ACL SETUSER locksvc on >password resetkeys ~lock:* resetchannels &lock:* -@all +get +set +exists +incr +pexpire +del +publish +subscribe +unsubscribe +evalsha +eval +ping +time
//! ```
//!
//! # TLS
//!
//! `rediss://` URLs use rustls and verify the server's certificate and host
//! name against the system's roots, or against a CA given with
//! [`RedisBuilder::with_ca_certificate_pem`]. rustls needs one process-wide
//! crypto provider: unless the application installed one, this crate
//! installs ring's when it builds a TLS client.
//!
//! # Examples
//!
//! ```no_run
//! # async fn demo() -> lock_core::Result<()> {
//! use std::time::Duration;
//! use lock_core::{Locker, LockName, LockOptions, RunOutcome};
//! use lock_redis::RedisBuilder;
//!
//! let backend = RedisBuilder::from_url("redis://127.0.0.1:6379")?
//!     .with_operation_timeout(Duration::from_millis(500))
//!     .connect()
//!     .await?;
//! let locker = Locker::new(backend)?;
//! let name = LockName::new("billing/nightly")?;
//! let opts = LockOptions::new(Duration::from_secs(30));
//! if let RunOutcome::Completed(()) = locker.with_lock(&name, &opts, |lease| async move {
//!     let _ = lease.fencing_token();
//! }).await? {
//!     println!("done");
//! }
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod backend;
mod config;
mod connection;
mod error;
mod notify;
mod scripts;
mod sentinel;
mod ticks;

pub use backend::RedisBackend;
pub use config::{RedisBuilder, ENV_VAR, URL_SCHEMES};

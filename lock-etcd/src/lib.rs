//! An etcd v3 [`LockBackend`](lock_core::LockBackend) for `lock-core`.
//!
//! Each lock is one key, `<prefix><name>` (prefix `/locks/` by default),
//! whose value is the holder's owner token, followed, for a holder that
//! names itself (every acquire through a `Locker`), by a space, the acquire
//! time in Unix milliseconds by the holder's clock, a space and its
//! identity: `3f…c1 1765069200123 web-1/4242/0a1b2c3d` (see
//! [Who holds it](#who-holds-it-inspection-and-forced-release)). Every
//! compare that decides ownership looks at the token alone. As etcd's own
//! `concurrency.Session` does, the keys of one backend instance share one
//! lease per whole-second TTL, granted on first use and kept alive while
//! the instance acquires or renews:
//!
//! - **acquire** puts the key on the shared lease in a transaction that
//!   succeeds only if the key does not exist (`create_revision == 0`): one
//!   raft write. The lock is reported acquired only with a keep-alive of
//!   the shared lease that answered that the lease lives. If one was sent at
//!   most a sixth of the TTL before the attempt started (by an earlier
//!   acquire or a renewal sweep), that is the proof, and the acquire is the
//!   transaction alone: the grant then says the server keeps the lock a
//!   little less than its TTL ([`Lease::lasts_at_least`](lock_core::backend::Lease::lasts_at_least)),
//!   and `lock-core` shortens its local deadline and brings its first
//!   renewal forward to match. Otherwise a keep-alive goes beside the
//!   transaction, sent after the attempt started, and proves the whole TTL;
//!   concurrent acquires share one when it was sent after each of them
//!   started. Either way the lease outlasts the lock's local deadline.
//! - **renew** sends one keep-alive per lease, however many locks share it,
//!   and reads the keys, one transaction of reads per 128 keys: a missing
//!   key is `expired`, a key carrying another token `stolen`. A renewal
//!   sweep of N locks on one TTL costs one keep-alive on the shared stream
//!   plus ⌈N/128⌉ read transactions. The token decides, not the lease: a
//!   key with the owner's token on another lease was moved there by a
//!   concurrent renewal of the same owner, and is held.
//! - **release** deletes the key in a transaction that compares its value
//!   with the owner token: one raft write. The shared lease is not revoked;
//!   other locks are on it, and later acquires use it. A key is never
//!   re-created.
//! - **`retain_for`** or any renewal with a TTL other than the lock's moves
//!   the key to a lease of its own (a keep-alive can only restart a lease's
//!   own TTL); that lease is revoked when the lock is released.
//! - **waiting** acquires wake on a watch of the key, created before the
//!   attempt it guards. etcd's own `Lock` RPC is not used (see etcd issue
//!   11456: a waiter whose lease expired while it queued was granted the lock).
//! - **the scheduler's tick store** keeps each job's latest completed tick
//!   under `<prefix>#ticks/` and one key per completed tick under
//!   `<prefix>#marks/`. The ticks of jobs due at the same instant are read
//!   in one read-only transaction per 128 keys and recorded in one
//!   transaction per 124 ticks (etcd counts what is nested below a batch,
//!   three operations in a record and one more in its creation of a
//!   missing key, against its `--max-txn-ops`, 128 by default): one raft
//!   write per batch instead of one per job.
//!
//! # Losing the shared lease
//!
//! A shared lease that keep-alive reports gone (expired while the instance
//! could not reach the cluster, or revoked by an operator with `etcdctl
//! lease revoke`) took every key on it: every lock on it is lost at once.
//! The backend reports them through its loss feed
//! ([`Capabilities::loss_push`](lock_core::Capabilities::loss_push)), so
//! every `Locker` over it marks them lost before anything else happens, and
//! only then grants a new shared lease for later acquires. Revoking the
//! shared lease therefore ends all of an instance's locks of that TTL, not
//! one; to take one lock away, delete or overwrite its key.
//!
//! # Releases without an answer
//!
//! A key on a lease of its own would expire with it; on a shared lease that
//! other locks keep alive, it would stay. So a release (or an acquire) that
//! gets no answer keeps the key to delete: each later acquire and renewal
//! sweep retries a compare-and-delete on the owner token. If the key still
//! cannot be deleted a third of its TTL after the failed call, the instance
//! gives up that shared lease: it reports the loss of the other locks on it
//! first, stops keeping it alive and revokes it. The server then frees the
//! key at once if it can be reached, and otherwise when the lease runs out,
//! at most one TTL after its last keep-alive; an instance that reaches
//! nothing sends no keep-alive either, so its keys free within one TTL.
//!
//! # Guarantees
//!
//! - **Fencing tokens** are the key's create revision: etcd revisions grow
//!   across the whole cluster, so each acquisition of a name gets a larger
//!   token than every earlier one, even across holders and crashes.
//! - **Local validity** is counted by `lock-core` from when the acquire or
//!   renewal was *called*, less what an acquire's grant says is missing.
//!   Each acquire is backed by a keep-alive of its shared lease sent after
//!   that call, or by one sent shortly before it (the grant then counts the
//!   lock's life from that keep-alive), and each renewal by one sent during
//!   it; etcd starts the lease's new TTL when it receives the request, which
//!   is later, so the server's expiry always comes after the local deadline.
//! - **Bounded calls.** Every call ends within the request timeout (default
//!   1 s): a stopped or partitioned cluster gives a
//!   [`Timeout`](lock_core::BackendErrorKind::Timeout) error, a refused
//!   connection an [`Unavailable`](lock_core::BackendErrorKind::Unavailable)
//!   one, so the `Locker` fails closed.
//!
//! # TTL granularity and minimum
//!
//! etcd leases have whole-second TTLs, so a TTL is rounded **up** to the next
//! second on the server (2.5 s becomes 3 s); the local deadline still uses the
//! exact TTL, which keeps it before the server's. etcd also raises any TTL
//! below its minimum, 1.5 × the election timeout (1 s by default, so 2 s).
//! [`EtcdBuilder::connect`] measures that minimum with a one-second probe
//! lease and reports it as [`Capabilities::min_ttl`](lock_core::Capabilities::min_ttl);
//! shorter TTLs are rejected with a configuration error instead of being
//! silently lengthened. A backend made by [`EtcdBuilder::build`] has handed
//! out its minimum (the declared one, else 2 s) before the cluster answers,
//! so it keeps that one: a cluster whose minimum is higher then lengthens
//! shorter leases, which delays only the freeing of an abandoned lock, and
//! the backend warns of it when it connects. Expiry itself is checked by the etcd leader about
//! every 500 ms, so an abandoned lock frees up to about half a second after
//! its TTL. Since a lease is shared by the locks of one TTL, an abandoned
//! instance's locks all free together, about a TTL after its last acquire or
//! renewal.
//!
//! # What a lease cannot do
//!
//! A lease cannot stop a paused holder. If a process freezes (GC pause,
//! SIGSTOP, a VM migration) past its TTL, etcd expires the lease and another
//! process acquires, while the frozen one still runs its critical section
//! when it wakes up. The Jepsen analysis of etcd 3.4.3 shows exactly this.
//! `lock-core` narrows the window (its `assert_held` fails once the local
//! deadline has passed, and a lost lease cancels the job at once) but cannot
//! close it; only the protected resource can, by rejecting writes that carry
//! a fencing token lower than one it has already seen.
//!
//! # Clusters
//!
//! Give every member's client endpoint: `etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379`
//! (or `ETCD_ENDPOINTS`). The conformance suite runs whole against a private
//! 3-member cluster, and its fault suite kills, freezes and cuts members
//! (figures in `conformance-tests/README.md`).
//!
//! What a cluster gives you:
//!
//! - **Leases survive a leader change.** A lease lives in the replicated state, and a
//!   newly elected leader extends every lease by its full TTL. A holder whose renewals
//!   stall during the election (we measured 0.7–0.9 s of stall with 2 s TTLs) keeps its
//!   lock, and its fencing token stays valid.
//! - **Fencing tokens hold across members.** The token is the lock key's create revision,
//!   which raft orders across the whole cluster. No member can hand out a smaller one later.
//! - **A member that is cut off refuses.** The client asks each member to refuse requests
//!   while it has no leader, and it does not do serializable reads. A client that reaches
//!   only the minority side cannot acquire, renew or verify. Its holders abort by their
//!   local deadline, before the majority side can grant the lock again.
//! - **One client per member, calls on one member at a time.** Each endpoint gets
//!   its own connection. Calls go to one member while it answers. A call that the
//!   member refuses (killed: connection refused; cut off: "no leader") or fails as
//!   unreachable goes on at once to the next member, and one that gets no answer
//!   within half the request timeout goes on to the next member with the half that
//!   is left. That member is then passed over for 5 s. Up to 4 attempts, all within
//!   the request timeout.
//! - **A frozen member (SIGSTOP, a VM stall) costs one call half its timeout.** Its
//!   connections stay open, so only the time tells it apart. The lease keep-alive
//!   stream moves with the calls, so a renewal that finds its member frozen is
//!   answered by another within the request timeout, well inside the TTL. In the
//!   fault suite, with 2 s TTLs and 1 s request timeouts, no holder lost its lease
//!   while a follower was frozen.
//!
//! What it does not give you:
//!
//! - **No answer in time is still a failure.** If no member answers within the
//!   request timeout, the call fails closed, as with a single server.
//! - **Waiters watch through one member.** A waiter's release watch stays on the
//!   member it was opened on. If that member freezes, the waiter is not woken by the
//!   release and finds the lock free at its next retry instead.
//! - **A majority is still needed.** Lose two of three members and every call fails
//!   closed until quorum returns.
//! - **Run etcd with `--pre-vote`.** It is the default from etcd 3.5; in 3.4 it is off.
//!   Without it, a member that comes back after a restart or a partition starts an
//!   election and deposes a healthy leader, and every client waits for a new election.
//!
//! # Who holds it: inspection and forced release
//!
//! - **describe** is a get of the key and a `LeaseTimeToLive` of its lease,
//!   which reports the lease's remaining TTL without extending it: nothing
//!   is written, no keep-alive is sent. The fencing token is the key's
//!   create revision; the identity and acquire time come from the value
//!   (the acquire time by the *holder's* clock: etcd's answers carry no
//!   time); `expires_at` is the describing process's now plus the lease's
//!   remaining TTL, which etcd reports in whole seconds rounded down, so the
//!   server frees the lock up to a second (plus its ~500 ms expiry check)
//!   after it; `renewed_at` is the lease's last keep-alive (which the locks
//!   of one instance and TTL share), estimated from the same answer to
//!   within half a second: that expiry less the granted TTL plus half a
//!   second, never after now nor before the recorded acquire time. A key this library did not write (`etcdctl put /locks/x v`, or
//!   a value of another form) is held by a holder with no identity; one
//!   without a lease has no expiry.
//! - **list** is a range get of the lock keys under the prefix, in key
//!   order, at most `limit` per page, and one `LeaseTimeToLive` per distinct
//!   lease on the page (usually one per holder instance and TTL). The cursor
//!   is the page's last key, in hex; the next page starts after it, so a lock
//!   held throughout a listing is on exactly one page. Keys that no lock name
//!   can be (the tick store's `<prefix>#ticks/` and `#marks/`, the marks of
//!   forced releases under `<prefix>#forced/`, a stock client's key with
//!   other characters) are passed over, so a page may hold fewer than
//!   `limit` locks and still have a next one.
//! - **force release** reads the key, then sends one transaction that
//!   compares its create revision with the expected token (and its mod
//!   revision with the one read), deletes the key and puts a mark,
//!   `<prefix>#forced/<name>`, holding the freed value, **on the freed
//!   holder's own lease**. A wrong token changes nothing and answers
//!   `TokenMismatch` with the token that holds the lock. The holder's lease
//!   is not revoked: it is shared by all its locks of that TTL, which keep
//!   theirs. Its renewals and checks read the mark in the same read-only
//!   transaction as the key (a batch renewal reads the marks of the keys it
//!   found gone or taken, in one more transaction, only then), and answer
//!   [`LeaseStatus::Forced`](lock_core::backend::LeaseStatus::Forced)
//!   instead of `Expired` or `Stolen`; the `Locker` then reports
//!   `LossReason::Forced` within one renewal interval. The mark lives as
//!   long as that lease: while the holder keeps other locks of the TTL, or
//!   until its renewals stop, never shorter than the holder can still ask.
//!   The loss push (a shared lease found gone) still reports `Expired`: a
//!   forced release does not end a lease.
//!
//! Every answer is a snapshot that can be stale the moment it returns: show
//! it to people, never use it to decide whether to write.
//!
//! # Access control and TLS
//!
//! With RBAC enabled, a user that takes locks needs read-write on the key
//! prefix (which also holds the scheduler's tick keys, under
//! `<prefix>#ticks/`, and the marks of forced releases, under
//! `<prefix>#forced/`); lease grant, keep-alive and revoke need no extra
//! permission (etcd checks a revoke against the keys on the lease, which
//! are all under the prefix). `describe` and `list` need only **read** on
//! the prefix (`etcdctl role grant-permission viewer read /locks/
//! --prefix=true`); `LeaseTimeToLive` needs nothing more. `force_release`
//! needs **read-write** on the prefix, like a holder: a read-only user is
//! refused with an [`Auth`](lock_core::BackendErrorKind::Auth) error and
//! nothing changes. Give credentials with
//! [`EtcdBuilder::with_credentials`] or in the URL
//! (`etcd://user:password@host:2379`). For TLS use `https://` endpoints or
//! `etcds://` and trust the server's CA with [`EtcdBuilder::with_ca_file`].
//!
//! # Examples
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use lock_core::{LockName, LockOptions, Locker, RunOutcome};
//! use lock_etcd::EtcdBuilder;
//!
//! let backend = EtcdBuilder::from_url("etcd://127.0.0.1:2379")?
//!     .with_request_timeout(Duration::from_millis(500))
//!     .connect()
//!     .await?;
//! let locker = Locker::new(backend)?;
//! let name = LockName::new("billing/nightly")?;
//! let opts = LockOptions::new(Duration::from_secs(10));
//! let outcome = locker
//!     .with_lock(&name, &opts, |lease| async move { lease.fencing_token() })
//!     .await?;
//! if let RunOutcome::Completed(token) = outcome {
//!     println!("ran with fencing token {token:?}");
//! }
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod acquire;
mod backend;
mod config;
mod connection;
mod deferred;
mod error;
mod handle;
mod holder;
mod inspect;
mod lease;
mod members;
mod orphan;
mod renewal;
mod shared;
#[cfg(feature = "test-util")]
mod test_util;
mod tick_batch;
mod tick_runs;
mod tick_runs_batch;
mod ticks;

pub use config::{EtcdBuilder, DEFAULT_MIN_TTL, DEFAULT_PREFIX, ENV_VAR, URL_SCHEMES};
pub use handle::EtcdBackend;
#[cfg(feature = "test-util")]
pub use test_util::Pause;

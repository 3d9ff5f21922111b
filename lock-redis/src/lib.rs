//! A Redis [`LockBackend`](lock_core::LockBackend): `SET NX PX` with a
//! fencing counter, Lua compare-and-renew and compare-and-delete, pub/sub
//! release notification, and a [`TickStore`](lock_core::TickStore).
//!
//! # What it does
//!
//! - **Acquire** is one Lua script: if the key is free it increments the
//!   fencing counter and sets `<prefix><name>` to the 128-bit owner token
//!   with a millisecond TTL, returning the counter value as the fencing
//!   token, and writes the holder record beside it (see
//!   [Inspection](#inspection-and-forced-release)). The lock, its token and
//!   its record are set together or not at all.
//! - **Renew** extends the TTL only if the key still holds our token, and
//!   tells a vanished key (`expired`) from a foreign token (`stolen`).
//!   **Check** compares without extending. **Release** deletes only our own
//!   key and publishes on the name's channel so waiters wake at once. None
//!   of them ever creates a key.
//! - **Batch renewal**: one script renews every lease a `Locker` holds in one
//!   round trip.
//! - **Batched acquires**: an acquire made while another is in flight on the
//!   connection joins a queue, and acquires queued together go as one script
//!   over all their keys, each decided as the single acquire decides it (a
//!   scheduler's jobs firing at the same instant take their tick locks in a
//!   few round trips, not one each). A release waits until a queued acquire
//!   of the same owner has been answered, so an abandoned acquire never takes
//!   its lock after its release. Not in cluster mode (a script's keys must
//!   share a slot), nor with replica acknowledgement.
//! - **Batched tick records**: the scheduler's `Started` and `Completed`
//!   writes of ticks that fire together go as one script call over all
//!   their keys, each tick its own step; a `Started` write is checked (the
//!   server's clock, the tick's mark, the job's latest completed tick) in
//!   the same script. Not in cluster mode, where each write is a call of
//!   its own and the checks are read first.
//! - **Release notification**: waiters subscribe to the name's channel on one
//!   shared subscriber connection; where pub/sub is refused or down they poll.
//! - Scripts are sent by SHA; after `SCRIPT FLUSH` or a restart the call is
//!   repeated once with the script body on `NOSCRIPT`, invisibly to callers.
//! - The connection reconnects after errors (through the sentinels when the
//!   URL names them: see [Sentinel](#sentinel)). Every call is bounded by the
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
//! - **Fencing tokens are the defence against paused holders, not against
//!   failover.** Pass [`LeaseHandle::fencing_token`](lock_core::LeaseHandle::fencing_token)
//!   to the resource you write to and have it reject tokens lower than the
//!   highest it has seen. One counter (`<prefix>#fence`) serves every name,
//!   so tokens are strictly increasing per name while the primary keeps its
//!   data. **Redis fencing tokens are not failover-safe**: the counter is an
//!   `INCR` on the same asynchronously replicated server, so a failover or a
//!   restart that loses its last increments hands out the same or a lower
//!   token again, and a fenced resource then accepts the old holder's stale
//!   writes. Where a resource must refuse stale writers across a failover,
//!   use [lock-etcd](https://docs.rs/lock-etcd) (the token is a raft-ordered
//!   revision, never lower on any member) or lock-postgres (a sequence that
//!   only skips ahead after a promotion), or fence with a counter of the
//!   resource's own, or turn on [replica
//!   acknowledgement](#replica-acknowledgement) for every replica.
//! - **No Redlock.** This crate does not spread a lock over several
//!   independent primaries; its safety under clock and pause faults is
//!   contested and it is not tested here.
//! - Redis Cluster is supported with its own key layout: see
//!   [Redis Cluster](#redis-cluster).
//!
//! # Sentinel
//!
//! `redis+sentinel://[user[:password]@]host1[:port1][,host2[:port2]...]/<master-name>[/db]`
//! names the sentinels (port 26379 unless given) and the name they monitor
//! the primary under. For example
//! `redis+sentinel://locksvc:secret@10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/locks/0`.
//!
//! - **Finding the primary.** Every sentinel is asked at once (each within
//!   the connect timeout); among the first majority to answer (or all that
//!   answer), the answer with the highest configuration epoch wins, since a
//!   sentinel that has not heard of a failover yet still names the old
//!   primary, and a frozen sentinel does not hold up the others. The connection then checks `ROLE` and refuses a
//!   server that is not a primary (`Unavailable`): locks are never taken or
//!   checked on a replica.
//! - **After a failover.** An I/O error, a timeout, or a `READONLY`,
//!   `MASTERDOWN`, `LOADING`, `TRYAGAIN` or `NOREPLICAS` reply fails that
//!   call (fail closed) and drops the connection; the next call asks the
//!   sentinels again. Release subscribers reconnect the same way (a replica
//!   also delivers what its primary publishes).
//! - **Credentials** in the URL log in to the primary; the sentinels are
//!   asked without credentials. TLS (`rediss+sentinel`) is not supported.
//!
//! What a failover does to locks, and what to configure:
//!
//! - Mutual exclusion holds while no failover happens, as on one primary.
//! - A failover can lose a lock whose key had not reached the promoted
//!   replica: the holder learns it at its next renewal (`expired` or
//!   `stolen`), before its local deadline, and a successor may have been
//!   granted the lock up to one renewal interval plus the operation timeout
//!   earlier. The fencing counter can go back at the same time (above). In
//!   the fault suite (a lock that reached no replica, the primary killed,
//!   8 s TTL) the sentinels promoted a replica in 2.3 s, the holder saw
//!   `expired` 0.33 s later, a waiter had been granted the lock 0.22 s
//!   before that, with the same fencing token, and a resource fenced by the
//!   Redis token accepted 49 of the old holder's writes after the waiter's.
//! - Set `min-replicas-to-write 1` (and a `min-replicas-max-lag`) on every
//!   data server. Without it the old primary keeps granting and renewing
//!   locks for clients still connected to it until the sentinels demote it,
//!   seconds after the promotion, while other clients are granted the same
//!   locks on the new primary. With it, the old primary refuses writes
//!   (`NOREPLICAS`) as soon as its replicas are repointed, and these clients
//!   move to the new primary.
//! - A failover that takes longer than the lease's TTL costs every lease:
//!   each holder aborts by its local deadline (fail closed), its renewals
//!   having failed or found the key expired on the new primary. With a 1 s
//!   TTL, `SENTINEL FAILOVER` on loopback aborted every holder 1.4 to 2.0 s
//!   after the command, and the first acquire on the new primary came 1.2
//!   to 2.3 s after it (over two runs). Choose a TTL above your failover
//!   time if holders should survive one.
//!
//! # Redis Cluster
//!
//! `redis+cluster://[user[:password]@]host1[:port1][,host2[:port2]...]`
//! names seed nodes (port 6379 unless given); the client reads the slot map
//! from them and connects to every primary. For example
//! `redis+cluster://locksvc:secret@10.0.0.1:7000,10.0.0.2:7000,10.0.0.3:7000`.
//! A cluster has only database 0. TLS (`rediss+cluster`) is not supported.
//!
//! - **Key layout.** A script may only touch keys of one slot, so cluster
//!   mode lays keys out differently (the single-server layout is unchanged):
//!   the lock key is still `<prefix><name>`, but its fencing counter is the
//!   one of its slot, `<prefix>#fence{<tag>}`, where `<tag>` is the first
//!   string of the enumeration `0`..`z`, `00`..`zz`, ... whose CRC16 slot is
//!   the lock key's slot (every slot has a tag of at most 4 characters). Tick
//!   keys are `<prefix>#tick:{<job>}` and `<prefix>#tick:{<job>}#<tick>`.
//!   This layout is part of the on-server format and never changes.
//!   [`cluster_key_slot`] gives a key's slot, as `CLUSTER KEYSLOT` does.
//! - **Routing.** Each script goes to the primary of its lock key's slot;
//!   `MOVED` and `ASK` redirects (a slot being migrated) are followed by the
//!   client. Answers that mean the cluster did not run the command
//!   (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`, no node reachable for the
//!   slot) are sent again with a short backoff until the operation timeout:
//!   after a failover the nodes may keep redirecting to the dead primary
//!   for a while, and a renewal then ends as not decided (an
//!   [`Unavailable`](lock_core::BackendErrorKind::Unavailable) or
//!   [`Timeout`](lock_core::BackendErrorKind::Timeout) error, retried by the
//!   heartbeat while the lease is valid), never as lost. The counter lives in the same
//!   slot, so it moves with the lock when the slot is migrated, and tokens
//!   stay strictly increasing per name. Because the client may send an
//!   acquire again after an I/O error, the acquire script grants a key that
//!   already holds the caller's own (never reused) owner token, with a new
//!   token, instead of refusing it for one TTL.
//! - **Batch renewal** groups leases by slot: one script per slot, all sent
//!   at once, so a batch costs about one round trip per primary; statuses
//!   come back in request order. Leases of different slots are not renewed
//!   atomically together (nothing needs them to be).
//! - **No release notification.** Cluster `PUBLISH` is broadcast to every
//!   node, so releases are not published and
//!   [`Capabilities::release_notify`](lock_core::Capabilities) is `false`:
//!   waiting acquires poll with back-off. Sharded pub/sub (`SPUBLISH`) is not
//!   used.
//! - **What is guaranteed.** Mutual exclusion per name while the primary of
//!   its slot keeps its data, as on one server. Replication inside a cluster
//!   is asynchronous too: when a primary fails and its replica is promoted, a
//!   lock (and the latest counter increments) that had not reached the
//!   replica are lost, with the same consequences as a Sentinel failover
//!   (below). Fencing tokens are per slot and are **not failover-safe**.
//!   In the fault suite (3 primaries, 3 replicas, `cluster-node-timeout`
//!   1000 ms, loopback): a primary SIGKILLed with six locks that its replica
//!   had acknowledged (`WAIT`): calls to its slots failed closed meanwhile
//!   (as not decided, each within the operation timeout), no contender was
//!   granted one of them, all six were still the holder's after the
//!   promotion (a client idle since the kill found them held 6 to 39 ms
//!   after it, through nodes still redirecting to the dead primary), and
//!   the first new lock in those slots came 2.1 to 2.8 s after the kill
//!   (ten runs on a loaded 2-core machine). A slot moved by hand (`SETSLOT`
//!   IMPORTING/MIGRATING, `MIGRATE`, `SETSLOT NODE`) while its lock was
//!   held: the holder renewed through `ASK` and `MOVED`, no contender was
//!   granted the lock, and the next token was higher.
//! - Pub/sub of any kind, including sharded pub/sub, is out of scope.
//! # Replica acknowledgement
//!
//! [`RedisBuilder::with_replica_ack`] (or `?replica_ack=N&replica_ack_timeout=200ms`
//! on a `redis://`, `rediss://` or `redis+sentinel://` URL; off by default)
//! makes every acquire and renewal count only once `N` replicas have it:
//!
//! - **Acquire** sends the acquire script and `WAIT N <timeout>` in one
//!   pipeline on one connection. With fewer than `N` acknowledgements in
//!   time the lock is released again (owner-checked) and the acquire fails
//!   as `Unavailable` ("0 of the 1 replicas asked for acknowledged the write
//!   within 400ms; the lock was released again (fail closed) ..."): the
//!   `Locker` skips the job, or a bounded `lock` retries.
//! - **Renewals** (one `WAIT` per batch renewal) that too few replicas
//!   acknowledge fail, so the lease's local deadline does not move. The
//!   extension did reach the primary, but Redis 7 replicates `PEXPIRE` as an
//!   absolute `PEXPIREAT`: a promoted replica without it would expire the
//!   key earlier than the holder believed.
//! - **Fencing.** With `N` = every replica, the counter's `INCR` is on every
//!   replica before the token is handed out, so whichever replica is
//!   promoted continues above it: the token survives a failover.
//!   [`RedisBackend::tokens_survive_failover`] says so for a deployment
//!   size. In the fault suite (the primary killed after a lock that reached
//!   no replica), `N` = 1 turned the 21 to 56 stale writes a Redis-fenced
//!   resource accepted, and the raw overlap, into none: the victim's acquire
//!   was refused in 0.26 to 0.47 s instead.
//!
//! What it does not promise:
//!
//! - `WAIT` is not strong consistency. A replica restarted without
//!   persistence, or one that resynchronised from a primary that lacked the
//!   write, can lose an acknowledged write; a write that timed out may still
//!   reach replicas later.
//! - With `N` below the number of replicas, a failover that promotes one
//!   that did not acknowledge can still lose a lock or send the counter
//!   back. Sentinel promotes by priority, then by replication offset, so the
//!   promoted replica likely has the write; likely, not certain.
//! - **Availability.** With `N` = every replica, no lock can be taken or
//!   renewed while any replica is missing. After a Sentinel failover the
//!   demoted primary re-links as a replica only when the sentinels next
//!   reconfigure it (their 10 s `INFO` round): in the fault suite every
//!   holder aborted at its deadline and no acquire succeeded for 11 to 12 s.
//!   Ask for fewer replicas than exist to stay available through a failover.
//! - **Cost.** Each acquire and renewal waits for a round trip to the
//!   replicas; while a `WAIT` blocks, every other call on the backend's
//!   connection waits behind it, so each call's time limit grows by the
//!   acknowledgement timeout (capped at 10 s). The conformance case
//!   `redis_sentinel::replica_ack_cost` prints the cost.
//! - Tick marks ([`TickStore`](lock_core::TickStore)) and releases are not
//!   acknowledged.
//!
//! # Inspection and forced release
//!
//! [`LockBackend::describe`](lock_core::LockBackend::describe),
//! [`list`](lock_core::LockBackend::list) and
//! [`force_release`](lock_core::LockBackend::force_release) (through
//! [`Locker`](lock_core::Locker)'s calls of the same names) work on one
//! primary, through Sentinel and on a Cluster.
//!
//! - **The holder record.** Every acquire script also writes
//!   `<prefix>#meta:<name>` (on a Cluster `<prefix>#meta{<tag>}<name>`, in
//!   the lock key's slot) with the lock's TTL: `1 <owner token> <fencing
//!   token or -> <acquired, server µs> <TTL ms> <identity>`. Renewals extend
//!   it with the lock in the same script (one more `PEXPIRE`); a release
//!   deletes it with the lock. `try_acquire_as` stores the identity; plain
//!   `try_acquire` stores the record without one (and without fencing
//!   tokens it stores none: a bare `SET NX PX GET`). Cost: the record's key
//!   and the identity travel with each acquire (about 75 bytes more with the
//!   `lock:` prefix, a 20-character name and a 30-character identity), the
//!   script's own server time went from about 3 µs to about 6 µs (a `TIME`
//!   and a second `SET`; `INFO commandstats`, Redis 7.0, loopback), and each
//!   lock keeps a second key while held. Still one round trip.
//! - **`describe`** runs one read-only script (`EVALSHA_RO`; `EVALSHA` on
//!   servers before 7.0): the server's `TIME`, the lock key's `PTTL` and
//!   value, and the record. It writes nothing and extends nothing. Times are
//!   the server's: `expires_at` is its clock plus the `PTTL`, `acquired_at`
//!   its clock at the acquire, `renewed_at` the instant of the last
//!   extension (the expiry less the TTL the lease was taken with: exact
//!   while renewals ask for that TTL, as a `Locker`'s do). The record counts
//!   only while it names the owner token the lock key holds: a key set by
//!   another client (`redis-cli SET lock:x v PX 30000`), or by a version of
//!   this crate that writes no record, is reported held, by an unknown
//!   holder (no identity, no token). The answer is stale the moment it
//!   returns: show it to people, never decide to write on it.
//! - **`list`** pages through `SCAN <cursor> MATCH <prefix><name prefix>*
//!   COUNT <n>` (glob characters escaped), skipping every key that is not a
//!   lock's (records, marks, counters and ticks hold `#`, which no lock name
//!   does), then describes a page's locks with the same read-only script, one
//!   call per slot. A page holds at most `limit` locks and makes at most 32
//!   `SCAN` calls (each with a `COUNT` of the room left, at least 10, and
//!   doubling up to 256 after calls that found nothing), so it
//!   can be short (even empty) with a next cursor. Each `SCAN` call is made
//!   once: the names it returned that did not fit on the page travel in the
//!   cursor and open the next page. On a Cluster every primary (from
//!   `CLUSTER SLOTS`) is scanned in turn, in address order. The cursor
//!   (`r2|<node>|<scan cursor or end>|<names not yet handed out>`, opaque to
//!   callers) is short unless a call found many more names than the page
//!   had room for. Duplicates: a page never repeats a lock, and no page
//!   repeats another's `SCAN` call; `SCAN` itself may still return a key
//!   twice when the database's table shrinks during the listing, and then a
//!   lock appears on two pages (callers that need a set dedupe by name). A failover during a
//!   listing (Sentinel or Cluster), or a resharding on a Cluster, can miss
//!   or repeat locks: the cursor then continues on another server's table.
//! - **`force_release(name, token)`** is one script: when the record (for
//!   the owner token the lock key holds) carries `token`, it publishes the
//!   release (not on a Cluster), deletes the lock and its record, and
//!   writes the mark `<prefix>#forced:<name>` (Cluster:
//!   `<prefix>#forced{<tag>}<name>`) holding the freed owner token, for the
//!   longer of the lock's remaining TTL and the TTL it was taken with.
//!   Otherwise it changes nothing and answers `NotHeld` (no lock) or
//!   `TokenMismatch { held }` (`held: None` for a lock without a record or
//!   token, such as a stock client's). Renew, batch renew and check read
//!   the mark, in a read of its own, only when they found the lock gone or
//!   taken (their scripts name the lock and its record only: a script
//!   naming a key that does not exist, as the mark almost never does, is
//!   refused with `TRYAGAIN` while its slot migrates), and then answer
//!   [`LeaseStatus::Forced`](lock_core::backend::LeaseStatus::Forced), so
//!   the holder reports `forced` (not `expired` or `stolen`) at its next
//!   renewal, within one renewal interval; in the conformance suite (1 s
//!   TTL, renewal every 333 ms) that took 334 to 336 ms on every deployment.
//!   A successor's token is higher, as for any acquire.
//! - **Without fencing tokens** (`with_fencing_tokens(false)`) there is no
//!   token to compare, so `force_release` is refused with
//!   [`Unsupported`](lock_core::BackendErrorKind::Unsupported): let the
//!   lock's TTL run out, or use a backend that draws tokens.
//!
//! # Keys and least privilege
//!
//! Everything lives under the key prefix (default `lock:`): lock keys
//! `<prefix><name>`, the counter `<prefix>#fence`, ticks `<prefix>#tick:<job>`,
//! holder records `<prefix>#meta:<name>`, forced-release marks
//! `<prefix>#forced:<name>`, and release channels named like the lock keys. A user limited to the
//! prefix is enough (`+role` is needed with Sentinel, `+wait` with replica
//! acknowledgement):
//!
//! ```text
//! ACL SETUSER locksvc on >password resetkeys ~lock:* resetchannels &lock:* -@all +get +set +exists +incr +pexpire +del +publish +subscribe +unsubscribe +evalsha +eval +ping +time +role +wait
//! ```
//!
//! On a Redis Cluster (set it on every node) pub/sub is not used, and the
//! client needs the slot map and `ASK` redirects:
//!
//! ```text
//! ACL SETUSER locksvc on >password resetkeys ~lock:* resetchannels -@all +get +set +exists +incr +pexpire +del +evalsha +eval +ping +time +cluster|slots +asking
//! ```
//!
//! Taking, renewing and releasing locks (holder records and marks included)
//! need nothing beyond these lines. Inspection needs only reads: a user
//! with read-only key rights runs `describe` and `list`, and is refused
//! (`NOPERM`, an [`Auth`](lock_core::BackendErrorKind::Auth) error) a
//! forced release, which runs by `EVALSHA`:
//!
//! ```text
//! ACL SETUSER lockview on >password resetkeys %R~lock:* resetchannels -@all +get +pttl +time +scan +evalsha_ro +eval_ro +ping
//! ```
//!
//! (on a Cluster add `+cluster|slots +asking`; before Redis 7.0, which has
//! neither `%R~` nor `EVALSHA_RO`, inspection needs the lock user's
//! rights). A user that may also force releases has the lock user's line
//! plus `+pttl +scan +evalsha_ro +eval_ro` (the forced release itself uses
//! `get`, `pttl`, `del`, `set`, `publish` and `evalsha`/`eval`).
//! `SCAN` is not limited by key patterns: a user allowed it sees the names
//! of every key in the database, though it can read only its own.
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

mod ack;
mod attempts;
mod backend;
mod cluster;
mod cluster_keys;
mod cluster_link;
mod config;
mod connection;
mod error;
mod inspect;
mod nodes;
mod notify;
mod scripts;
mod sentinel;
mod tick_batch;
mod tick_writes;
mod ticks;
mod unfenced;

pub use ack::ReplicaAck;
pub use backend::RedisBackend;
pub use cluster_keys::key_slot as cluster_key_slot;
pub use config::{RedisBuilder, ENV_VAR, URL_SCHEMES};
pub use sentinel::SentinelUrl;

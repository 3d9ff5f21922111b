//! The Lua scripts, and the key layout they work on.
//!
//! Scripts run atomically on the server, which is what makes each compare
//! and its write one step. They are sent as `EVALSHA`; after a `SCRIPT FLUSH`
//! or a restart the server answers `NOSCRIPT`, and the call is repeated once
//! as `EVAL` with the body, which also caches it again. One `EVAL` rather
//! than `SCRIPT LOAD` + `EVALSHA` leaves no window for another flush in
//! between, so callers never see that error.

use std::sync::LazyLock;

use lock_core::LockName;
use redis::{ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind};

use crate::cluster::Link;
use crate::cluster_keys::fence_tag;

/// A Lua script: its body and the SHA1 the server caches it under.
pub(crate) struct Lua {
    body: &'static str,
    sha: String,
}

impl Lua {
    fn new(body: &'static str) -> Self {
        Self {
            body,
            sha: Script::new(body).get_hash().to_owned(),
        }
    }

    /// The script as one `EVAL` with its body, for a pipeline in which a
    /// `NOSCRIPT` retry would repeat what follows it.
    pub(crate) fn eval(&self, keys: &[String], args: &[String]) -> redis::Cmd {
        script_command("EVAL", self.body, keys, args)
    }

    /// Runs the script with `keys` and `args`, by SHA, falling back to the body.
    pub(crate) async fn run<T: FromRedisValue>(
        &self,
        conn: &mut Link,
        keys: &[String],
        args: &[String],
    ) -> RedisResult<T> {
        match script_command("EVALSHA", &self.sha, keys, args)
            .query_async(conn)
            .await
        {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                script_command("EVAL", self.body, keys, args)
                    .query_async(conn)
                    .await
            }
            other => other,
        }
    }
}

/// `<verb> <script> <number of keys> <keys> <args>`, built in buffers sized
/// for it up front: grown argument by argument, they were reallocated
/// several times per call, a good part of the client's cost per lock.
fn script_command(verb: &str, script: &str, keys: &[String], args: &[String]) -> redis::Cmd {
    // The key count is at most 20 digits.
    let bytes =
        verb.len() + script.len() + 20 + keys.iter().chain(args).map(String::len).sum::<usize>();
    let mut c = redis::Cmd::with_capacity(3 + keys.len() + args.len(), bytes);
    c.arg(verb).arg(script).arg(keys.len()).arg(keys).arg(args);
    c
}

/// Takes the lock and draws a fencing token in one step, or does nothing.
///
/// The counter is bumped before the key is written: if the `INCR` is refused
/// (an ACL without `incr`, a foreign value in the counter key), no lock exists
/// without a token. A key that already holds the caller's owner token is
/// granted again with a new, higher token: owner tokens are never reused, so
/// that is this very attempt re-sent after a lost reply (the cluster client
/// re-sends after an I/O error), and refusing it would leave the lock
/// unusable for one TTL. `KEYS[1]` lock, `KEYS[2]` counter; `ARGV[1]` owner
/// token, `ARGV[2]` TTL in ms. Returns the token, or 0 when the lock is held.
pub(crate) static ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local v = redis.call('get', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
local fence = redis.call('incr', KEYS[2])
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return fence
",
    )
});

/// [`ACQUIRE`] without a fencing token, for servers that refuse
/// `SET NX GET` (before Redis 7.0) and for acknowledged acquires (whose
/// pipeline sends one `EVAL`). Returns 1 acquired, 0 held.
pub(crate) static ACQUIRE_UNFENCED: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local v = redis.call('get', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
",
    )
});

/// [`ACQUIRE`] over many locks, for attempts that queued while others were
/// in flight (see `attempts`): `KEYS[1]` is the counter, `KEYS[2..]` the
/// locks; `ARGV` holds owner token and TTL pairs in lock order. Returns a
/// token (or 0, held) per lock. Each lock is decided as [`ACQUIRE`] decides
/// it; one that fails (a refused `INCR`) fails the whole call, which leaves
/// the locks taken before it to their callers' releases, as a lost reply
/// would.
pub(crate) static ACQUIRE_MANY: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local out = {}
for j = 1, #KEYS - 1 do
  local key, owner = KEYS[j + 1], ARGV[2 * j - 1]
  local v = redis.call('get', key)
  if v and v ~= owner then
    out[j] = 0
  else
    out[j] = redis.call('incr', KEYS[1])
    redis.call('set', key, owner, 'PX', ARGV[2 * j])
  end
end
return out
",
    )
});

/// [`ACQUIRE_UNFENCED`] over many locks: `ARGV` holds owner token and TTL
/// pairs in key order. Returns 1 (acquired) or 0 (held) per lock.
pub(crate) static ACQUIRE_MANY_UNFENCED: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local out = {}
for j, key in ipairs(KEYS) do
  local v = redis.call('get', key)
  if v and v ~= ARGV[2 * j - 1] then
    out[j] = 0
  else
    redis.call('set', key, ARGV[2 * j - 1], 'PX', ARGV[2 * j])
    out[j] = 1
  end
end
return out
",
    )
});

/// Extends the lease if the token matches. Returns 1 held (extended),
/// 0 expired (no key), 2 stolen (another token); never creates a key.
pub(crate) static RENEW: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local v = redis.call('get', KEYS[1])
if v == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  return 1
end
if v then return 2 end
return 0
",
    )
});

/// [`RENEW`] over many keys: `ARGV` holds token and TTL pairs in key order.
pub(crate) static RENEW_MANY: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('get', key)
  if v == ARGV[2 * i - 1] then
    redis.call('pexpire', key, ARGV[2 * i])
    out[i] = 1
  elseif v then
    out[i] = 2
  else
    out[i] = 0
  end
end
return out
",
    )
});

/// Deletes the lease if the token matches and announces it on `ARGV[2]`
/// (unless that is empty: in cluster mode a `PUBLISH` would be broadcast to
/// every node, and nobody listens).
///
/// The announcement comes first so that a refused `PUBLISH` (ACL) fails the
/// whole release before anything is deleted; within the script it makes no
/// difference to waiters, who can only act after the script has finished.
/// Returns 1 released, 0 not held.
pub(crate) static RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
if redis.call('get', KEYS[1]) == ARGV[1] then
  if ARGV[2] ~= '' then redis.call('publish', ARGV[2], '') end
  redis.call('del', KEYS[1])
  return 1
end
return 0
",
    )
});

/// Stores `ARGV[1]` in `KEYS[1]` unless a larger tick is already there.
pub(crate) static RECORD_TICK: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local cur = redis.call('get', KEYS[1])
if (not cur) or tonumber(cur) < tonumber(ARGV[1]) then
  redis.call('set', KEYS[1], ARGV[1])
end
redis.call('set', KEYS[2], '1', 'PX', ARGV[2])
return 0
",
    )
});

/// One transition of a tick's record (lock-core's `TickWrite::apply`) in
/// one step. KEYS: the record, the job's latest completed tick, the tick's
/// mark (one slot: they share the job's hash tag). ARGV: `S` (start) or `C`
/// (complete), the token, the start's Unix ms, the replica, what to do with
/// a stale `Started` (`R` refuse, `A` abandon, `T` take over), keep in ms,
/// the tick. Returns the record as it stands after the step (or false).
/// Tokens are compared as Lua numbers: exact up to 2^53.
pub(crate) static WRITE_TICK: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local cur = redis.call('get', KEYS[1])
local tok = tonumber(ARGV[2])
local nxt = nil
if ARGV[1] == 'S' then
  if not cur then
    nxt = 'S:' .. ARGV[2] .. ':' .. ARGV[3] .. ':' .. ARGV[4]
  else
    local kind, held = string.match(cur, '^(%a):(%d+)')
    if kind == 'S' and tonumber(held) < tok then
      if ARGV[5] == 'A' then
        nxt = 'A:' .. ARGV[2]
      elseif ARGV[5] == 'T' then
        nxt = 'S:' .. ARGV[2] .. ':' .. ARGV[3] .. ':' .. ARGV[4]
      end
    end
  end
elseif cur then
  local kind, held = string.match(cur, '^(%a):(%d+)')
  if kind == 'S' and tonumber(held) == tok then
    nxt = 'C:' .. ARGV[2]
    local latest = redis.call('get', KEYS[2])
    if (not latest) or tonumber(latest) < tonumber(ARGV[7]) then
      redis.call('set', KEYS[2], ARGV[7])
    end
    redis.call('set', KEYS[3], '1', 'PX', ARGV[6])
  end
end
if nxt then
  redis.call('set', KEYS[1], nxt, 'PX', ARGV[6])
  return nxt
end
return cur
",
    )
});

/// Where things live under the key prefix.
///
/// Lock keys are `<prefix><name>`. Everything else uses `#`, which lock
/// names cannot contain, so no name can collide with it. This layout is
/// part of the on-server format: changing it would let two versions of the
/// library hold the same lock at once.
///
/// In cluster mode every key one script touches must be in one slot: the
/// fencing counter of a lock is the one of its key's slot,
/// `<prefix>#fence{<tag>}` (see [`crate::cluster_keys`]), and a job's tick
/// keys share the hash tag `{<job>}`. Lock names and prefixes hold no braces,
/// so a lock key hashes whole.
#[derive(Debug, Clone)]
pub(crate) struct KeySpace {
    prefix: String,
    /// [`KeySpace::fence`], built once: every fenced acquire names it.
    fence: String,
    cluster: bool,
}

impl KeySpace {
    pub(crate) fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            fence: format!("{prefix}#fence"),
            cluster: false,
        }
    }

    /// The cluster layout under `prefix`.
    pub(crate) fn cluster(prefix: &str) -> Self {
        Self {
            cluster: true,
            ..Self::new(prefix)
        }
    }

    /// Whether keys are laid out for a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// The key holding the owner token of `name`.
    pub(crate) fn lock(&self, name: &LockName) -> String {
        // Not `format!`: its machinery costs several times this on every
        // acquire and release.
        let mut key = String::with_capacity(self.prefix.len() + name.as_str().len());
        key.push_str(&self.prefix);
        key.push_str(name.as_str());
        key
    }

    /// The pub/sub channel announcing releases of `name`, or an empty string
    /// in cluster mode, where releases are not announced. Channels are a
    /// namespace apart from keys, so it may share the key's text.
    pub(crate) fn channel(&self, name: &LockName) -> String {
        if self.cluster {
            String::new()
        } else {
            self.lock(name)
        }
    }

    /// The one fencing counter for every name under the prefix: strictly
    /// increasing per name as required, without one key per name ever used
    /// (per-tick lock names are unique and would leak counters forever).
    pub(crate) fn fence(&self) -> String {
        self.fence.clone()
    }

    /// The fencing counter `name`'s acquire increments: [`KeySpace::fence`],
    /// or in cluster mode the counter of the lock key's slot, which moves
    /// with the slot.
    pub(crate) fn fence_for(&self, name: &LockName) -> String {
        if self.cluster {
            format!("{}#fence{{{}}}", self.prefix, fence_tag(&self.lock(name)))
        } else {
            self.fence()
        }
    }

    /// The last completed tick of `job`.
    pub(crate) fn tick(&self, job: &LockName) -> String {
        // Read and written by every replica on every tick: built without
        // `format!`, as lock keys are.
        let mut key = String::with_capacity(self.prefix.len() + job.as_str().len() + 30);
        key.push_str(&self.prefix);
        key.push_str("#tick:");
        if self.cluster {
            key.push('{');
            key.push_str(job.as_str());
            key.push('}');
        } else {
            key.push_str(job.as_str());
        }
        key
    }

    /// The mark of one completed tick; it expires on its own.
    pub(crate) fn tick_record(&self, job: &LockName, tick: i64) -> String {
        let mut key = self.tick_mark(job, tick);
        key.push_str("#run");
        key
    }

    /// The mark of one completed tick of `job`.
    pub(crate) fn tick_mark(&self, job: &LockName, tick: i64) -> String {
        use std::fmt::Write;
        let mut key = self.tick(job);
        // Writing an integer to a String cannot fail.
        let _ = write!(key, "#{tick}");
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_stable_and_collision_free() -> Result<(), lock_core::Error> {
        let keys = KeySpace::new("lock:");
        let name = LockName::new("fence")?;
        assert_eq!(keys.lock(&name), "lock:fence");
        assert_eq!(keys.fence(), "lock:#fence");
        assert_eq!(keys.tick(&name), "lock:#tick:fence");
        assert_eq!(keys.tick_mark(&name, 7), "lock:#tick:fence#7");
        assert_eq!(keys.fence_for(&name), keys.fence());
        assert_ne!(keys.lock(&name), keys.fence());
        Ok(())
    }

    #[test]
    fn cluster_layout_keeps_each_script_in_one_slot() -> Result<(), lock_core::Error> {
        use crate::cluster_keys::key_slot;
        let keys = KeySpace::cluster("lock:");
        for n in ["fence", "billing/nightly", "a", "job:1700000000000"] {
            let name = LockName::new(n)?;
            let lock = keys.lock(&name);
            assert_eq!(lock, format!("lock:{n}"));
            let fence = keys.fence_for(&name);
            assert!(fence.starts_with("lock:#fence{"), "{fence}");
            assert_eq!(key_slot(fence.as_bytes()), key_slot(lock.as_bytes()), "{n}");
            assert_eq!(keys.tick(&name), format!("lock:#tick:{{{n}}}"));
            assert_eq!(
                key_slot(keys.tick(&name).as_bytes()),
                key_slot(keys.tick_mark(&name, 42).as_bytes())
            );
        }
        assert_eq!(keys.fence_for(&LockName::new("fence")?), "lock:#fence{zd}");
        assert_eq!(keys.channel(&LockName::new("a")?), "");
        Ok(())
    }
}

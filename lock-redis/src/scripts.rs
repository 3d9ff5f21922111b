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
    body: String,
    sha: String,
}

impl Lua {
    fn new(body: &'static str) -> Self {
        Self::owned(body.to_owned())
    }

    /// A script made of `prelude` (shared helper functions) and `body`.
    fn with_prelude(prelude: &str, body: &str) -> Self {
        Self::owned(format!("{prelude}{body}"))
    }

    fn owned(body: String) -> Self {
        let sha = Script::new(&body).get_hash().to_owned();
        Self { body, sha }
    }

    /// The script as one `EVAL` with its body, for a pipeline in which a
    /// `NOSCRIPT` retry would repeat what follows it.
    pub(crate) fn eval(&self, keys: &[String], args: &[String]) -> redis::Cmd {
        script_command("EVAL", &self.body, keys, args)
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
                script_command("EVAL", &self.body, keys, args)
                    .query_async(conn)
                    .await
            }
            other => other,
        }
    }
}

impl Lua {
    /// Runs a script that only reads as `EVALSHA_RO` (falling back to
    /// `EVAL_RO` with the body), which a user with read-only key rights
    /// (`%R~...`) may run and a replica may serve. A server before 7.0,
    /// which has no such commands, gets `EVALSHA`/`EVAL` instead.
    pub(crate) async fn run_read_only<T: FromRedisValue>(
        &self,
        conn: &mut Link,
        keys: &[String],
        args: &[String],
    ) -> RedisResult<T> {
        let first = match script_command("EVALSHA_RO", &self.sha, keys, args)
            .query_async(conn)
            .await
        {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                script_command("EVAL_RO", &self.body, keys, args)
                    .query_async(conn)
                    .await
            }
            other => other,
        };
        match first {
            Err(e) if is_unknown_command(&e) => self.run(conn, keys, args).await,
            other => other,
        }
    }
}

/// `ERR unknown command`: how a server answers a command it does not have.
fn is_unknown_command(e: &redis::RedisError) -> bool {
    e.code() == Some("ERR") && e.detail().is_some_and(|d| d.contains("unknown command"))
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

/// The holder record an acquire writes beside the lock, in Lua: the
/// server's clock in microseconds (from `TIME`, as text: no float is
/// involved), and `meta(key, owner, fence, ttl, identity)` setting the
/// record `1 <owner> <fence or -> <acquired µs> <ttl ms> <identity>` with
/// the lock's TTL. The format is described at [`KeySpace::meta`].
const META_LUA: &str = r"
local function now_us()
  local t = redis.call('time')
  return t[1] .. string.sub('00000' .. t[2], -6)
end
local function meta(key, owner, fence, ttl, identity, now)
  redis.call('set', key, '1 ' .. owner .. ' ' .. fence .. ' ' .. now .. ' ' .. ttl .. ' ' .. identity, 'PX', ttl)
end
";

/// Takes the lock and draws a fencing token in one step, or does nothing.
///
/// The counter is bumped before the key is written: if the `INCR` is refused
/// (an ACL without `incr`, a foreign value in the counter key), no lock exists
/// without a token. A key that already holds the caller's owner token is
/// granted again with a new, higher token: owner tokens are never reused, so
/// that is this very attempt re-sent after a lost reply (the cluster client
/// re-sends after an I/O error), and refusing it would leave the lock
/// unusable for one TTL. `KEYS[1]` lock, `KEYS[2]` counter, `KEYS[3]` the
/// holder record; `ARGV[1]` owner token, `ARGV[2]` TTL in ms, `ARGV[3]` the
/// holder's identity (empty: none). Returns the token, or 0 when the lock is
/// held.
pub(crate) static ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::with_prelude(
        META_LUA,
        r"
local v = redis.call('get', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
local fence = redis.call('incr', KEYS[2])
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
meta(KEYS[3], ARGV[1], string.format('%d', fence), ARGV[2], ARGV[3], now_us())
return fence
",
    )
});

/// [`ACQUIRE`] without a fencing token, for servers that refuse
/// `SET NX GET` (before Redis 7.0), for acquires that store a holder record,
/// and for acknowledged acquires (whose pipeline sends one `EVAL`).
/// `KEYS[1]` lock, `KEYS[2]` holder record; `ARGV` as [`ACQUIRE`]'s.
/// Returns 1 acquired, 0 held.
pub(crate) static ACQUIRE_UNFENCED: LazyLock<Lua> = LazyLock::new(|| {
    Lua::with_prelude(
        META_LUA,
        r"
local v = redis.call('get', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
meta(KEYS[2], ARGV[1], '-', ARGV[2], ARGV[3], now_us())
return 1
",
    )
});

/// [`ACQUIRE`] over many locks, for attempts that queued while others were
/// in flight (see `attempts`): `KEYS[1]` is the counter, then each lock
/// followed by its holder record; `ARGV` holds owner token, TTL and identity
/// triples in lock order. Returns a token (or 0, held) per lock. Each lock
/// is decided as [`ACQUIRE`] decides it; one that fails (a refused `INCR`)
/// fails the whole call, which leaves the locks taken before it to their
/// callers' releases, as a lost reply would.
pub(crate) static ACQUIRE_MANY: LazyLock<Lua> = LazyLock::new(|| {
    Lua::with_prelude(
        META_LUA,
        r"
local out = {}
local now = now_us()
for j = 1, (#KEYS - 1) / 2 do
  local key, owner, ttl = KEYS[2 * j], ARGV[3 * j - 2], ARGV[3 * j - 1]
  local v = redis.call('get', key)
  if v and v ~= owner then
    out[j] = 0
  else
    local fence = redis.call('incr', KEYS[1])
    out[j] = fence
    redis.call('set', key, owner, 'PX', ttl)
    meta(KEYS[2 * j + 1], owner, string.format('%d', fence), ttl, ARGV[3 * j], now)
  end
end
return out
",
    )
});

/// [`ACQUIRE_UNFENCED`] over many locks: `KEYS` holds each lock followed by
/// its holder record, `ARGV` owner token, TTL and identity triples in lock
/// order. Returns 1 (acquired) or 0 (held) per lock.
pub(crate) static ACQUIRE_MANY_UNFENCED: LazyLock<Lua> = LazyLock::new(|| {
    Lua::with_prelude(
        META_LUA,
        r"
local out = {}
local now = now_us()
for j = 1, #KEYS / 2 do
  local key, owner, ttl = KEYS[2 * j - 1], ARGV[3 * j - 2], ARGV[3 * j - 1]
  local v = redis.call('get', key)
  if v and v ~= owner then
    out[j] = 0
  else
    redis.call('set', key, owner, 'PX', ttl)
    meta(KEYS[2 * j], owner, '-', ttl, ARGV[3 * j], now)
    out[j] = 1
  end
end
return out
",
    )
});

/// Extends the lease and its holder record if the token matches. `KEYS[1]`
/// lock, `KEYS[2]` holder record; `ARGV[1]` owner token, `ARGV[2]` TTL in
/// ms. Returns 1 held (extended), 2 stolen (another token), 0 expired (no
/// key); never creates a key. The forced-release mark is read apart, and
/// only for a lease found gone or taken ([`forced_mark_names`]): a script
/// naming a key that does not exist is refused with `TRYAGAIN` while its
/// slot migrates, and the mark almost never exists, so naming it here
/// would stop every renewal in a migrating slot.
///
/// [`forced_mark_names`]: crate::inspect::forced_mark_names
pub(crate) static RENEW: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local v = redis.call('get', KEYS[1])
if v == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  redis.call('pexpire', KEYS[2], ARGV[2])
  return 1
end
if v then return 2 end
return 0
",
    )
});

/// [`RENEW`] over many leases: `KEYS` holds lock and holder record pairs,
/// `ARGV` token and TTL pairs, in lease order.
pub(crate) static RENEW_MANY: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local out = {}
for i = 1, #KEYS / 2 do
  local key, owner = KEYS[2 * i - 1], ARGV[2 * i - 1]
  local v = redis.call('get', key)
  if v == owner then
    redis.call('pexpire', key, ARGV[2 * i])
    redis.call('pexpire', KEYS[2 * i], ARGV[2 * i])
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

/// Reads whether the lease is still this owner's, without extending it:
/// `KEYS[1]` lock; `ARGV[1]` owner token. Returns [`RENEW`]'s codes (the
/// mark is read apart, as for [`RENEW`]). Reads only.
pub(crate) static CHECK: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local v = redis.call('get', KEYS[1])
if v == ARGV[1] then return 1 end
if v then return 2 end
return 0
",
    )
});

/// Whether the forced-release mark `KEYS[1]` names owner `ARGV[1]`: 1 yes,
/// 0 no. Reads only; one key, so a migrating slot redirects it instead of
/// refusing it.
pub(crate) static MARK: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
if redis.call('get', KEYS[1]) == ARGV[1] then return 1 end
return 0
",
    )
});

/// Deletes the lease (and its holder record, `KEYS[2]`) if the token
/// matches and announces it on `ARGV[2]` (unless that is empty: in cluster
/// mode a `PUBLISH` would be broadcast to every node, and nobody listens).
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
  redis.call('del', KEYS[1], KEYS[2])
  return 1
end
return 0
",
    )
});

/// What an inspection reads of each lock, in one step (reads only: no key
/// is written or extended): `KEYS` holds lock and holder record pairs.
/// Returns the server's `TIME` (seconds, microseconds) and, per lock, its
/// `PTTL` (-2: no key), its value (empty when it is not a string) and its
/// holder record (empty when none).
pub(crate) static DESCRIBE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local t = redis.call('time')
local out = {t[1], t[2]}
for j = 1, #KEYS / 2 do
  local p = redis.call('pttl', KEYS[2 * j - 1])
  local v, m = '', ''
  if p ~= -2 then
    v = redis.pcall('get', KEYS[2 * j - 1])
    if type(v) ~= 'string' then v = '' end
    m = redis.pcall('get', KEYS[2 * j])
    if type(m) ~= 'string' then m = '' end
  end
  out[#out + 1] = p
  out[#out + 1] = v
  out[#out + 1] = m
end
return out
",
    )
});

/// An operator's forced release: frees the lock if its holder record
/// carries the fencing token `ARGV[1]`, leaving a mark that names the freed
/// owner so its renewals answer "forced". `KEYS[1]` lock, `KEYS[2]` holder
/// record, `KEYS[3]` mark; `ARGV[2]` the release channel (empty: none).
///
/// The mark lives for the longer of the lock's remaining TTL and the TTL
/// the lease was taken with, so the holder's next renewal (due within a
/// third of that TTL) finds it. Returns `{1}` released, `{0}` not held,
/// `{2, token}` another lease holds it (`token` empty when that lease has
/// no token or no record).
pub(crate) static FORCE_RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local v = redis.pcall('get', KEYS[1])
if not v then return {0} end
if type(v) ~= 'string' then return {2, ''} end
local m = redis.pcall('get', KEYS[2])
local fence, ttl = '', 0
if type(m) == 'string' then
  local o, f, a, t = string.match(m, '^1 (%S+) (%S+) (%S+) (%S+)')
  if o == v and f ~= '-' then
    fence, ttl = f, tonumber(t) or 0
  end
end
if fence == '' or fence ~= ARGV[1] then return {2, fence} end
local keep = redis.call('pttl', KEYS[1])
if keep < ttl then keep = ttl end
if keep < 1 then keep = 1 end
if ARGV[2] ~= '' then redis.call('publish', ARGV[2], '') end
redis.call('del', KEYS[1], KEYS[2])
redis.call('set', KEYS[3], v, 'PX', keep)
return {1}
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

/// One transition of a tick's record (lock-core's `TickWrite::apply`), as
/// the function `write_tick`: the record, the job's latest completed tick
/// and the tick's mark (keys sharing the job's hash tag), then `S` (start)
/// or `C` (complete), the token, the start's Unix ms, the replica, what to do
/// with a stale `Started` (`R` refuse, `A` abandon, `T` take over), keep in
/// ms, the tick. Returns the record as it stands after the step (or false).
/// Tokens are compared as Lua numbers: exact up to 2^53.
const WRITE_TICK_LUA: &str = r"
local function write_tick(rec, latest, mark, op, token, at, replica, stale, keep, tick)
  local cur = redis.call('get', rec)
  local tok = tonumber(token)
  local nxt = nil
  if op == 'S' then
    if not cur then
      nxt = 'S:' .. token .. ':' .. at .. ':' .. replica
    else
      local kind, held = string.match(cur, '^(%a):(%d+)')
      if kind == 'S' and tonumber(held) < tok then
        if stale == 'A' then
          nxt = 'A:' .. token
        elseif stale == 'T' then
          nxt = 'S:' .. token .. ':' .. at .. ':' .. replica
        end
      end
    end
  elseif cur then
    local kind, held = string.match(cur, '^(%a):(%d+)')
    if kind == 'S' and tonumber(held) == tok then
      nxt = 'C:' .. token
      local last = redis.call('get', latest)
      if (not last) or tonumber(last) < tonumber(tick) then
        redis.call('set', latest, tick)
      end
      redis.call('set', mark, '1', 'PX', keep)
    end
  end
  if nxt then
    redis.call('set', rec, nxt, 'PX', keep)
    return nxt
  end
  return cur
end
";

/// One transition of a tick's record in one step (see [`WRITE_TICK_LUA`]
/// for what it does). KEYS: the record, the job's latest completed tick,
/// the tick's mark. ARGV: the operation, the token, the start's Unix ms, the
/// replica, the stale policy, keep in ms, the tick.
pub(crate) static WRITE_TICK: LazyLock<Lua> = LazyLock::new(|| {
    Lua::with_prelude(
        WRITE_TICK_LUA,
        r"
return write_tick(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
",
    )
});

/// [`WRITE_TICK`] over many ticks, each its own step in order: `KEYS` holds
/// three keys per tick and `ARGV` seven arguments per tick, as for one.
/// Returns each tick's record after its step (or false).
pub(crate) static WRITE_TICKS: LazyLock<Lua> = LazyLock::new(|| {
    Lua::with_prelude(
        WRITE_TICK_LUA,
        r"
local out = {}
for j = 1, #KEYS / 3 do
  local k, a = 3 * (j - 1), 7 * (j - 1)
  out[j] = write_tick(KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], ARGV[a + 1], ARGV[a + 2],
    ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7]) or false
end
return out
",
    )
});

/// Checked `Started` writes (lock-core's `StartCheck::verdict`, then the
/// write where the checks pass), each its own step in order, against one
/// reading of the server's clock. `KEYS` holds three keys per tick as for
/// [`WRITE_TICK`]; `ARGV` nine arguments per tick: the seven of a
/// [`WRITE_TICK`] (the operation `S`), then the tolerance in ms, and `1`
/// when the tick is late on the replica's clock.
/// Returns a pair per tick: `H` and the server's clock (ahead), `M`
/// (marked), `V` and the latest completed tick (covered), `W` and the
/// record after the write, or `E` and a latest tick that is no number.
pub(crate) static CHECKED_STARTS: LazyLock<Lua> = LazyLock::new(|| {
    Lua::with_prelude(
        WRITE_TICK_LUA,
        r"
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for j = 1, #KEYS / 3 do
  local k, a = 3 * (j - 1), 9 * (j - 1)
  local tick, tol = tonumber(ARGV[a + 7]), tonumber(ARGV[a + 8])
  if tick - now > tol then
    out[j] = {'H', string.format('%d', now)}
  elseif redis.call('exists', KEYS[k + 3]) == 1 then
    out[j] = {'M', false}
  else
    local last = redis.call('get', KEYS[k + 2])
    local l = last and tonumber(last)
    if last and not l then
      out[j] = {'E', last}
    elseif l and (l == tick or (l > tick and (ARGV[a + 9] == '1' or l - tick > tol))) then
      out[j] = {'V', last}
    else
      out[j] = {'W', write_tick(KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], ARGV[a + 1], ARGV[a + 2],
        ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7]) or false}
    end
  end
end
return out
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

    /// The key prefix.
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The lock whose key is `key`: `None` for a key outside the prefix or
    /// one that is not a lock's (its holder record, a mark, a counter, a
    /// tick: their names hold `#`, which no lock name does).
    pub(crate) fn name_of(&self, key: &str) -> Option<LockName> {
        let rest = key.strip_prefix(self.prefix.as_str())?;
        LockName::new(rest).ok()
    }

    /// The holder record of `name`: `<prefix>#meta:<name>`, or in cluster
    /// mode `<prefix>#meta{<tag>}<name>` (the tag puts it in the lock key's
    /// slot). Its value is `1 <owner> <fence> <acquired> <ttl> <identity>`:
    /// format version 1, the owner token (the record is the holder's only
    /// while the lock key holds the same token), the fencing token (`-`
    /// without one), the server's clock at the acquire in microseconds since
    /// the Unix epoch, the TTL asked for at the acquire in ms, and the
    /// holder's identity (empty when none was given; it may hold spaces, so
    /// it comes last). It expires with the lock.
    pub(crate) fn meta(&self, name: &LockName) -> String {
        self.aux("#meta", name)
    }

    /// The mark a forced release of `name` leaves, naming the freed owner
    /// token: `<prefix>#forced:<name>`, or in cluster mode
    /// `<prefix>#forced{<tag>}<name>`. It expires on its own.
    pub(crate) fn forced(&self, name: &LockName) -> String {
        self.aux("#forced", name)
    }

    /// `<prefix><kind>:<name>`, or `<prefix><kind>{<tag>}<name>` in
    /// cluster mode, in the slot of `name`'s lock key.
    fn aux(&self, kind: &str, name: &LockName) -> String {
        let lock = self.lock(name);
        let mut key = String::with_capacity(lock.len() + kind.len() + 8);
        key.push_str(&self.prefix);
        key.push_str(kind);
        if self.cluster {
            key.push('{');
            key.push_str(fence_tag(&lock));
            key.push('}');
        } else {
            key.push(':');
        }
        key.push_str(name.as_str());
        key
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
        assert_eq!(keys.meta(&name), "lock:#meta:fence");
        assert_eq!(keys.forced(&name), "lock:#forced:fence");
        assert_eq!(keys.name_of("lock:fence"), Some(name.clone()));
        for aux in [
            keys.meta(&name),
            keys.forced(&name),
            keys.fence(),
            keys.tick(&name),
        ] {
            assert_eq!(keys.name_of(&aux), None, "{aux}");
        }
        assert_eq!(keys.name_of("other:fence"), None);
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
            for aux in [keys.meta(&name), keys.forced(&name)] {
                assert_eq!(key_slot(aux.as_bytes()), key_slot(lock.as_bytes()), "{aux}");
                assert!(aux.ends_with(n), "{aux}");
                assert_eq!(keys.name_of(&aux), None, "{aux}");
            }
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

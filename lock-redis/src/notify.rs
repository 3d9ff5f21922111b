//! Release notification over pub/sub, so a waiting acquire wakes when the
//! holder releases instead of polling.
//!
//! One subscriber connection per backend carries every channel its waiters
//! need: a channel is subscribed by its first waiter (confirmed before the
//! waiter proceeds) and unsubscribed when its last waiter goes. If the
//! connection drops, every waiter is woken once (a spurious wake-up; the
//! caller simply tries again) and the next waiter opens a new connection.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use lock_core::{backend::ReleaseSignal, BackendError};
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::{oneshot, Mutex, Notify};
use tracing::debug;

use crate::connection::Source;
use crate::error::{from_redis, timed_out};

pub(crate) struct ReleaseNotifier {
    inner: Arc<Inner>,
}

struct Inner {
    source: Source,
    target: String,
    connect_timeout: Duration,
    op_timeout: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    link: Option<Link>,
    next_generation: u64,
    next_serial: u64,
    channels: HashMap<String, Channel>,
}

/// The live subscriber connection. Dropping `_stop` ends its reader task,
/// which closes the connection.
struct Link {
    generation: u64,
    sink: PubSubSink,
    _stop: oneshot::Sender<()>,
}

impl State {
    /// Closes connection `generation` (if still current) and wakes every
    /// waiter that relied on it, so none waits on a dead subscription.
    fn drop_link(&mut self, generation: u64) {
        if self
            .link
            .as_ref()
            .is_some_and(|l| l.generation == generation)
        {
            self.link = None;
        }
        self.channels.retain(|_, ch| {
            if ch.generation == generation {
                ch.notify.notify_waiters();
                false
            } else {
                true
            }
        });
    }
}

/// The waiters of one channel. `serial` tells this registration from a
/// later one of the same channel, so a stale waiter never counts down a
/// successor's registration.
struct Channel {
    serial: u64,
    generation: u64,
    waiters: usize,
    notify: Arc<Notify>,
}

impl ReleaseNotifier {
    pub(crate) fn new(
        source: Source,
        target: String,
        connect_timeout: Duration,
        op_timeout: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                source,
                target,
                connect_timeout,
                op_timeout,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// Subscribes to `channel`; the returned signal fires on the next message
    /// there, or when the subscriber connection is lost.
    pub(crate) async fn subscribe(&self, channel: String) -> Result<ReleaseSignal, BackendError> {
        let inner = &self.inner;
        let mut st = inner.state.lock().await;
        let (generation, mut sink) = match &st.link {
            Some(link) => (link.generation, link.sink.clone()),
            None => self.open(&mut st).await?,
        };
        st.next_serial += 1;
        let fresh = st.next_serial;
        let entry = st
            .channels
            .entry(channel.clone())
            .or_insert_with(|| Channel {
                serial: fresh,
                generation,
                waiters: 0,
                notify: Arc::new(Notify::new()),
            });
        entry.waiters += 1;
        let first = entry.waiters == 1;
        let mut notified = Box::pin(Arc::clone(&entry.notify).notified_owned());
        notified.as_mut().enable();
        // Armed before the next await, so a caller that drops this future
        // mid-subscribe still counts itself out again.
        let guard = Waiter {
            inner: Arc::clone(inner),
            channel: channel.clone(),
            serial: entry.serial,
        };
        if first {
            // Still under the state lock, so an unsubscribe of the same
            // channel cannot slip in between and undo this subscription.
            let outcome = tokio::time::timeout(inner.op_timeout, sink.subscribe(&channel)).await;
            let failure = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(from_redis(e, "subscribe to releases", &inner.target)),
                Err(_) => Some(timed_out(
                    "subscribe to releases",
                    &inner.target,
                    inner.op_timeout,
                )),
            };
            if let Some(err) = failure {
                st.channels.remove(&channel);
                if err.kind().is_unavailable() {
                    st.drop_link(generation);
                }
                return Err(err);
            }
        }
        drop(st);
        Ok(ReleaseSignal::new(async move {
            let _guard = guard;
            notified.await;
        }))
    }

    async fn open(&self, st: &mut State) -> Result<(u64, PubSubSink), BackendError> {
        let inner = &self.inner;
        let op = "open the release subscriber";
        // A replica also delivers what is published on its primary, so a
        // subscriber need not check the role of the server it reached.
        let pubsub = match tokio::time::timeout(inner.connect_timeout, async {
            let client = inner.source.client().await?;
            client
                .get_async_pubsub()
                .await
                .map_err(|e| from_redis(e, op, &inner.target))
        })
        .await
        {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(timed_out(op, &inner.target, inner.connect_timeout)),
        };
        let (sink, stream) = pubsub.split();
        st.next_generation += 1;
        let generation = st.next_generation;
        let (stop_tx, stop_rx) = oneshot::channel();
        tokio::spawn(read_messages(
            Arc::downgrade(inner),
            generation,
            stream,
            stop_rx,
        ));
        st.link = Some(Link {
            generation,
            sink: sink.clone(),
            _stop: stop_tx,
        });
        Ok((generation, sink))
    }
}

async fn read_messages(
    inner: Weak<Inner>,
    generation: u64,
    mut stream: PubSubStream,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let msg = tokio::select! {
            msg = stream.next() => msg,
            _ = &mut stop => return,
        };
        let Some(inner) = inner.upgrade() else { return };
        let mut st = inner.state.lock().await;
        match msg {
            Some(msg) => {
                if let Some(ch) = st.channels.get(msg.get_channel_name()) {
                    ch.notify.notify_waiters();
                }
            }
            None => {
                debug!(server = %inner.target, "release subscriber disconnected; waking every waiter");
                st.drop_link(generation);
                return;
            }
        }
    }
}

/// One waiter's interest in a channel; the last one to go unsubscribes.
struct Waiter {
    inner: Arc<Inner>,
    channel: String,
    serial: u64,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = Arc::clone(&self.inner);
        let channel = std::mem::take(&mut self.channel);
        let serial = self.serial;
        rt.spawn(async move {
            let mut st = inner.state.lock().await;
            let Some(ch) = st.channels.get_mut(&channel) else {
                return;
            };
            if ch.serial != serial {
                return;
            }
            let generation = ch.generation;
            ch.waiters = ch.waiters.saturating_sub(1);
            if ch.waiters > 0 {
                return;
            }
            st.channels.remove(&channel);
            let Some(link) = st.link.as_ref().filter(|l| l.generation == generation) else {
                return;
            };
            let mut sink = link.sink.clone();
            // Under the state lock, for the same reason as the subscribe.
            let outcome = tokio::time::timeout(inner.op_timeout, sink.unsubscribe(&channel)).await;
            if !matches!(outcome, Ok(Ok(()))) {
                debug!(server = %inner.target, "unsubscribe failed; dropping the subscriber connection");
                st.drop_link(generation);
            }
        });
    }
}

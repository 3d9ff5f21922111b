//! Test hook (feature `test-util`): calls a test's function at each point
//! of the tick protocol, so a test can freeze a replica there. Without the
//! feature the points compile to nothing.

use chrono::{DateTime, Utc};

/// A point of the tick protocol at which a test may freeze a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProtocolPoint {
    /// The tick fired here; its lock is not taken yet.
    Fired,
    /// The tick's lock is held; its `Started` record is not written yet.
    Claimed,
    /// This replica's `Started` write won; the handler is not called yet.
    Started,
    /// The handler returned; its `Completed` record is not written yet.
    HandlerReturned,
    /// The `Completed` write was sent and applied; its reply is not read yet.
    CompletedSent,
}

impl ProtocolPoint {
    /// Every point, in protocol order.
    pub const ALL: [Self; 5] = [
        Self::Fired,
        Self::Claimed,
        Self::Started,
        Self::HandlerReturned,
        Self::CompletedSent,
    ];
}

/// The test's function: awaited at each point with the job and the tick.
#[cfg(feature = "test-util")]
pub type PauseHook = std::sync::Arc<
    dyn Fn(ProtocolPoint, &str, DateTime<Utc>) -> futures_util::future::BoxFuture<'static, ()>
        + Send
        + Sync,
>;

/// Awaits the hook at `point`, if one is set.
pub(crate) async fn at(
    rt: &crate::runtime::Runtime,
    point: ProtocolPoint,
    job: &str,
    tick: DateTime<Utc>,
) {
    #[cfg(feature = "test-util")]
    if let Some(hook) = &rt.pause {
        hook(point, job, tick).await;
    }
    #[cfg(not(feature = "test-util"))]
    let _ = (rt, point, job, tick);
}

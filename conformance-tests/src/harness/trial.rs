//! Backend-specific trials: a body that takes one deployment handle, run on a
//! runtime of its own within a time limit, as `<row>::<name>`.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};

use super::in_ci;
use crate::{BoxError, Suite};

/// A trial body over one handle (a factory or a deployment), boxed so that
/// the bodies of one table share a type.
pub type TrialBody<A> = fn(A) -> Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;

/// Runs one trial's body on a two-worker runtime of its own, failing the
/// trial past `limit`.
pub fn run_bounded<E: Into<Failed>>(
    body: impl Future<Output = Result<(), E>>,
    limit: Duration,
) -> Result<(), Failed> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let outcome = rt.block_on(async {
        match tokio::time::timeout(limit, body).await {
            Ok(result) => result.map_err(Into::into),
            Err(_) => Err(format!("did not finish within {limit:?}").into()),
        }
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    outcome
}

/// Adds one trial `<row>::<name>` per entry of `table`, each running its
/// body over a clone of `handle` within `limit`.
pub fn push_bounded<A: Clone + Send + 'static>(
    suite: &mut Suite,
    row: &str,
    handle: &A,
    limit: Duration,
    table: &[(&str, TrialBody<A>)],
) {
    for &(name, body) in table {
        let handle = handle.clone();
        suite.push(Trial::test(format!("{row}::{name}"), move || {
            run_bounded(body(handle), limit)
        }));
    }
}

/// A table for [`push_bounded`]: `"name" => path` entries, each path an
/// async fn that takes the handle and returns `Result<(), BoxError>`. With a
/// leading `(a, b) as Type;`, the paths take two arguments instead and are
/// boxed as `Type`, for tables run some other way.
#[macro_export]
macro_rules! trial_table {
    ($($name:literal => $body:path),* $(,)?) => {
        [$((
            $name,
            (|h| ::std::boxed::Box::pin($body(h))) as $crate::harness::TrialBody<_>,
        )),*]
    };
    (($a:ident, $b:ident) as $ty:ty; $($name:literal => $body:path),* $(,)?) => {
        [$((
            $name,
            (|$a, $b| ::std::boxed::Box::pin($body($a, $b))) as $ty,
        )),*]
    };
}

/// Stands in for trials that cannot run here because `why` (a binary or
/// tool is missing): under `CI=true` a trial `name` that fails saying so, so
/// that CI never passes them over; elsewhere nothing, and a loud line on
/// stderr.
pub fn unavailable(name: &str, why: &str) -> Option<Trial> {
    if in_ci() {
        let msg = why.to_owned();
        Some(Trial::test(name, move || Err(msg.into())))
    } else {
        eprintln!("!!! SKIPPING {name}: {why}. Set CI=true to make this a failure.");
        None
    }
}

//! Test servers: where they come from, and control over private ones.
//!
//! A backend's server is taken from an URL in the environment or from a
//! private server started from its binary on `PATH` ([`ServerProcess`]);
//! with the `docker` feature the `docker_*` rows run containers too
//! (`harness::docker`). [`Availability`] turns
//! "none of these worked" into a failure under `CI=true` and a loud skip
//! elsewhere, so a missing server is never silently passed over in CI.

pub mod certs;
#[cfg(feature = "docker")]
pub mod docker;
pub mod nft;
mod process;
mod trial;

pub use process::{free_port, wait_for_port, ServerProcess, ServerSpec};
pub use trial::{push_bounded, run_bounded, unavailable, TrialBody};

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::BoxError;

/// Whether this run is in CI (`CI=true`), where every backend must be tested.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The full path of `binary` if it is on `PATH`.
pub fn which(binary: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
}

/// Whether a backend's server could be had for this run.
#[derive(Debug)]
pub enum Availability<T> {
    /// Here it is.
    Ready(T),
    /// It could not be had, for this reason.
    Missing(String),
}

impl<T> Availability<T> {
    /// The same answer, a ready value turned by `f` (a factory into an
    /// `Arc<dyn BackendFactory>`, say).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Availability<U> {
        match self {
            Self::Ready(t) => Availability::Ready(f(t)),
            Self::Missing(why) => Availability::Missing(why),
        }
    }
}

/// Asks `check` every `every` until it says yes, for up to `within`
/// (blocking the thread between asks). On time out, the error it last gave,
/// or an empty string if it only ever said no.
pub fn poll_until(
    within: Duration,
    every: Duration,
    mut check: impl FnMut() -> Result<bool, BoxError>,
) -> Result<(), String> {
    let until = Instant::now() + within;
    let mut last = String::new();
    loop {
        match check() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last = e.to_string(),
        }
        if Instant::now() >= until {
            return Err(last);
        }
        std::thread::sleep(every);
    }
}

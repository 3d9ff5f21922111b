//! The conformance suite: every case written once, run against every backend.
//!
//! A backend joins by implementing [`BackendFactory`] (independent replicas,
//! a [`Saboteur`] that acts from outside, a timing profile) and adding one
//! line to `tests/conformance.rs`. Cases are chosen by the backend's
//! [`Capabilities`](lock_core::Capabilities), never by its name, and each run
//! uses its own random name prefix.
//!
//! Servers come from an URL in the environment or a private server the
//! [`harness`] starts from the binary on `PATH`; with the `docker` feature,
//! the `docker_*` rows run the suite against containers as well. With
//! `CI=true`, a backend whose server cannot be had fails the run instead of
//! being skipped (for the docker rows, `DISTLOCK_REQUIRE_DOCKER=1`).

pub mod availability;
pub mod backends;
pub mod cases;
pub mod chaos;
pub mod child_main;
pub mod factory;
pub mod faulty;
pub mod harness;
pub mod mono;
pub mod observe;
pub mod proxy;
pub mod suite;
pub mod warnings;

pub use factory::{BackendFactory, BoxError, Ctx, Replica, Saboteur, Timing};
pub use suite::Suite;

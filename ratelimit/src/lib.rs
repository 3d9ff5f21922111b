//! Shared rate limits for services that run on several replicas: GCRA
//! computed inside the store, on the store's clock, so every replica sees the
//! same buckets and no replica's clock matters.
//!
//! - [`Quota`] and [`Limit`]: how many per period, with what burst; a
//!   limiter checks several limits at once ("5 a minute and 100 a day"), all
//!   admitted or none charged.
//! - [`gcra::decide`]: the algorithm as a pure function over integer
//!   microseconds, which every store implements.
#![forbid(unsafe_code)]

mod error;
pub mod gcra;
mod quota;

pub use error::{Error, Result, StoreError, StoreErrorKind};
pub use quota::{Limit, Quota, MAX_COUNT, MAX_NAME_LEN, MAX_WINDOW};

/// The longest key (subject) accepted, in bytes. Keys are hashed before they
/// reach a store, so this bounds the work per request, not the store's keys.
pub const MAX_KEY_LEN: usize = 4096;

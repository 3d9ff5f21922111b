//! Factories for each backend compiled into the suite.

pub mod memory;
pub mod redis;
pub mod postgres;

//! Factories for each backend compiled into the suite.

pub mod etcd;
pub mod memory;
pub mod postgres;
pub mod redis;

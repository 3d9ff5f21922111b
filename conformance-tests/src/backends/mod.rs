//! Factories for each backend compiled into the suite.

pub mod etcd;
pub mod memory;

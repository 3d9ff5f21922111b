//! Factories for each backend compiled into the suite.

pub mod connect_urls;
pub mod etcd;
pub mod memory;
pub mod postgres;
pub mod redis;

//! Factories for each backend compiled into the suite.

pub mod connect_urls;
#[cfg(feature = "docker")]
pub mod docker;
#[cfg(feature = "docker")]
pub mod docker_cluster;
#[cfg(feature = "docker")]
pub mod docker_sentinel;
pub mod etcd;
pub mod memory;
pub mod postgres;
pub mod redis;

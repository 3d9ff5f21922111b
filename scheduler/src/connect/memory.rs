//! `memory://` URLs: private or named in-process backends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use lock_memory::MemoryBackend;

use lock_core::redact::redact_url;

use super::Backend;
use crate::{Error, Result};

/// Named in-process backends, so that every `connect("memory://NAME")`
/// in a process reaches the same locks, as connections to one server do.
fn named() -> &'static Mutex<HashMap<String, MemoryBackend>> {
    static NAMED: OnceLock<Mutex<HashMap<String, MemoryBackend>>> = OnceLock::new();
    NAMED.get_or_init(Mutex::default)
}

pub(super) fn connect(url: &str, rest: &str) -> Result<Backend> {
    let name = rest.trim_end_matches('/');
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(Error::InvalidUrl {
            url: redact_url(url),
            reason: "a memory URL is memory:// or memory://NAME, NAME of letters, digits, - _ ."
                .into(),
        });
    }
    let backend = if name.is_empty() {
        MemoryBackend::new()
    } else {
        named()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(name.to_owned())
            .or_default()
            .clone()
    };
    Ok(Backend::new(Arc::new(backend.clone()), Arc::new(backend)))
}

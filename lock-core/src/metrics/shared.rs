//! Registering a set of metrics once per registry, shared by every user.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::Registry;

/// A set of metrics that is registered as one unit (every name or none).
pub trait MetricSet: Clone + Send + Sync + 'static {
    /// Every collector of the set.
    fn collectors(&self) -> Vec<&dyn Collector>;
}

/// Why [`register_shared`] could not register a set.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SharedRegistrationError {
    /// Metrics of these names are registered in this registry by other code.
    #[error("metrics of these names are already registered in this registry by other code")]
    TakenByOthers,
    /// The metric definitions or the registry refused the set.
    #[error(transparent)]
    Prometheus(#[from] prometheus::Error),
}

/// Registers the set `make` builds in `registry`, or returns the set of the
/// same `marker` this process already registered there, so every user
/// reporting into one registry counts into the same series (a second plain
/// `Registry::register` of the same names would be refused).
///
/// A `Registry` cannot say which collector holds a name, so each
/// registration carries a never-exported marker descriptor named `marker`
/// and labelled with its id, and the registry is probed for it. `marker`
/// must be unique to the kind of set (such as `distributed_lock_metrics_instance`).
///
/// # Errors
///
/// [`SharedRegistrationError::TakenByOthers`] if other code registered
/// metrics of these names in `registry`;
/// [`SharedRegistrationError::Prometheus`] for an invalid definition.
pub fn register_shared<M: MetricSet>(
    registry: &Registry,
    marker: &'static str,
    make: impl FnOnce() -> prometheus::Result<M>,
) -> Result<M, SharedRegistrationError> {
    // Held across register-and-record, so two threads registering into one
    // registry at once find each other.
    let mut known = registrations();
    known.retain(|r| r.set.strong_count() > 0);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let set = Arc::new(make()?);
    let collector = Registered {
        set: Arc::clone(&set),
        marker: marker_desc(marker, id)?,
    };
    match registry.register(Box::new(collector)) {
        Ok(()) => {
            let any: Arc<dyn Any + Send + Sync> = set.clone();
            known.push(Registration {
                id,
                marker,
                set: Arc::downgrade(&any),
            });
            Ok((*set).clone())
        }
        Err(prometheus::Error::AlreadyReg) => known
            .iter()
            .rev()
            .filter(|r| r.marker == marker)
            .find(|r| holds_instance(registry, marker, r.id))
            .and_then(|r| r.set.upgrade())
            .and_then(|any| any.downcast::<M>().ok())
            .map(|set| (*set).clone())
            .ok_or(SharedRegistrationError::TakenByOthers),
        Err(e) => Err(e.into()),
    }
}

/// Returns the set `cell` keeps for the process-wide default registry,
/// registering it there with `register` on the first call that succeeds.
/// A set type's `default_registry` passes a `static` cell of its own, so
/// each set is registered there once however often it is asked for.
///
/// # Errors
///
/// Whatever `register` answers; the cell stays empty then, so a later call
/// tries again.
pub fn in_default_registry<M: Clone, E>(
    cell: &'static OnceLock<M>,
    register: impl FnOnce(&Registry) -> Result<M, E>,
) -> Result<M, E> {
    if let Some(set) = cell.get() {
        return Ok(set.clone());
    }
    let set = register(prometheus::default_registry())?;
    Ok(cell.get_or_init(|| set).clone())
}

/// One live registration; only the registry holding it keeps it alive.
struct Registration {
    id: u64,
    marker: &'static str,
    set: Weak<dyn Any + Send + Sync>,
}

fn registrations() -> MutexGuard<'static, Vec<Registration>> {
    static KNOWN: Mutex<Vec<Registration>> = Mutex::new(Vec::new());
    KNOWN.lock().unwrap_or_else(PoisonError::into_inner)
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The descriptor that marks registration `id`. It is never collected, so
/// it never shows in an exposition.
fn marker_desc(marker: &str, id: u64) -> prometheus::Result<Desc> {
    Desc::new(
        marker.into(),
        "Marks which metric set a registry holds; never exported.".into(),
        Vec::new(),
        HashMap::from([("instance".to_owned(), id.to_string())]),
    )
}

/// Whether `registry` holds registration `id`: registering its marker alone
/// is refused exactly then. A probe that went in is taken out at once.
fn holds_instance(registry: &Registry, marker: &str, id: u64) -> bool {
    let Ok(desc) = marker_desc(marker, id) else {
        return false;
    };
    match registry.register(Box::new(Marker(desc.clone()))) {
        Err(prometheus::Error::AlreadyReg) => true,
        Ok(()) => {
            let _ = registry.unregister(Box::new(Marker(desc)));
            false
        }
        Err(_) => false,
    }
}

/// A marker descriptor alone, for probing.
struct Marker(Desc);

impl Collector for Marker {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.0]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        Vec::new()
    }
}

/// A set and its marker, registered as one collector.
struct Registered<M> {
    set: Arc<M>,
    marker: Desc,
}

impl<M: MetricSet> Collector for Registered<M> {
    fn desc(&self) -> Vec<&Desc> {
        let mut descs: Vec<&Desc> = self
            .set
            .collectors()
            .into_iter()
            .flat_map(Collector::desc)
            .collect();
        descs.push(&self.marker);
        descs
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.set
            .collectors()
            .into_iter()
            .flat_map(Collector::collect)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{IntCounter, Opts};

    #[derive(Clone)]
    struct Probe(IntCounter);

    impl MetricSet for Probe {
        fn collectors(&self) -> Vec<&dyn Collector> {
            vec![&self.0]
        }
    }

    fn probe() -> prometheus::Result<Probe> {
        IntCounter::with_opts(Opts::new("shared_probe_total", "A test counter.")).map(Probe)
    }

    #[test]
    fn a_second_registration_shares_the_first_and_others_are_refused() {
        let registry = Registry::new();
        let a = register_shared(&registry, "shared_probe_instance", probe).expect("first");
        let b = register_shared(&registry, "shared_probe_instance", probe).expect("second");
        a.0.inc();
        assert_eq!(b.0.get(), 1, "the second registration got other series");
        // The same names under another marker are someone else's.
        let other = register_shared(&registry, "other_probe_instance", probe);
        assert!(matches!(other, Err(SharedRegistrationError::TakenByOthers)));
        let fresh = register_shared(&Registry::new(), "shared_probe_instance", probe)
            .expect("another registry");
        assert_eq!(fresh.0.get(), 0);
    }

    #[test]
    fn a_dropped_registry_is_forgotten() {
        let registry = Registry::new();
        let set = register_shared(&registry, "forgotten_probe_instance", probe).expect("first");
        let id = registrations()
            .iter()
            .filter(|r| r.marker == "forgotten_probe_instance")
            .map(|r| r.id)
            .find(|id| holds_instance(&registry, "forgotten_probe_instance", *id))
            .expect("the registration is recorded");
        drop(registry);
        drop(set);
        let _ =
            register_shared(&Registry::new(), "forgotten_probe_instance", probe).expect("again");
        assert!(!registrations().iter().any(|r| r.id == id));
    }
}

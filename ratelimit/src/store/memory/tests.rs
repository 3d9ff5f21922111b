use super::*;
use crate::gcra::Cell;
use crate::Quota;

fn hasher(store: &MemoryStore, limits: &[&str]) -> SubjectHasher {
    store
        .subject_hasher("t:limiter", limits.iter().copied())
        .expect("distinct limit names")
}

#[test]
fn in_process_buckets_stay_bounded() {
    let store = MemoryStore::with_max_keys(10_000);
    let one = hasher(&store, &["s"]);
    let two = hasher(&store, &["a", "b"]);
    let cells = [Quota::per_minute(10).expect("quota").cell()];
    let both = [cells[0], cells[0]];
    for i in 0..200_000u32 {
        let subject = format!("k{i}");
        let id = MemoryStore::subject_id(&one, &subject);
        assert!(store.decide_subject(&one, id, &cells, 1).allowed);
        let id = MemoryStore::subject_id(&two, &subject);
        assert!(store.decide_subject(&two, id, &both, 1).allowed);
        if i % 1000 == 0 {
            assert!(store.len() <= 10_000, "held {}", store.len());
        }
    }
    assert!(store.len() <= 10_000, "held {}", store.len());
}

/// Threads racing on one bucket by compare-and-swap admit no more than
/// burst + rate × elapsed, on the times the store read.
#[test]
fn racing_single_limit_decisions_stay_within_the_bound() {
    let store = MemoryStore::new();
    let h = hasher(&store, &["s"]);
    let cell = Quota::per_second(100_000).expect("quota").cell();
    let id = MemoryStore::subject_id(&h, "one");
    let times: Vec<u64> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let mut admitted = Vec::new();
                    for _ in 0..100_000 {
                        let d = store.decide_subject(&h, id, &[cell], 1);
                        if d.allowed {
                            admitted.push(d.now_us);
                        }
                    }
                    admitted
                })
            })
            .collect();
        runs.into_iter()
            .flat_map(|r| r.join().expect("no panic"))
            .collect()
    });
    let first = times.iter().min().copied().expect("admitted");
    let last = times.iter().max().copied().expect("admitted");
    let bound = cell.capacity / cell.interval + (last - first) / cell.interval;
    let admitted = u64::try_from(times.len()).expect("fits");
    assert!(admitted <= bound, "admitted {admitted} > {bound}");
}

/// Sweeps every shard now, as a decision adding a key may.
fn sweep(store: &MemoryStore) {
    let now = store.now_us();
    for shard in store.shards.iter() {
        store.write(shard).sweep(now, store.max_per_shard);
    }
}

/// A sweep racing decisions on a bucket it finds full neither loses a
/// charge (the bucket then admits a third request) nor makes one twice (it
/// then refuses the second). On tokio's paused clock, which the threads
/// read through the runtime's handle, each round starts from a full bucket
/// of burst 2.
#[test]
fn a_sweep_racing_decisions_neither_loses_nor_doubles_a_charge() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    let handle = rt.handle().clone();
    let store = {
        let _in = rt.enter();
        MemoryStore::new()
    };
    let h = hasher(&store, &["s"]);
    let cell = Cell {
        interval: 10,
        capacity: 20,
    };
    let subject = MemoryStore::subject_id(&h, "one");
    let decide = || {
        let _in = handle.enter();
        store.decide_subject(&h, subject, &[cell], 1)
    };
    for round in 0..2_000 {
        // The last round's bucket (TAT = its time + 20 µs) is full again.
        rt.block_on(tokio::time::advance(std::time::Duration::from_micros(20)));
        let start = std::sync::Barrier::new(3);
        let admitted: Vec<bool> = std::thread::scope(|s| {
            let deciders: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        decide().allowed
                    })
                })
                .collect();
            s.spawn(|| {
                let _in = handle.enter();
                start.wait();
                sweep(&store);
            });
            deciders
                .into_iter()
                .map(|d| d.join().expect("no panic"))
                .collect()
        });
        assert_eq!(
            admitted,
            [true, true],
            "round {round}: a charge was doubled"
        );
        let third = decide();
        assert!(!third.allowed, "round {round}: a charge was lost");
        assert_eq!(third.retry_after_us, 10, "round {round}");
    }
}

/// Decisions over two limits and single-limit decisions of a limiter of the
/// same name on one of those limits, racing: every unit of the shared
/// bucket's burst is charged exactly once, and a decision refused by the
/// other limit charges neither. No unit refills while the case runs.
#[test]
fn decisions_over_several_limits_charge_all_or_none_against_single_ones() {
    let store = MemoryStore::new();
    let several = hasher(&store, &["a", "b"]);
    let single = hasher(&store, &["a"]);
    let subject = "shared";
    let interval = 1_000_000_000;
    let shared = Cell {
        interval,
        capacity: interval * 1_000,
    };
    let tight = Cell {
        interval,
        capacity: interval * 100,
    };
    let count = |n: usize, f: &(dyn Fn() -> bool + Sync)| -> u64 {
        u64::try_from((0..n).filter(|_| f()).count()).expect("fits")
    };
    let one = || {
        let id = MemoryStore::subject_id(&single, subject);
        store.decide_subject(&single, id, &[shared], 1).allowed
    };
    let both = || {
        let id = MemoryStore::subject_id(&several, subject);
        store
            .decide_subject(&several, id, &[shared, tight], 1)
            .allowed
    };
    let (singles, severals) = std::thread::scope(|s| {
        let a = s.spawn(|| count(1_000, &one));
        let b = s.spawn(|| count(1_000, &one));
        let c = s.spawn(|| count(200, &both));
        let d = s.spawn(|| count(200, &both));
        let join = |h: std::thread::ScopedJoinHandle<'_, u64>| h.join().expect("no panic");
        (join(a) + join(b), join(c) + join(d))
    });
    assert!(severals <= 100, "the tight limit admitted {severals}");
    assert_eq!(singles + severals, 1_000, "the shared bucket's burst");
    assert!(!one());
    // The other limit's bucket holds exactly the admitted decisions.
    let other = hasher(&store, &["b"]);
    let id = MemoryStore::subject_id(&other, subject);
    let left = store.decide_subject(&other, id, &[tight], 0);
    assert_eq!(left.remaining, 100 - severals);
}

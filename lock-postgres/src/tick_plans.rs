//! The plans of the tick store's batch statements: each reaches the rows of
//! a batch by index lookups on its jobs, even when the table's statistics
//! know nothing of the namespace (they lag behind a table that grew, or a
//! namespace that is new). Written as joins, the statements were planned as
//! a scan of every record of the namespace whenever the statistics lagged,
//! and their cost grew with the records kept (20 to 30 ms a statement over a
//! minute's records of 1,000 jobs).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::types::{ToSql, Type};

use crate::session::Params;
use crate::{PostgresBackend, PostgresBuilder, ENV_VAR};

/// Jobs in the namespace under test, and records kept per job.
const JOBS: i64 = 400;
const TICKS: i64 = 50;
/// Jobs in one batch.
const BATCH: i64 = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_statements_look_records_up_by_job_with_stale_statistics() {
    let Ok(url) = std::env::var(ENV_VAR) else {
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "{ENV_VAR} must be set in CI");
        eprintln!("!!! SKIPPING: {ENV_VAR} is not set");
        return;
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let table = format!("plan_probe_{}_{nanos}", std::process::id());
    let backend = PostgresBuilder::from_url(&url)
        .expect("a valid URL")
        .with_tick_table(&table)
        .with_namespace("fresh")
        .build()
        .expect("a backend");
    // In a task of its own, so that the tables are dropped even when a
    // check fails (panics) or takes too long.
    let checking = tokio::spawn({
        let backend = backend.clone();
        async move { check_plans(&backend).await }
    });
    let abort = checking.abort_handle();
    let checked = tokio::time::timeout(Duration::from_secs(60), checking).await;
    abort.abort();
    let dropped = tokio::time::timeout(Duration::from_secs(20), drop_tables(&backend)).await;
    match checked {
        Ok(Ok(())) => {}
        Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Ok(Err(e)) => panic!("the plan checks did not finish: {e}"),
        Err(_) => panic!("the plans were not read within 60 s"),
    }
    dropped.expect("the tables are dropped within 20 s");
}

/// Fills the tables so that their statistics describe another namespace
/// only, then reads the plan of every batch statement over the namespace
/// the backend writes.
async fn check_plans(backend: &PostgresBackend) {
    let session = backend.session().await.expect("a session");
    let runs = backend.run_table();
    let marks = backend.mark_table();
    let latest = backend.tick_table();
    let fill = format!(
        "{ddl}; \
         ALTER TABLE {runs} SET (autovacuum_enabled = false); \
         ALTER TABLE {marks} SET (autovacuum_enabled = false); \
         ALTER TABLE {latest} SET (autovacuum_enabled = false); \
         INSERT INTO {runs} SELECT 'old', 'job-' || j, t * 1000, 'C', 1, 'r', 0 \
         FROM generate_series(1, 20) j, generate_series(1, 3) t; \
         INSERT INTO {marks} SELECT namespace, job, tick FROM {runs}; \
         INSERT INTO {latest} SELECT 'old', 'job-' || j, 3000 FROM generate_series(1, 20) j; \
         ANALYZE {runs}; ANALYZE {marks}; ANALYZE {latest}; \
         INSERT INTO {runs} SELECT 'fresh', 'job-' || j, t * 1000, 'S', 7, 'r', 0 \
         FROM generate_series(1, {JOBS}) j, generate_series(1, {TICKS}) t; \
         INSERT INTO {marks} SELECT namespace, job, tick FROM {runs} WHERE namespace = 'fresh'; \
         INSERT INTO {latest} SELECT 'fresh', 'job-' || j, {TICKS} * 1000 \
         FROM generate_series(1, {JOBS}) j",
        ddl = backend.tick_table_ddl(),
    );
    session
        .batch("filling the probe tables", &fill)
        .await
        .expect("the probe tables are filled");

    let ns = "fresh";
    let jobs: Vec<String> = (1..=BATCH).map(|j| format!("job-{j}")).collect();
    let ticks: Vec<i64> = vec![TICKS * 1000; jobs.len()];
    let tokens: Vec<i64> = vec![7; jobs.len()];
    let cuts: Vec<i64> = vec![TICKS * 500; jobs.len()];
    let replicas: Vec<&str> = vec!["r"; jobs.len()];
    let stales: Vec<&str> = vec!["R"; jobs.len()];
    let tolerances: Vec<i64> = vec![1_000; jobs.len()];
    let lates: Vec<bool> = vec![false; jobs.len()];
    let triple: [(&(dyn ToSql + Sync), Type); 3] = [
        (&ns, Type::TEXT),
        (&jobs, Type::TEXT_ARRAY),
        (&ticks, Type::INT8_ARRAY),
    ];
    let with_cuts: [(&(dyn ToSql + Sync), Type); 3] = [
        (&ns, Type::TEXT),
        (&jobs, Type::TEXT_ARRAY),
        (&cuts, Type::INT8_ARRAY),
    ];
    let complete: [(&(dyn ToSql + Sync), Type); 4] = [
        (&ns, Type::TEXT),
        (&jobs, Type::TEXT_ARRAY),
        (&ticks, Type::INT8_ARRAY),
        (&tokens, Type::INT8_ARRAY),
    ];
    let record: [(&(dyn ToSql + Sync), Type); 4] = [
        (&ns, Type::TEXT),
        (&jobs, Type::TEXT_ARRAY),
        (&ticks, Type::INT8_ARRAY),
        (&cuts, Type::INT8_ARRAY),
    ];
    let cut = TICKS * 500;
    let checked: [(&(dyn ToSql + Sync), Type); 10] = [
        (&ns, Type::TEXT),
        (&jobs, Type::TEXT_ARRAY),
        (&ticks, Type::INT8_ARRAY),
        (&tokens, Type::INT8_ARRAY),
        (&replicas, Type::TEXT_ARRAY),
        (&ticks, Type::INT8_ARRAY),
        (&stales, Type::TEXT_ARRAY),
        (&tolerances, Type::INT8_ARRAY),
        (&lates, Type::BOOL_ARRAY),
        (&cut, Type::INT8),
    ];
    let statements: [(&str, String, &Params<'_>); 6] = [
        ("completions", backend.complete_sql(), &complete),
        ("pruning", backend.prune_sql(), &with_cuts),
        ("reading records", backend.read_records_sql(), &triple),
        ("reading marks", backend.marks_read_sql(), &triple),
        ("recording completed ticks", backend.record_sql(), &record),
        ("checked starts", backend.checked_sql(false), &checked),
    ];
    // The latest ticks' table holds a row per job, not per record kept: a
    // scan of it the planner finds cheaper stays cheap. Its lookups are
    // still checked to name the job when they use its index.
    let growing = [runs.as_str(), marks.as_str()];
    let mut wrong = Vec::new();
    for (what, sql, params) in statements {
        let rows = session
            .query(what, &format!("EXPLAIN (COSTS OFF) {sql}"), params)
            .await
            .unwrap_or_else(|e| panic!("EXPLAIN of the {what} statement: {e}"));
        let plan: Vec<String> = rows
            .iter()
            .map(|r| r.try_get::<_, String>(0).expect("a plan line"))
            .collect();
        if let Some(scan) = scan_not_by_job(&plan, &growing, &[latest.as_str()]) {
            wrong.push(format!("{what}: {scan}\n{}", plan.join("\n")));
        }
    }
    assert!(
        wrong.is_empty(),
        "statements that read the tick tables other than by job:\n{}",
        wrong.join("\n\n")
    );
}

/// The first scan in `plan` (EXPLAIN's text lines) that reads rows other
/// than by their job: a sequential scan of one of `growing`, or an index
/// scan of one of `growing` or `small` whose condition does not name the job
/// (the namespace alone).
fn scan_not_by_job(plan: &[String], growing: &[&str], small: &[&str]) -> Option<String> {
    let bare = |t: &&str| format!(" {}", t.rsplit('.').next().unwrap_or(t).trim_matches('"'));
    let growing: Vec<String> = growing.iter().map(bare).collect();
    let every: Vec<String> = growing
        .iter()
        .cloned()
        .chain(small.iter().map(bare))
        .collect();
    for (i, line) in plan.iter().enumerate() {
        let Some(node) = line.split("->").last().map(str::trim) else {
            continue;
        };
        let on = |kind: &str, tables: &[String]| {
            node.starts_with(kind)
                && tables
                    .iter()
                    .any(|t| node.ends_with(t.as_str()) || node.contains(&format!("{t} ")))
        };
        if on("Seq Scan", &growing) {
            return Some(node.to_owned());
        }
        if on("Index Scan", &every)
            || on("Index Only Scan", &every)
            || on("Bitmap Index Scan", &every)
        {
            let cond = plan[i + 1..]
                .iter()
                .take_while(|l| !l.contains("->"))
                .find(|l| l.contains("Index Cond:"));
            if !cond.is_some_and(|c| c.contains("job =")) {
                return Some(format!(
                    "{node} ({})",
                    cond.map_or("no condition", |c| c.trim())
                ));
            }
        }
    }
    None
}

async fn drop_tables(backend: &PostgresBackend) {
    let session = backend.session().await.expect("a session");
    let sql = format!(
        "DROP TABLE IF EXISTS {}, {}, {}",
        backend.run_table(),
        backend.mark_table(),
        backend.tick_table()
    );
    session
        .batch("dropping the probe tables", &sql)
        .await
        .expect("the probe tables are dropped");
}

//! Computes `N` successive ticks of an every-second schedule in a zone, for
//! counting the instructions one `Schedule::next_after` costs under
//! `valgrind --tool=callgrind` (every job evaluates its schedule once per
//! tick, so with many jobs firing every second this shows in profiles).
//!
//! ```text
//! cargo build --release -p scheduler --example next_tick_cost
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.1k  target/release/examples/next_tick_cost UTC 1000
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.11k target/release/examples/next_tick_cost UTC 11000
//! ```
//!
//! The difference of the two totals divided by 10,000 is the cost of one
//! evaluation, without start-up.

use scheduler::Schedule;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let zone = args.next().unwrap_or_else(|| "UTC".into());
    let count: u32 = args.next().map_or(Ok(1000), |n| n.parse())?;
    let schedule = Schedule::parse("cost", "* * * * * *", &zone)?;
    let mut tick = chrono::DateTime::from_timestamp(1_790_000_000, 0).ok_or("a start instant")?;
    for _ in 0..count {
        tick = schedule.next_after(tick).ok_or("the schedule ended")?;
    }
    println!("{count} ticks in {zone}, the last at {tick}");
    Ok(())
}

//! The per-thread generator that owner tokens are drawn from.
//!
//! A system call per token cost more than the rest of an in-process acquire
//! and release together. A ChaCha12 generator seeded from the operating
//! system is as unpredictable to anyone without its seed, and a thread-local
//! one needs no lock.

use std::cell::RefCell;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::Error;

/// Tokens drawn from one seed before the next is taken from the operating
/// system: 64 KiB of output, the threshold `rand`'s own thread generator
/// uses. It bounds what a leaked generator state would reveal, and what a
/// forked child (whose copy of the state repeats its parent's) shares with
/// its parent.
const TOKENS_PER_SEED: u32 = 4096;

struct Seeded {
    rng: StdRng,
    left: u32,
}

thread_local! {
    static GENERATOR: RefCell<Option<Seeded>> = const { RefCell::new(None) };
}

/// 16 bytes from this thread's generator, seeding it first if it has no seed
/// or its seed is used up.
pub(super) fn draw() -> Result<[u8; 16], Error> {
    let from_thread = GENERATOR.try_with(|cell| {
        // Nothing here calls back into `draw`, so the borrow cannot fail;
        // if it ever did, the operating system's source still answers.
        let mut slot = cell.try_borrow_mut().ok()?;
        Some(draw_from(&mut slot))
    });
    match from_thread {
        Ok(Some(drawn)) => drawn,
        // The thread is being torn down (a guard dropped by a thread-local
        // destructor): no generator any more, so ask the OS directly.
        _ => from_os(),
    }
}

fn draw_from(slot: &mut Option<Seeded>) -> Result<[u8; 16], Error> {
    let seeded = match slot {
        Some(s) if s.left > 0 => s,
        _ => slot.insert(Seeded {
            rng: StdRng::from_seed(seed()?),
            left: TOKENS_PER_SEED,
        }),
    };
    seeded.left -= 1;
    let mut bytes = [0u8; 16];
    seeded.rng.fill_bytes(&mut bytes);
    Ok(bytes)
}

fn seed() -> Result<[u8; 32], Error> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(entropy)?;
    Ok(seed)
}

fn from_os() -> Result<[u8; 16], Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(entropy)?;
    Ok(bytes)
}

fn entropy(e: getrandom::Error) -> Error {
    Error::Entropy(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_used_up_seed_is_replaced_and_the_stream_goes_on_unrepeated() -> Result<(), Error> {
        let mut slot = None;
        let mut seen = HashSet::new();
        for _ in 0..(2 * TOKENS_PER_SEED + 3) {
            assert!(seen.insert(draw_from(&mut slot)?), "a token repeated");
        }
        let left = slot.as_ref().map(|s| s.left);
        assert_eq!(
            left,
            Some(TOKENS_PER_SEED - 3),
            "reseeded twice, then 3 drawn"
        );
        Ok(())
    }

    #[test]
    fn two_generators_seeded_apart_draw_different_streams() -> Result<(), Error> {
        let (mut a, mut b) = (None, None);
        let from_a: Vec<_> = (0..64)
            .map(|_| draw_from(&mut a))
            .collect::<Result<_, _>>()?;
        let from_b: Vec<_> = (0..64)
            .map(|_| draw_from(&mut b))
            .collect::<Result<_, _>>()?;
        assert!(from_a.iter().all(|t| !from_b.contains(t)));
        Ok(())
    }
}

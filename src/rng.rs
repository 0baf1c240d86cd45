//! A small seeded PRNG (SplitMix64): enough for jitter and simulation, and no `rand` needed.
//!
//! The core never seeds from the OS: the seed is configuration, so a run replays exactly.

/// SplitMix64 (Steele, Lea and Flood), a fast generator with a 64-bit state that passes
/// BigCrush; every seed, including 0, gives a full-period stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator that yields the same stream for the same seed.
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.state)
    }

    /// A uniform value in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        unit(self.next_u64())
    }

    /// A uniform value in `[low, high)`; `low` when the range is empty.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            return low;
        }
        // Multiply-shift maps 64 random bits onto the range with negligible bias.
        low + ((u128::from(self.next_u64()) * u128::from(high - low)) >> 64) as u64
    }

    /// True with probability `p` (clamped to `[0, 1]`).
    pub fn chance(&mut self, p: f64) -> bool {
        self.next_f64() < p
    }

    /// A new generator whose stream is independent of this one's continuation.
    pub fn fork(&mut self) -> Rng {
        Rng::new(mix(self.next_u64() ^ 0xD1B5_4A32_D192_ED03))
    }
}

/// SplitMix64's finalizer: a bijective mix of 64 bits, also handy to derive entropy from ids.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Maps 64 random bits to a uniform value in `[0, 1)` (53 bits of precision).
pub fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
    }

    #[test]
    fn known_first_value_for_seed_zero() {
        // Reference value of SplitMix64 seeded with 0.
        assert_eq!(Rng::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn ranges_stay_in_bounds() {
        let mut rng = Rng::new(42);
        for _ in 0..10_000 {
            let x = rng.range(10, 20);
            assert!((10..20).contains(&x));
            let f = rng.next_f64();
            assert!((0.0..1.0).contains(&f));
        }
        assert_eq!(rng.range(5, 5), 5);
    }
}

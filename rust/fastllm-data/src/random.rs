//! The one pseudo-random generator of this crate, fixed here so that sampling is identical on
//! every platform and every Rust release.

/// SplitMix64 (Steele, Lea and Flood, 2014; Vigna's reference `splitmix64.c`).
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `0..n` without bias (Lemire's multiply-and-reject), for `n > 0`.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        let mut product = u128::from(self.next_u64()) * u128::from(n);
        if (product as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (product as u64) < threshold {
                product = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (product >> 64) as u64
    }
}

/// SplitMix64's output function: a bijective avalanche of 64 bits.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_splitmix64_sequence() {
        // Outputs of Vigna's splitmix64.c seeded with 1234567.
        let mut rng = SplitMix64::new(1_234_567);
        let outputs: Vec<u64> = (0..5).map(|_| rng.next_u64()).collect();
        assert_eq!(
            outputs,
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423,
                4_593_380_528_125_082_431,
                16_408_922_859_458_223_821,
            ]
        );
    }

    #[test]
    fn below_stays_in_range_and_hits_every_value() {
        let mut rng = SplitMix64::new(7);
        for n in [1, 2, 3, 7, 1000] {
            let mut seen = vec![false; n as usize];
            for _ in 0..20 * n {
                let value = rng.below(n);
                assert!(value < n);
                seen[value as usize] = true;
            }
            assert!(seen.iter().all(|&s| s), "n = {n}");
        }
    }

    #[test]
    fn below_is_roughly_uniform() {
        let mut rng = SplitMix64::new(42);
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[rng.below(6) as usize] += 1;
        }
        // Each count is Binomial(60000, 1/6): mean 10000, sd about 91.
        assert!(
            counts.iter().all(|&c| (9_500..10_500).contains(&c)),
            "{counts:?}"
        );
    }
}

//! Times building a sampling index at training scale: 10 million packed samples of 4096 tokens
//! over a million documents of 1 to 8191 tokens (about ten epochs).
//!
//! `cargo run --release -p fastllm-data --example sampling_speed`

use std::time::Instant;

use fastllm_data::{BlendingIndex, SamplingConfig, SamplingIndex, SamplingMode};

fn main() {
    // Document lengths from a fixed xorshift generator, so every run times the same work.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let lengths: Vec<u32> = (0..1_000_000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            1 + (state % 8191) as u32
        })
        .collect();
    let config = SamplingConfig {
        sequence_length: 4096,
        num_samples: 10_000_000,
        seed: 1234,
        mode: SamplingMode::Packed,
    };

    let start = Instant::now();
    let index = SamplingIndex::build(&lengths, config).expect("valid inputs");
    println!("build packed: {:.3} s", start.elapsed().as_secs_f64());

    let start = Instant::now();
    let pieces: usize = (0..index.len())
        .map(|s| index.pieces(s).expect("in range").count())
        .sum();
    println!(
        "walk all pieces: {:.3} s ({pieces} pieces)",
        start.elapsed().as_secs_f64()
    );

    let path =
        std::env::temp_dir().join(format!("fastllm_sampling_speed_{}.bin", std::process::id()));
    let start = Instant::now();
    index.save(&path).expect("writable temp dir");
    println!("save: {:.3} s", start.elapsed().as_secs_f64());
    let start = Instant::now();
    let loaded = SamplingIndex::load(&path).expect("just saved");
    println!("load: {:.3} s", start.elapsed().as_secs_f64());
    assert!(loaded == index);
    std::fs::remove_file(&path).expect("just saved");

    let start = Instant::now();
    let truncated = SamplingIndex::build(
        &lengths,
        SamplingConfig {
            mode: SamplingMode::Truncated,
            ..config
        },
    )
    .expect("valid inputs");
    println!(
        "build truncated: {:.3} s ({} samples)",
        start.elapsed().as_secs_f64(),
        truncated.len()
    );

    let start = Instant::now();
    let blend = BlendingIndex::build(&[0.5, 0.3, 0.2], 10_000_000).expect("valid weights");
    println!(
        "blend 3 datasets: {:.3} s ({} samples)",
        start.elapsed().as_secs_f64(),
        blend.len()
    );
}

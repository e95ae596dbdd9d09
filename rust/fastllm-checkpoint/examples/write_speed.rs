//! Times `write_file` on 2 GB of tensors (64 × 32 MiB, like a model's bf16 weights), with the
//! fsync, then `verify` of the committed checkpoint, next to the in-memory checksum speed, which
//! bounds neither.
//!
//! `cargo run --release -p fastllm-checkpoint --example write_speed [-- DIRECTORY]`
//!
//! DIRECTORY (default: a temporary directory) picks the file system to measure.

use std::collections::BTreeMap;
use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use fastllm_checkpoint::{commit, verify, write_file, Dtype, SharedBytes, TensorRef};

const TENSORS: usize = 64;
const TENSOR_BYTES: usize = 32 << 20;

fn main() -> Result<(), Box<dyn Error>> {
    let scratch = match std::env::args_os().nth(1) {
        Some(directory) => tempfile::tempdir_in(PathBuf::from(directory))?,
        None => tempfile::tempdir()?,
    };
    let tensors: Vec<TensorRef> = (0..TENSORS)
        .map(|i| {
            // Not zeros, which some file systems store sparsely or compress.
            let data: SharedBytes = Arc::new(
                (0..TENSOR_BYTES)
                    .map(|j| ((j as u64 * 2654435761) >> 13) as u8 ^ i as u8)
                    .collect::<Vec<u8>>(),
            );
            let shape = vec![(TENSOR_BYTES / 2 / 4096) as u64, 4096];
            TensorRef::new(format!("layers.{i}.weight"), Dtype::BF16, shape, data)
        })
        .collect();
    let total = (TENSORS * TENSOR_BYTES) as f64;

    let start = Instant::now();
    let mut checksums = 0u64;
    for tensor in &tensors {
        checksums ^= xxhash_rust::xxh3::xxh3_64(tensor.bytes());
    }
    std::hint::black_box(checksums);
    report("xxh3-64 in memory", total, start);

    let partial = scratch.path().join(".1.partial");
    std::fs::create_dir(&partial)?;
    let start = Instant::now();
    let file = write_file(
        &partial.join("rank_0.safetensors"),
        &tensors,
        &BTreeMap::new(),
    )?;
    report("write_file (write + checksum + fsync)", total, start);

    let final_dir = scratch.path().join("1");
    commit(
        &partial,
        &final_dir,
        serde_json::json!({"step": 1}),
        &[file],
    )?;
    let start = Instant::now();
    verify(&final_dir)?;
    report("verify (read back, mostly page cache)", total, start);
    Ok(())
}

fn report(what: &str, bytes: f64, start: Instant) {
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "{what:40} {:6.2} GB/s ({seconds:.2} s)",
        bytes / seconds / 1e9
    );
}

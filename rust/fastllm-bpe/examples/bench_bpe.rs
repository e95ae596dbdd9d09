//! Single-thread throughput of `ByteLevelBpe` against the `tokenizers` crate on the Python
//! standard library's top-level sources.
//!
//! `cargo run --release -p fastllm-bpe --example bench_bpe [-- tokenizer.json]`: without a
//! path, a 4000-token byte-level BPE is trained on the corpus first.

#[path = "../tests/common/mod.rs"]
mod common;

use fastllm_bpe::ByteLevelBpe;
use std::str::FromStr;
use std::time::Instant;
use tokenizers::Tokenizer;

const REPEATS: usize = 3;

fn main() {
    let Some(corpus) = common::stdlib_corpus(usize::MAX) else {
        std::process::exit(1);
    };
    let bytes: usize = corpus.iter().map(String::len).sum();
    let json = match std::env::args().nth(1) {
        Some(path) => std::fs::read_to_string(path).expect("readable tokenizer.json"),
        None => common::train_byte_level_bpe(&corpus, 4000, true),
    };
    let reference = Tokenizer::from_str(&json).expect("tokenizers loads it");
    let ours = ByteLevelBpe::from_json_str(&json).expect("supported by fastllm-bpe");
    println!(
        "corpus: {} files, {:.1} MB",
        corpus.len(),
        bytes as f64 / 1e6
    );

    let mut ids = Vec::new();
    let ours_rate = rate(|| {
        let mut tokens = 0;
        for text in &corpus {
            ids.clear();
            ours.encode(text, &mut ids);
            tokens += ids.len();
        }
        tokens
    });
    let encode_rate = rate(|| {
        corpus
            .iter()
            .map(|text| reference.encode(text.as_str(), false).unwrap().len())
            .sum()
    });
    let encode_fast_rate = rate(|| {
        corpus
            .iter()
            .map(|text| reference.encode_fast(text.as_str(), false).unwrap().len())
            .sum()
    });
    let tokens = ours_rate.tokens;
    assert_eq!(
        tokens, encode_rate.tokens,
        "both encoders give as many tokens"
    );
    println!(
        "{tokens} tokens per pass; M tokens/s in the first pass (cold caches) and the best pass"
    );
    for (name, r) in [
        ("fastllm-bpe", &ours_rate),
        ("tokenizers encode", &encode_rate),
        ("tokenizers encode_fast", &encode_fast_rate),
    ] {
        println!(
            "{name:<24} first {:>6.2}  best {:>6.2}  (fastllm-bpe is {:.1}x / {:.1}x)",
            r.first / 1e6,
            r.best / 1e6,
            ours_rate.first / r.first,
            ours_rate.best / r.best,
        );
    }
}

struct Rate {
    tokens: usize,
    first: f64,
    best: f64,
}

/// Tokens/s of the first of [`REPEATS`] passes (caches cold) and of the best one.
fn rate(mut pass: impl FnMut() -> usize) -> Rate {
    let mut rates = Vec::new();
    let mut tokens = 0;
    for _ in 0..REPEATS {
        let start = Instant::now();
        tokens = pass();
        rates.push(tokens as f64 / start.elapsed().as_secs_f64());
    }
    Rate {
        tokens,
        first: rates[0],
        best: rates.iter().copied().fold(0.0, f64::max),
    }
}

//! Times `prepare` on the Python standard library's sources as JSON lines, with 1, 2, 4 …
//! tokenizer workers up to the core count, through the fast encoder and through the `tokenizers`
//! crate. MB/s are of the JSON-lines input.
//!
//! `cargo run --release -p fastllm-data --example prepare_speed [-- TOKENIZER_JSON]`
//!
//! The sources are repeated up to 64 MB, so that fixed costs (loading the tokenizer, fsync) do
//! not hide the throughput. Without a tokenizer, a 32k byte-level BPE is first trained on part
//! of the corpus; the second pass adds an NFC normalizer to it, which the fast encoder declines,
//! to time the fallback.

use std::error::Error;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use fastllm_data::{prepare, InputSpec, PrepareOptions, Progress, TrainOn};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

/// Text the trained tokenizer learns from.
const TRAINING_BYTES: usize = 4 << 20;
/// Text the timed runs tokenize, at least.
const CORPUS_BYTES: usize = 64 << 20;

fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let scratch = tempfile::tempdir()?;
    let corpus = scratch.path().join("stdlib.jsonl");
    let texts = stdlib_sources()?;
    let text_bytes: usize = texts.iter().map(String::len).sum();
    let copies = CORPUS_BYTES.div_ceil(text_bytes);
    write_jsonl(&corpus, &texts, copies)?;
    println!(
        "corpus: {} files, {:.1} MB of text, {copies} times",
        texts.len(),
        text_bytes as f64 / 1e6
    );

    let tokenizers = match std::env::args().nth(1) {
        Some(path) => vec![PathBuf::from(path)],
        None => {
            let start = Instant::now();
            let paths = train_tokenizers(&texts, scratch.path())?;
            println!(
                "trained a 32k BPE in {:.1} s",
                start.elapsed().as_secs_f64()
            );
            paths
        }
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let most = cores.max(2);
    let mut worker_counts: Vec<usize> = (0..).map(|i| 1 << i).take_while(|&w| w < most).collect();
    worker_counts.push(most);
    for tokenizer in &tokenizers {
        for &workers in &worker_counts {
            let output = scratch.path().join(format!("out-{workers}"));
            let options = PrepareOptions {
                input: InputSpec {
                    paths: vec![corpus.display().to_string()],
                    ..InputSpec::default()
                },
                feed: None,
                tokenizer: tokenizer.clone(),
                eos_token: None,
                bos_token: None,
                add_eos: true,
                add_bos: false,
                output,
                shard_size_tokens: 1 << 30,
                workers,
                strict: false,
                overwrite: true,
                chat_template: None,
                train_on: TrainOn::Assistant,
                max_pair_tokens: None,
            };
            let start = Instant::now();
            let report = prepare(&options, &Progress::new())?;
            let seconds = start.elapsed().as_secs_f64();
            let bytes = report.inputs[0].bytes as f64;
            println!(
                "{:<12} workers {workers}: {:6.2} s  {:5.2} M tokens/s  {:5.1} MB/s  \
                 ({} tokens, {} documents)",
                report.tokenizer.implementation.to_string(),
                seconds,
                report.tokens as f64 / seconds / 1e6,
                bytes / seconds / 1e6,
                report.tokens,
                report.documents,
            );
        }
    }
    Ok(())
}

/// Every `.py` file of the standard library (without site-packages), in path order.
fn stdlib_sources() -> Result<Vec<String>, Box<dyn Error + Send + Sync>> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['stdlib'])",
        ])
        .output()?;
    let stdlib = PathBuf::from(String::from_utf8(out.stdout)?.trim());
    let mut texts = Vec::new();
    for entry in walkdir::WalkDir::new(&stdlib).sort_by_file_name() {
        let entry = entry?;
        let path = entry.path();
        let is_python = path.extension().is_some_and(|e| e == "py");
        if is_python && !path.components().any(|c| c.as_os_str() == "site-packages") {
            if let Ok(text) = fs::read_to_string(path) {
                texts.push(text);
            }
        }
    }
    if texts.is_empty() {
        return Err(format!("no Python sources under {}", stdlib.display()).into());
    }
    Ok(texts)
}

fn write_jsonl(
    path: &Path,
    texts: &[String],
    copies: usize,
) -> Result<(), Box<dyn Error + Send + Sync>> {
    let mut out = BufWriter::new(fs::File::create(path)?);
    for text in texts.iter().cycle().take(copies * texts.len()) {
        serde_json::to_writer(&mut out, &serde_json::json!({ "text": text }))?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}

/// A GPT-2-style 32k byte-level BPE trained on the start of `texts`, and the same with an NFC
/// normalizer.
fn train_tokenizers(
    texts: &[String],
    dir: &Path,
) -> Result<Vec<PathBuf>, Box<dyn Error + Send + Sync>> {
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(32_000)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut total = 0;
    let sample = texts.iter().take_while(|text| {
        total += text.len();
        total < TRAINING_BYTES
    });
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.train(&mut trainer, sample)?;
    let fast = dir.join("tokenizer.json");
    tokenizer.save(&fast, false)?;
    tokenizer.with_normalizer(Some(NFC))?;
    let fallback = dir.join("tokenizer-nfc.json");
    tokenizer.save(&fallback, false)?;
    Ok(vec![fast, fallback])
}

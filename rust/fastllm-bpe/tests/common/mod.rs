//! Shared by the tests and the benchmark: the Python standard library's sources as a corpus,
//! and byte-level BPE tokenizers trained on it with the `tokenizers` crate.

use std::path::PathBuf;
use std::process::Command;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

pub const SPECIAL_TOKENS: [&str; 5] = [
    "<|endoftext|>",
    "<fim_prefix>",
    "<fim_middle>",
    "<fim_suffix>",
    "<fim_pad>",
];

/// The standard library directory of the `python3` on the PATH, if there is one.
pub fn stdlib_dir() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['stdlib'])",
        ])
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (out.status.success() && dir.is_dir()).then_some(dir)
}

/// The top-level `*.py` files of the standard library, by name, up to about `max_bytes`;
/// `None` (after saying why) when there is no Python to find them with.
pub fn stdlib_corpus(max_bytes: usize) -> Option<Vec<String>> {
    let Some(dir) = stdlib_dir() else {
        eprintln!("skipping: no python3 on the PATH to find the standard library corpus");
        return None;
    };
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .ok()?
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "py"))
        .collect();
    paths.sort();
    let mut texts = Vec::new();
    let mut total = 0;
    for path in paths {
        if total >= max_bytes {
            break;
        }
        if let Ok(text) = std::fs::read_to_string(&path) {
            total += text.len();
            texts.push(text);
        }
    }
    Some(texts)
}

/// A byte-level BPE (`ByteLevel` pre-tokenizer without prefix space, with or without GPT-2's
/// regex) trained on `texts`, with [`SPECIAL_TOKENS`], as `tokenizer.json` text.
pub fn train_byte_level_bpe(texts: &[String], vocab_size: usize, use_regex: bool) -> String {
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(
            SPECIAL_TOKENS
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, use_regex)));
    tokenizer
        .train(&mut trainer, texts.iter())
        .expect("training succeeds");
    tokenizer.to_string(false).expect("serializes")
}

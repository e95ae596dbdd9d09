//! Shared by the prepare, tokenizer and input tests: small tokenizers trained here with the
//! `tokenizers` crate, input files in every format, and reading prepared datasets back.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fastllm_data::{IndexedDataset, InputSpec, PrepareOptions, TrainOn};
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<s>", "<|pad|>"];

/// Text in several scripts and some code, to train on and to encode.
pub fn sample_texts() -> Vec<String> {
    let mut texts = vec![
        "The quick brown fox jumps over the lazy dog.".to_owned(),
        "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n".to_owned(),
        "Ünïcödé façade — naïve café; 日本語のテキスト; emoji 🦀🚀.".to_owned(),
        "    indented\tand\ttabbed\r\nwindows lines\r\n".to_owned(),
        "Numbers 1234567890 and 3.14159, plus <|endoftext|> inside text.".to_owned(),
        String::new(),
    ];
    for i in 0..40 {
        texts.push(format!(
            "Document {i}: fn item_{i}(x: u32) -> u32 {{ x * {i} + {} }} // the value\n",
            i * 7
        ));
    }
    texts
}

/// Writes a byte-level BPE (GPT-2 style) trained on [`sample_texts`] to `dir/tokenizer.json`;
/// with `normalize`, an NFC normalizer that the fast encoder does not support.
pub fn write_tokenizer(dir: &Path, normalize: bool) -> PathBuf {
    let tokenizer = train_byte_level_bpe(&sample_texts(), &SPECIAL_TOKENS, 2, normalize);
    fs::create_dir_all(dir).unwrap();
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, false).expect("saves");
    path
}

/// A GPT-2-style byte-level BPE of 400 tokens trained on `texts`, with `specials` and merges
/// seen at least `min_frequency` times; with `normalize`, an NFC normalizer.
pub fn train_byte_level_bpe(
    texts: &[String],
    specials: &[&str],
    min_frequency: u64,
    normalize: bool,
) -> tokenizers::Tokenizer {
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(400)
        .min_frequency(min_frequency)
        .show_progress(false)
        .special_tokens(
            specials
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    if normalize {
        tokenizer.with_normalizer(Some(NFC)).unwrap();
    }
    tokenizer
        .train(&mut trainer, texts.iter())
        .expect("training succeeds");
    tokenizer
}

/// What the `tokenizers` crate makes of `text`, without special tokens: the reference.
pub fn reference_ids(tokenizer_json: &Path, text: &str) -> Vec<u32> {
    let tokenizer = tokenizers::Tokenizer::from_file(tokenizer_json).unwrap();
    tokenizer.encode(text, false).unwrap().get_ids().to_vec()
}

pub fn write_jsonl(path: &Path, texts: &[String]) {
    let lines: String = texts
        .iter()
        .enumerate()
        .map(|(i, text)| serde_json::json!({"id": i, "text": text}).to_string() + "\n")
        .collect();
    let bytes = lines.into_bytes();
    let name = path.to_string_lossy();
    if name.ends_with(".gz") {
        let mut encoder = flate2::write::GzEncoder::new(
            fs::File::create(path).unwrap(),
            flate2::Compression::default(),
        );
        encoder.write_all(&bytes).unwrap();
        encoder.finish().unwrap();
    } else if name.ends_with(".zst") {
        fs::write(path, zstd::encode_all(&bytes[..], 3).unwrap()).unwrap();
    } else {
        fs::write(path, bytes).unwrap();
    }
}

/// A Parquet file with a nullable string column `text` (`None` rows are nulls) and an `id`
/// column, `rows_per_group` rows per row group, Snappy-compressed.
pub fn write_parquet(path: &Path, texts: &[Option<&str>], rows_per_group: usize) {
    let schema = Arc::new(
        parse_message_type(
            "message document { REQUIRED INT64 id; OPTIONAL BYTE_ARRAY text (UTF8); }",
        )
        .unwrap(),
    );
    let properties = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .build(),
    );
    let file = fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, schema, properties).unwrap();
    for (group, rows) in texts.chunks(rows_per_group).enumerate() {
        let mut row_group = writer.next_row_group().unwrap();
        let mut ids = row_group.next_column().unwrap().unwrap();
        let first = (group * rows_per_group) as i64;
        let values: Vec<i64> = (first..first + rows.len() as i64).collect();
        ids.typed::<parquet::data_type::Int64Type>()
            .write_batch(&values, None, None)
            .unwrap();
        ids.close().unwrap();
        let mut column = row_group.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = rows.iter().flatten().map(|t| ByteArray::from(*t)).collect();
        let levels: Vec<i16> = rows.iter().map(|t| i16::from(t.is_some())).collect();
        column
            .typed::<ByteArrayType>()
            .write_batch(&values, Some(&levels), None)
            .unwrap();
        column.close().unwrap();
        row_group.close().unwrap();
    }
    writer.close().unwrap();
}

/// Options for the common case: EOS added, one big shard, two workers.
pub fn options(paths: &[&Path], tokenizer: &Path, output: &Path) -> PrepareOptions {
    PrepareOptions {
        input: InputSpec {
            paths: paths.iter().map(|p| p.display().to_string()).collect(),
            ..InputSpec::default()
        },
        feed: None,
        tokenizer: tokenizer.to_owned(),
        eos_token: None,
        bos_token: None,
        add_eos: true,
        add_bos: false,
        output: output.to_owned(),
        shard_size_tokens: 1 << 30,
        workers: 2,
        strict: false,
        overwrite: false,
        chat_template: None,
        train_on: TrainOn::Assistant,
        max_pair_tokens: None,
    }
}

/// Every document of every shard named in `output/metadata.json`, in order.
pub fn read_documents(output: &Path) -> Vec<Vec<u32>> {
    let metadata = read_metadata(output);
    let mut documents = Vec::new();
    for shard in metadata["shards"].as_array().unwrap() {
        let dataset = IndexedDataset::open(output.join(shard["name"].as_str().unwrap())).unwrap();
        for i in 0..dataset.len() {
            let tokens = dataset.document(i).unwrap().to_vec();
            documents.push(tokens.into_iter().map(|t| t as u32).collect());
        }
    }
    documents
}

pub fn read_metadata(output: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(output.join("metadata.json")).unwrap()).unwrap()
}

/// The names in `dir`, sorted.
pub fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

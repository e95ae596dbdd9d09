//! `ByteLevelBpe` gives the ids of the `tokenizers` crate, on the Python standard library and
//! on strings chosen to hit every branch of the pre-tokenizers, for each supported layout of
//! `tokenizer.json`.

mod common;

use fastllm_bpe::{BpeError, ByteLevelBpe};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::str::FromStr;
use std::sync::OnceLock;
use tokenizers::Tokenizer;

const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

struct Fixture {
    corpus: Vec<String>,
    /// GPT-2 layout: `ByteLevel` pre-tokenizer, no prefix space.
    gpt2: Value,
    /// The GPT-2 layout with merges learnt across word boundaries, so that a word boundary
    /// misplaced by a pre-tokenizer almost always changes the ids.
    crossing: Value,
}

/// Trained once per test binary; `None` when there is no Python standard library to train on.
fn fixture() -> Option<&'static Fixture> {
    static FIXTURE: OnceLock<Option<Fixture>> = OnceLock::new();
    FIXTURE
        .get_or_init(|| {
            let corpus = common::stdlib_corpus(3 << 20)?;
            let training: Vec<String> = corpus.iter().step_by(3).cloned().collect();
            let gpt2 = common::train_byte_level_bpe(&training, 4000, true);
            let crossing =
                common::train_byte_level_bpe(&boundary_training_texts(&corpus), 3000, false);
            Some(Fixture {
                corpus,
                gpt2: serde_json::from_str(&gpt2).unwrap(),
                crossing: serde_json::from_str(&crossing).unwrap(),
            })
        })
        .as_ref()
}

/// What the regexes treat differently: letters of several scripts, digits, all kinds of
/// whitespace, apostrophes and contractions, punctuation, marks, emoji, pieces of special tokens.
const PIECES: &[&str] = &[
    "a",
    "Z",
    "s",
    "t",
    "re",
    "LL",
    "é",
    "ſ",
    "Ω",
    "я",
    "中",
    "ي",
    "0",
    "7",
    "٣",
    "Ⅻ",
    "½",
    " ",
    "  ",
    "\t",
    "\n",
    "\r",
    "\r\n",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "\u{85}",
    "\u{b}",
    "'",
    "'s",
    "'T",
    "'ſt",
    "\"",
    ".",
    "(",
    "_",
    "-",
    "#",
    "€",
    "\u{301}",
    "\u{200d}",
    "👍",
    "🏽",
    "<|endoftext|>",
    "<fim_prefix>",
    "<|",
    "|>",
    "fim",
    "\u{0}",
];

/// Short texts made of [`PIECES`] (from a fixed-seed generator) and of source lines, whole:
/// trained without pre-tokenization, their merges span every kind of boundary.
fn boundary_training_texts(corpus: &[String]) -> Vec<String> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = |n: usize| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize % n
    };
    let mut texts: Vec<String> = (0..20_000)
        .map(|_| (0..next(12)).map(|_| PIECES[next(PIECES.len())]).collect())
        .collect();
    for file in corpus.iter().take(5) {
        let lines: Vec<&str> = file.split_inclusive('\n').collect();
        texts.extend(lines.chunks(2).map(|c| c.concat()));
    }
    texts
}

fn adversarial_strings() -> Vec<String> {
    let mut strings: Vec<String> = [
        "",
        " ",
        "   ",
        "\n",
        "\n\n\n",
        "\t\t",
        " \n ",
        "a \n\n b",
        "trailing   ",
        "   leading",
        "mixed\r\n\r\nlines\r",
        "tabs\t\tand  spaces \t\n  x",
        "  \n\t \r\n  y\n \n",
        "x\u{a0}y \u{a0} z",
        "\u{3000}全角\u{3000}\u{3000}",
        "line\u{2028}sep\u{2029}para\u{85}nel",
        "Καλημέρα κόσμε, ΑΒΓ",
        "你好，世界。日本語のテキスト",
        "٣٤٥ ١٢ ۱۲۳ १२३ Ⅻ ½ x² ①",
        "e\u{301} a\u{308}\u{301} \u{301}\u{302} ́x",
        "👍🏽 👨\u{200d}👩\u{200d}👧 🇫🇷🇩🇪 😀😀",
        "한국어 ภาษาไทย עברית العربية",
        "I'M YOU'RE we'Ve it'S they'LL I'D 'S 'T",
        "'s ''s don't ' s  's 'll've '' 'x",
        "'ſ 'ſt Straße 'K",
        "<|endoftext|>",
        "a<|endoftext|>b",
        "<|endoftext|><|endoftext|>",
        "<fim_prefix>def f():<fim_suffix>\n    return 1<fim_middle>",
        "< |endoftext|> <|endoftext| <fim_pre<fim_prefix>fix>",
        " <|endoftext|> \n<fim_pad>\n\n",
        "1234567 3.14159  12 345 x1y2 0x1F",
        "def f(a, b):\n    return a + b  # comment\n\n\nclass C:\n\tpass\n",
        "$abc (abc ((abc .Hello ..x -1 _x __init__",
        "a\u{0}b\u{1}c\u{7f}d",
    ]
    .map(String::from)
    .to_vec();
    for (run, n) in [
        ("a", 100_000),
        (" ", 50_000),
        ("\n", 20_000),
        ("é", 20_000),
        ("1", 10_000),
        (")", 30_000),
        ("ab", 20_000),
        (" a", 20_000),
        ("\t ", 10_000),
    ] {
        strings.push(run.repeat(n));
    }
    strings.push(format!("x{}y", " ".repeat(5000)));
    strings
}

/// Both encoders, loaded from the same `tokenizer.json`.
struct Pair {
    reference: Tokenizer,
    ours: ByteLevelBpe,
}

impl Pair {
    fn new(json: &Value) -> Self {
        let json = json.to_string();
        Self {
            reference: Tokenizer::from_str(&json).expect("tokenizers loads it"),
            ours: ByteLevelBpe::from_json_str(&json).expect("supported"),
        }
    }

    fn assert_same_ids<'a>(&self, texts: impl IntoIterator<Item = &'a str>) {
        let mut ids = Vec::new();
        for text in texts {
            let expected = self
                .reference
                .encode(text, false)
                .unwrap()
                .get_ids()
                .to_vec();
            ids.clear();
            self.ours.encode(text, &mut ids);
            if ids != expected {
                let at = ids
                    .iter()
                    .zip(&expected)
                    .take_while(|(a, b)| a == b)
                    .count();
                let tokens = |ids: &[u32]| -> Vec<String> {
                    ids.iter()
                        .skip(at.saturating_sub(3))
                        .take(8)
                        .map(|&id| self.reference.id_to_token(id).unwrap_or_default())
                        .collect()
                };
                panic!(
                    "ids differ at {at} for text starting {:?}:\nexpected {:?}\n     got {:?}",
                    text.chars().take(60).collect::<String>(),
                    tokens(&expected),
                    tokens(&ids),
                );
            }
        }
    }
}

fn assert_same_ids<'a>(json: &Value, texts: impl IntoIterator<Item = &'a str>) {
    Pair::new(json).assert_same_ids(texts);
}

fn with_pre_tokenizer(base: &Value, pre_tokenizer: Value) -> Value {
    let mut json = base.clone();
    json["pre_tokenizer"] = pre_tokenizer;
    json
}

fn byte_level(add_prefix_space: bool, use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": use_regex})
}

fn split(pattern: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

fn llama3_layout(base: &Value, pattern: &str) -> Value {
    let mut json = with_pre_tokenizer(
        base,
        json!({"type": "Sequence", "pretokenizers": [split(pattern), byte_level(false, false)]}),
    );
    json["model"]["ignore_merges"] = json!(true);
    json
}

fn corpus_and_adversarial(f: &Fixture) -> impl Iterator<Item = String> + '_ {
    f.corpus.iter().cloned().chain(adversarial_strings())
}

#[test]
fn gpt2_layout_matches_tokenizers_on_corpus_and_adversarial_strings() {
    let Some(f) = fixture() else { return };
    let texts: Vec<String> = corpus_and_adversarial(f).collect();
    assert_same_ids(&f.gpt2, texts.iter().map(String::as_str));
}

#[test]
fn add_prefix_space_matches_tokenizers() {
    let Some(f) = fixture() else { return };
    let json = with_pre_tokenizer(&f.gpt2, byte_level(true, true));
    let texts: Vec<String> = corpus_and_adversarial(f).step_by(4).collect();
    assert_same_ids(&json, texts.iter().map(String::as_str));
}

#[test]
fn byte_level_without_regex_matches_tokenizers() {
    let Some(f) = fixture() else { return };
    let json = with_pre_tokenizer(&f.gpt2, byte_level(true, false));
    let texts: Vec<String> = adversarial_strings()
        .into_iter()
        .chain(f.corpus.iter().take(3).cloned())
        .collect();
    assert_same_ids(&json, texts.iter().map(String::as_str));
}

#[test]
fn llama3_split_with_ignore_merges_matches_tokenizers() {
    let Some(f) = fixture() else { return };
    let mut json = llama3_layout(&f.gpt2, LLAMA3_PATTERN);
    // A word in the vocabulary that the merges cannot build: only ignore_merges emits it whole.
    let id = json["model"]["vocab"].as_object().unwrap().len();
    json["model"]["vocab"]["Ġunreachableword"] = json!(id);
    let text = "an unreachableword here";
    let ours = ByteLevelBpe::from_json_str(&json.to_string()).unwrap();
    let mut ids = Vec::new();
    ours.encode(text, &mut ids);
    assert!(
        ids.contains(&(id as u32)),
        "ignore_merges emits the word as one token"
    );
    let texts: Vec<String> = corpus_and_adversarial(f).chain([text.into()]).collect();
    assert_same_ids(&json, texts.iter().map(String::as_str));
}

#[test]
fn qwen2_split_matches_tokenizers() {
    let Some(f) = fixture() else { return };
    let json = llama3_layout(&f.gpt2, QWEN2_PATTERN);
    let texts: Vec<String> = corpus_and_adversarial(f).step_by(3).collect();
    assert_same_ids(&json, texts.iter().map(String::as_str));
}

#[test]
fn gpt2_pattern_in_split_matches_tokenizers() {
    let Some(f) = fixture() else { return };
    let gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
    let json = with_pre_tokenizer(
        &f.gpt2,
        json!({"type": "Sequence", "pretokenizers": [split(gpt2), byte_level(true, false)]}),
    );
    assert_same_ids(&json, adversarial_strings().iter().map(String::as_str));
}

#[test]
fn starcoder_digits_then_byte_level_matches_tokenizers() {
    let Some(f) = fixture() else { return };
    for individual_digits in [true, false] {
        let json = with_pre_tokenizer(
            &f.gpt2,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": individual_digits},
                byte_level(false, true),
            ]}),
        );
        let texts: Vec<String> = corpus_and_adversarial(f).step_by(5).collect();
        assert_same_ids(&json, texts.iter().map(String::as_str));
    }
}

#[test]
fn added_token_flags_match_tokenizers() {
    let Some(f) = fixture() else { return };
    let mut json = f.gpt2.clone();
    let token = |content: &str, single_word: bool, lstrip: bool, rstrip: bool, normalized: bool| {
        json!({"id": 0, "content": content, "single_word": single_word, "lstrip": lstrip,
               "rstrip": rstrip, "normalized": normalized, "special": !normalized})
    };
    let added = json["added_tokens"].as_array_mut().unwrap();
    added.extend([
        token("<mask>", false, true, true, false),
        token("[LEFT]", false, true, false, false),
        token("[RIGHT]", false, false, true, false),
        token("word", true, false, false, true),
        token("wordy", false, false, false, true),
        token("<|end", false, false, false, true),
        token(" return", false, false, false, false),
        token("é", true, false, false, false),
        // Whitespace that a previous rstrip may already have taken.
        token("\n\n", false, true, false, false),
        // Repeated content: the last entry's flags apply.
        token("[LEFT]", false, false, false, false),
    ]);
    let texts = [
        "a <mask>  b",
        "a <mask>\n\n",
        "a\n\n\nb\n\n",
        "a\t\n<mask>\n\nb <mask><mask> c",
        "x   [LEFT]   y [RIGHT]   z",
        "word words sword word. wordy (word) wordword",
        "<|end <|endoftext|> <|endof",
        "def f():\n    return 1\n return",
        "é café é é1 _é",
        "",
        "<mask>",
    ];
    let mut all: Vec<&str> = texts.to_vec();
    let adversarial = adversarial_strings();
    all.extend(adversarial.iter().map(String::as_str));
    assert_same_ids(&json, all);
}

#[test]
fn legacy_merges_format_matches_tokenizers() {
    let Some(f) = fixture() else { return };
    let mut json = f.gpt2.clone();
    let lines: Vec<Value> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pair| {
            json!(format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            ))
        })
        .collect();
    json["model"]["merges"] = Value::Array(lines);
    let texts: Vec<String> = corpus_and_adversarial(f).step_by(10).collect();
    assert_same_ids(&json, texts.iter().map(String::as_str));
}

#[test]
fn bytes_missing_from_the_vocabulary_are_dropped_like_tokenizers() {
    let Some(f) = fixture() else { return };
    let mut json = f.gpt2.clone();
    // Byte 0x01 is the char U+0101 in the byte-level alphabet.
    let missing = "\u{101}";
    json["model"]["vocab"]
        .as_object_mut()
        .unwrap()
        .remove(missing);
    let merges = json["model"]["merges"].as_array_mut().unwrap();
    merges.retain(|pair| pair[0] != missing && pair[1] != missing);
    assert_same_ids(&json, ["a\u{1}b", "\u{1}\u{1} x\u{1}", "plain"]);
}

/// Documents are encoded whole, as `tokenizers` does with truncation and padding turned off.
#[test]
fn truncation_and_padding_are_ignored() {
    let Some(f) = fixture() else { return };
    let mut json = f.gpt2.clone();
    json["truncation"] =
        json!({"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0});
    json["padding"] = json!({"strategy": {"Fixed": 512}, "direction": "Right",
        "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
    let json = json.to_string();
    let mut reference = Tokenizer::from_str(&json).unwrap();
    reference.with_truncation(None).unwrap();
    reference.with_padding(None);
    let pair = Pair {
        reference,
        ours: ByteLevelBpe::from_json_str(&json).unwrap(),
    };
    pair.assert_same_ids(
        f.corpus
            .iter()
            .take(5)
            .map(String::as_str)
            .chain(["", "short"]),
    );
}

#[test]
fn token_to_id_and_vocab_size_match_tokenizers() {
    let Some(f) = fixture() else { return };
    let json = f.gpt2.to_string();
    let reference = Tokenizer::from_str(&json).unwrap();
    let ours = ByteLevelBpe::from_json_str(&json).unwrap();
    assert_eq!(ours.vocab_size(), reference.get_vocab_size(true));
    for (token, id) in reference.get_vocab(true) {
        assert_eq!(ours.token_to_id(&token), Some(id), "{token:?}");
    }
    assert_eq!(ours.token_to_id("not a token at all"), None);
}

#[test]
fn file_and_string_loading_agree() {
    let Some(f) = fixture() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, f.gpt2.to_string()).unwrap();
    let from_file = ByteLevelBpe::from_file(&path).unwrap();
    let from_str = ByteLevelBpe::from_json_str(&f.gpt2.to_string()).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    from_file.encode(&f.corpus[0], &mut a);
    from_str.encode(&f.corpus[0], &mut b);
    assert_eq!(a, b);
    assert!(matches!(
        ByteLevelBpe::from_file(dir.path().join("missing.json")),
        Err(BpeError::Read { .. })
    ));
}

#[test]
fn threads_and_interleaved_instances_give_the_same_ids() {
    fn shareable<T: Send + Sync>() {}
    shareable::<ByteLevelBpe>();
    let Some(f) = fixture() else { return };
    let gpt2 = ByteLevelBpe::from_json_str(&f.gpt2.to_string()).unwrap();
    let llama3 =
        ByteLevelBpe::from_json_str(&llama3_layout(&f.gpt2, LLAMA3_PATTERN).to_string()).unwrap();
    let encode = |bpe: &ByteLevelBpe, text: &str| {
        let mut ids = Vec::new();
        bpe.encode(text, &mut ids);
        ids
    };
    let texts = &f.corpus[..8];
    let alone: Vec<Vec<u32>> = texts.iter().map(|t| encode(&gpt2, t)).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    texts
                        .iter()
                        .map(|t| {
                            // Another instance on the same thread must not see this one's cache.
                            encode(&llama3, t);
                            encode(&gpt2, t)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for worker in workers {
            assert_eq!(worker.join().unwrap(), alone);
        }
    });
}

#[test]
fn unsupported_configurations_are_reported() {
    let Some(f) = fixture() else { return };
    let mut cases: Vec<Value> = Vec::new();
    let mut with = |edit: &dyn Fn(&mut Value)| {
        let mut json = f.gpt2.clone();
        edit(&mut json);
        cases.push(json);
    };
    with(&|j| j["normalizer"] = json!({"type": "NFC"}));
    with(
        &|j| j["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}),
    );
    with(&|j| j["pre_tokenizer"] = Value::Null);
    with(&|j| {
        j["pre_tokenizer"] =
            json!({"type": "Sequence", "pretokenizers": [split(r"\s+"), byte_level(false, false)]})
    });
    with(&|j| {
        j["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Removed", "invert": false},
            byte_level(false, false)]})
    });
    with(
        &|j| j["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [byte_level(false, false), split(LLAMA3_PATTERN)]}),
    );
    with(&|j| j["model"]["dropout"] = json!(0.1));
    with(&|j| j["model"]["continuing_subword_prefix"] = json!("##"));
    with(&|j| j["model"] = json!({"type": "WordLevel", "vocab": {}, "unk_token": "<unk>"}));
    for json in cases {
        let result = ByteLevelBpe::from_json_str(&json.to_string());
        assert!(
            matches!(result, Err(BpeError::Unsupported(_))),
            "accepted {}",
            json["pre_tokenizer"]
        );
    }
}

fn tricky_text() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(PIECES), 0..40).prop_map(|p| p.concat())
}

/// The layouts the property test compares, loaded once.
fn property_pairs() -> Option<&'static [Pair]> {
    static PAIRS: OnceLock<Option<Vec<Pair>>> = OnceLock::new();
    PAIRS
        .get_or_init(|| {
            let f = fixture()?;
            let digits = json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(false, true)]});
            let mut pairs = Vec::new();
            for vocab in [&f.gpt2, &f.crossing] {
                pairs.extend([
                    Pair::new(&with_pre_tokenizer(vocab, byte_level(false, true))),
                    Pair::new(&llama3_layout(vocab, LLAMA3_PATTERN)),
                    Pair::new(&llama3_layout(vocab, QWEN2_PATTERN)),
                    Pair::new(&with_pre_tokenizer(vocab, byte_level(true, true))),
                    Pair::new(&with_pre_tokenizer(vocab, digits.clone())),
                ]);
            }
            Some(pairs)
        })
        .as_deref()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_strings_match_tokenizers(text in tricky_text(), any_text in "\\PC{0,30}") {
        let Some(pairs) = property_pairs() else { return Ok(()) };
        for pair in pairs {
            pair.assert_same_ids([text.as_str(), any_text.as_str()]);
        }
    }
}

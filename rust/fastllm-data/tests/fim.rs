mod text_fixtures;

use fastllm_data::{DataError, Fim, FimConfig, FimSplit, TextCodec};
use proptest::prelude::*;

const PREFIX: i64 = 1000;
const MIDDLE: i64 = 1001;
const SUFFIX: i64 = 1002;
const PAD: i64 = 1003;
const EOS: i64 = 999;

fn config(split: FimSplit, rate: f64, spm_rate: f64) -> FimConfig {
    FimConfig {
        rate,
        spm_rate,
        max_middle_len: None,
        split,
        prefix: PREFIX as u32,
        middle: MIDDLE as u32,
        suffix: SUFFIX as u32,
        pad: PAD as u32,
        eos: EOS as u32,
    }
}

fn token_fim(rate: f64, spm_rate: f64) -> Fim {
    Fim::new(config(FimSplit::Token, rate, spm_rate), None).unwrap()
}

/// One token per UTF-8 byte.
struct ByteCodec;

impl TextCodec for ByteCodec {
    fn decode(&self, tokens: &[u32]) -> Result<String, String> {
        let bytes = tokens
            .iter()
            .map(|&t| u8::try_from(t).map_err(|_| format!("{t} is not a byte")))
            .collect::<Result<Vec<u8>, _>>()?;
        Ok(String::from_utf8(bytes).expect("FIM splits text only between characters"))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(u32::from).collect())
    }
}

/// Token 1 is "a" and token 2 is "aa"; encoding is greedy, so text written with token 1 alone
/// comes back in about half as many tokens.
struct PairCodec;

impl TextCodec for PairCodec {
    fn decode(&self, tokens: &[u32]) -> Result<String, String> {
        Ok(tokens.iter().map(|&t| "a".repeat(t as usize)).collect())
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let n = text.len();
        let mut tokens = vec![2; n / 2];
        tokens.extend(std::iter::repeat_n(1, n % 2));
        Ok(tokens)
    }
}

#[derive(Debug, Default, PartialEq)]
struct Forms {
    plain: usize,
    psm: usize,
    spm: usize,
}

/// Splits a sample into segments as FIM does: after each EOS and where the document id changes.
fn segments<'a>(tokens: &'a [i64], ids: &'a [i32]) -> Vec<(&'a [i64], i32)> {
    let mut segments = Vec::new();
    let mut start = 0;
    while start < tokens.len() {
        let id = ids[start];
        let mut end = start;
        while end < tokens.len() && ids[end] == id {
            end += 1;
            if tokens[end - 1] == EOS {
                break;
            }
        }
        segments.push((&tokens[start..end], id));
        start = end;
    }
    segments
}

/// A segment without its final EOS, if any, and that EOS.
fn split_eos(segment: &[i64]) -> (&[i64], Option<i64>) {
    match segment.split_last() {
        Some((&EOS, content)) => (content, Some(EOS)),
        _ => (segment, None),
    }
}

/// The parts of a FIM segment, in original order.
struct Parts<'a> {
    spm: bool,
    prefix: &'a [i64],
    middle: &'a [i64],
    suffix: &'a [i64],
}

/// The parts of one FIM segment (without its EOS), or `None` for a plain one. In SPM the prefix
/// and middle are adjacent, so they come back joined, as the prefix. (PSM with an empty prefix
/// is token for token SPM with an empty prefix; it parses as SPM.)
fn parts(content: &[i64]) -> Option<Parts<'_>> {
    if content.first() != Some(&PREFIX) {
        return None;
    }
    let position = |token, from| from + content[from..].iter().position(|&t| t == token).unwrap();
    Some(if content.get(1) == Some(&SUFFIX) {
        let m = position(MIDDLE, 2);
        Parts {
            spm: true,
            prefix: &content[m + 1..],
            middle: &[],
            suffix: &content[2..m],
        }
    } else {
        let s = position(SUFFIX, 1);
        let m = position(MIDDLE, s + 1);
        Parts {
            spm: false,
            prefix: &content[1..s],
            middle: &content[m + 1..],
            suffix: &content[s + 1..m],
        }
    })
}

/// Undoes FIM: drops the sentinels and puts every segment's parts back in order.
fn restore(tokens: &[i64], ids: &[i32]) -> (Vec<i64>, Vec<i32>, Forms) {
    let (mut out_tokens, mut out_ids, mut forms) = (Vec::new(), Vec::new(), Forms::default());
    for (segment, id) in segments(tokens, ids) {
        let (content, eos) = split_eos(segment);
        match parts(content) {
            None => {
                forms.plain += usize::from(!content.is_empty());
                out_tokens.extend_from_slice(content);
            }
            Some(parts) => {
                *(if parts.spm {
                    &mut forms.spm
                } else {
                    &mut forms.psm
                }) += 1;
                out_tokens.extend_from_slice(parts.prefix);
                out_tokens.extend_from_slice(parts.middle);
                out_tokens.extend_from_slice(parts.suffix);
            }
        }
        out_tokens.extend(eos);
        out_ids.resize(out_tokens.len(), id);
    }
    (out_tokens, out_ids, forms)
}

/// Applies FIM with room for every sentinel (three per segment), so nothing is cut, and
/// returns the real tokens and their document ids.
fn apply_uncut(
    fim: &Fim,
    seed: u64,
    sample: u64,
    tokens: &[i64],
    ids: &[i32],
) -> (Vec<i64>, Vec<i32>) {
    let room = tokens.len() + 3 * segments(tokens, ids).len();
    let (mut out_tokens, mut out_ids) = (tokens.to_vec(), ids.to_vec());
    out_tokens.resize(room, PAD);
    out_ids.resize(room, -1);
    let real = fim
        .apply(seed, sample, &mut out_tokens, &mut out_ids, tokens.len())
        .unwrap();
    out_tokens.truncate(real);
    out_ids.truncate(real);
    (out_tokens, out_ids)
}

/// Documents of `lengths` tokens, each ending with EOS, as one sample with all document ids 0.
fn sample_of_documents(lengths: &[usize]) -> (Vec<i64>, Vec<i32>) {
    let mut tokens = Vec::new();
    for (d, &length) in lengths.iter().enumerate() {
        tokens.extend((0..length).map(|t| ((d * 31 + t * 7) % 500) as i64));
        tokens.push(EOS);
    }
    let ids = vec![0; tokens.len()];
    (tokens, ids)
}

proptest! {
    #[test]
    fn removing_sentinels_and_reordering_gives_back_every_document(
        pieces in prop::collection::vec(prop::collection::vec(prop_oneof![0i64..50, Just(EOS)], 0..40), 1..5),
        rate in 0.0f64..=1.0,
        spm_rate in 0.0f64..=1.0,
        max_middle_len in prop::option::of(0usize..10),
        seed in any::<u64>(),
        sample in any::<u64>(),
    ) {
        let tokens: Vec<i64> = pieces.concat();
        let ids: Vec<i32> = pieces.iter().enumerate().flat_map(|(id, p)| std::iter::repeat_n(id as i32, p.len())).collect();
        let fim = Fim::new(FimConfig { max_middle_len, ..config(FimSplit::Token, rate, spm_rate) }, None).unwrap();
        let (out_tokens, out_ids) = apply_uncut(&fim, seed, sample, &tokens, &ids);
        let (restored, restored_ids, forms) = restore(&out_tokens, &out_ids);
        prop_assert_eq!(&restored, &tokens);
        prop_assert_eq!(&restored_ids, &ids);
        prop_assert_eq!(out_tokens.len(), tokens.len() + 3 * (forms.psm + forms.spm));
        if let Some(limit) = max_middle_len {
            for (segment, _) in segments(&out_tokens, &out_ids) {
                if let Some(Parts { spm: false, middle, .. }) = parts(split_eos(segment).0) {
                    prop_assert!(middle.len() <= limit);
                }
            }
        }
    }
}

#[test]
fn character_split_with_a_byte_codec_restores_text_and_splits_only_between_characters() {
    let documents = [
        "fn main() { println!(\"héllo, wörld\"); }",
        "日本語のテキスト 🎉🎉 and ascii",
        "x",
        "",
        "naïve café — déjà vu",
    ];
    let mut tokens = Vec::new();
    for document in documents {
        tokens.extend(document.bytes().map(i64::from));
        tokens.push(EOS);
    }
    let ids = vec![0; tokens.len()];
    for (spm_rate, max_middle_len) in [(0.5, None), (0.0, Some(3))] {
        let fim = Fim::new(
            FimConfig {
                max_middle_len,
                ..config(FimSplit::Character, 1.0, spm_rate)
            },
            Some(Box::new(ByteCodec)),
        )
        .unwrap();
        for sample in 0..200 {
            // ByteCodec's decode panics on any part that is not whole characters.
            let (out_tokens, out_ids) = apply_uncut(&fim, 1, sample, &tokens, &ids);
            let (restored, _, forms) = restore(&out_tokens, &out_ids);
            assert_eq!(restored, tokens);
            assert_eq!(
                forms.psm + forms.spm,
                4,
                "every non-empty document is transformed"
            );
            if let Some(limit) = max_middle_len {
                for (segment, _) in segments(&out_tokens, &out_ids) {
                    if let Some(Parts { middle, .. }) = parts(split_eos(segment).0) {
                        let ids: Vec<u32> = middle.iter().map(|&t| t as u32).collect();
                        assert!(ByteCodec.decode(&ids).unwrap().chars().count() <= limit);
                    }
                }
            }
        }
    }
}

mod hf {
    use super::*;
    use text_fixtures::train_byte_level_bpe;
    use tokenizers::Tokenizer;

    struct HfCodec(Tokenizer);

    impl TextCodec for HfCodec {
        fn decode(&self, tokens: &[u32]) -> Result<String, String> {
            self.0.decode(tokens, false).map_err(|e| e.to_string())
        }

        fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
            let encoding = self.0.encode(text, false).map_err(|e| e.to_string())?;
            Ok(encoding.get_ids().to_vec())
        }
    }

    const CORPUS: [&str; 4] = [
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        "for (int i = 0; i < n; i++) { total += values[i]; }\n",
        "Ünïcödé text: naïve café, 日本語, emoji 🎉 and more text for merges.\n",
        "import numpy as np\nx = np.arange(10)\nprint(x.sum())\n",
    ];

    /// A GPT-2-style byte-level BPE trained on [`CORPUS`], with StarCoder's special tokens.
    fn tokenizer() -> Tokenizer {
        let specials = [
            "<|endoftext|>",
            "<fim_prefix>",
            "<fim_middle>",
            "<fim_suffix>",
            "<fim_pad>",
        ];
        let texts: Vec<String> = (0..20).flat_map(|_| CORPUS.map(String::from)).collect();
        train_byte_level_bpe(&texts, &specials, 0, false)
    }

    #[test]
    fn character_split_with_a_real_tokenizer_restores_the_text() {
        let tokenizer = tokenizer();
        let id = |token: &str| tokenizer.token_to_id(token).unwrap();
        let fim_config = FimConfig {
            prefix: id("<fim_prefix>"),
            middle: id("<fim_middle>"),
            suffix: id("<fim_suffix>"),
            pad: id("<fim_pad>"),
            eos: id("<|endoftext|>"),
            ..config(FimSplit::Character, 1.0, 0.5)
        };
        let codec = HfCodec(tokenizer.clone());
        let mut tokens = Vec::new();
        for document in CORPUS {
            tokens.extend(codec.encode(document).unwrap().into_iter().map(i64::from));
            tokens.push(fim_config.eos.into());
        }
        let fim = Fim::new(fim_config, Some(Box::new(HfCodec(tokenizer)))).unwrap();
        let [prefix, middle, suffix, eos] = [
            fim_config.prefix,
            fim_config.middle,
            fim_config.suffix,
            fim_config.eos,
        ]
        .map(i64::from);
        let decode = |tokens: &[i64]| {
            let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
            codec.decode(&ids).unwrap()
        };
        let mut forms = [0; 2];
        for sample in 0..100 {
            let mut out = tokens.clone();
            out.resize(tokens.len() * 2, 0);
            let mut ids = vec![0; out.len()];
            let real = fim
                .apply(7, sample, &mut out, &mut ids, tokens.len())
                .unwrap();
            let documents: Vec<&[i64]> = out[..real].split(|&t| t == eos).collect();
            assert_eq!(documents.len(), CORPUS.len() + 1);
            assert!(
                documents[CORPUS.len()].is_empty(),
                "the last EOS stays last"
            );
            for (document, original) in documents.iter().zip(CORPUS) {
                let at = |token| document.iter().position(|&t| t == token).unwrap();
                assert_eq!(document[0], prefix);
                let (s, m) = (at(suffix), at(middle));
                let text = if s == 1 {
                    forms[1] += 1;
                    decode(&document[m + 1..]) + &decode(&document[2..m])
                } else {
                    forms[0] += 1;
                    decode(&document[1..s])
                        + &decode(&document[m + 1..])
                        + &decode(&document[s + 1..m])
                };
                assert_eq!(text, original);
            }
        }
        assert!(
            forms.iter().all(|&n| n > 100),
            "both forms occur: {forms:?}"
        );
    }
}

#[test]
fn rate_zero_is_the_identity() {
    let (tokens, ids) = sample_of_documents(&[10, 0, 25, 3]);
    for split in [FimSplit::Token, FimSplit::Character] {
        let fim = Fim::new(config(split, 0.0, 0.5), Some(Box::new(ByteCodec))).unwrap();
        for sample in 0..20 {
            let (mut out, mut out_ids) = (tokens.clone(), ids.clone());
            let real = fim
                .apply(3, sample, &mut out, &mut out_ids, tokens.len())
                .unwrap();
            assert_eq!((real, &out, &out_ids), (tokens.len(), &tokens, &ids));
        }
    }
}

#[test]
fn rate_one_transforms_every_document_and_keeps_eos_at_their_ends() {
    let (tokens, ids) = sample_of_documents(&[10, 0, 25, 1, 7]);
    let fim = token_fim(1.0, 0.5);
    for sample in 0..50 {
        let (out, out_ids) = apply_uncut(&fim, 0, sample, &tokens, &ids);
        let documents: Vec<&[i64]> = out.split(|&t| t == EOS).collect();
        assert_eq!(documents.len(), 6);
        assert!(documents[1].is_empty() && documents[5].is_empty());
        for document in [0, 2, 3, 4] {
            assert_eq!(documents[document][0], PREFIX);
        }
        assert_eq!(restore(&out, &out_ids).0, tokens);
    }
}

#[test]
fn document_pieces_are_transformed_separately_even_without_eos() {
    let tokens: Vec<i64> = (0..30).collect();
    let ids: Vec<i32> = (0..30).map(|t| t / 10).collect();
    let fim = token_fim(1.0, 0.0);
    let (out, out_ids) = apply_uncut(&fim, 0, 0, &tokens, &ids);
    let piece_starts: Vec<usize> = (0..out.len())
        .filter(|&i| i == 0 || out_ids[i] != out_ids[i - 1])
        .collect();
    assert_eq!(piece_starts, [0, 13, 26]);
    assert!(piece_starts.iter().all(|&i| out[i] == PREFIX));
    assert_eq!(
        restore(&out, &out_ids),
        (
            tokens,
            ids,
            Forms {
                plain: 0,
                psm: 3,
                spm: 0
            }
        )
    );
}

#[test]
fn psm_and_spm_occur_in_the_configured_proportions() {
    // 1000 samples of 10 documents of 500 tokens. PSM with an empty prefix (about 0.4% of PSM
    // here) reads as SPM, a bias far inside the tolerance.
    let (tokens, ids) = sample_of_documents(&[500; 10]);
    let fim = token_fim(0.4, 0.3);
    let mut forms = Forms::default();
    for sample in 0..1000 {
        let (out, out_ids) = apply_uncut(&fim, 11, sample, &tokens, &ids);
        let (_, _, sample_forms) = restore(&out, &out_ids);
        forms.plain += sample_forms.plain;
        forms.psm += sample_forms.psm;
        forms.spm += sample_forms.spm;
    }
    let transformed = (forms.psm + forms.spm) as f64;
    // Standard deviations: 0.005 for the rate, 0.007 for the SPM share.
    let rate = transformed / 10_000.0;
    let spm_share = forms.spm as f64 / transformed;
    assert!((rate - 0.4).abs() < 0.02, "{forms:?}");
    assert!((spm_share - 0.3).abs() < 0.03, "{forms:?}");
}

#[test]
fn the_transform_depends_only_on_seed_and_sample() {
    let (tokens, ids) = sample_of_documents(&[40, 40, 40]);
    let fim = token_fim(0.5, 0.5);
    let run = |seed, sample| apply_uncut(&fim, seed, sample, &tokens, &ids).0;
    assert_eq!(run(1, 5), run(1, 5));
    let other_samples = (0..20).filter(|&s| run(1, s) != run(1, 5)).count();
    let other_seeds = (0..20).filter(|&seed| run(seed, 5) != run(1, 5)).count();
    assert!(
        other_samples >= 15 && other_seeds >= 15,
        "{other_samples} {other_seeds}"
    );
}

#[test]
fn a_longer_result_is_cut_at_the_end() {
    let (tokens, ids) = sample_of_documents(&[20, 30, 10]);
    let fim = token_fim(1.0, 0.5);
    for sample in 0..20 {
        let (uncut, _) = apply_uncut(&fim, 2, sample, &tokens, &ids);
        let (mut out, mut out_ids) = (tokens.clone(), ids.clone());
        let real = fim
            .apply(2, sample, &mut out, &mut out_ids, tokens.len())
            .unwrap();
        assert_eq!(real, tokens.len());
        assert_eq!(out, uncut[..tokens.len()]);
    }
}

#[test]
fn a_shorter_result_reports_its_padding() {
    // Every document is written with token 1 ("a") only; re-encoded parts use token 2 ("aa").
    let mut tokens = vec![1i64; 40];
    tokens.push(EOS);
    tokens.extend([1; 30]);
    let real = tokens.len();
    tokens.resize(real + 10, PAD);
    let mut ids = vec![0; tokens.len()];
    let fim = Fim::new(
        config(FimSplit::Character, 1.0, 0.5),
        Some(Box::new(PairCodec)),
    )
    .unwrap();
    let (mut out, mut out_ids) = (tokens.clone(), ids.clone());
    let kept = fim.apply(0, 0, &mut out, &mut out_ids, real).unwrap();
    assert!(kept < real - 20, "kept {kept} of {real}");
    assert_eq!(out.len(), tokens.len());
    let text = |tokens: &[i64]| -> usize {
        tokens
            .iter()
            .filter(|&&t| t == 1 || t == 2)
            .map(|&t| t as usize)
            .sum()
    };
    assert_eq!(text(&out[..kept]), 70, "no text is lost");
    assert_eq!(out[..kept].iter().filter(|&&t| t == EOS).count(), 1);
    ids.truncate(kept);
    assert_eq!(out_ids[..kept], ids[..]);
}

#[test]
fn invalid_settings_and_tokens_are_errors() {
    for (rate, spm_rate, name) in [
        (1.5, 0.5, "rate"),
        (-0.1, 0.5, "rate"),
        (0.5, f64::NAN, "spm_rate"),
    ] {
        let error = Fim::new(config(FimSplit::Token, rate, spm_rate), None)
            .err()
            .unwrap();
        assert!(
            matches!(error, DataError::BadFimRate { name: n, .. } if n == name),
            "{error}"
        );
    }
    assert!(matches!(
        Fim::new(config(FimSplit::Character, 0.5, 0.5), None),
        Err(DataError::FimNeedsCodec)
    ));
    let fim = Fim::new(
        config(FimSplit::Character, 1.0, 0.5),
        Some(Box::new(ByteCodec)),
    )
    .unwrap();
    let (mut tokens, mut ids) = (vec![65, -1, 66], vec![0; 3]);
    assert!(matches!(
        fim.apply(0, 0, &mut tokens, &mut ids, 3),
        Err(DataError::BadTokenId { token: -1 })
    ));
    // Tokens the codec does not know (a dataset made with another tokenizer): an error, not a
    // panic.
    let (mut tokens, mut ids) = (vec![65, 300, 66], vec![0; 3]);
    let error = fim.apply(0, 0, &mut tokens, &mut ids, 3).unwrap_err();
    assert_eq!(error.to_string(), "character-level FIM: 300 is not a byte");
}

#[test]
fn fill_transforms_each_sample_as_apply_does_then_pads_and_trains_the_rest() {
    // Two samples of 120 positions: three documents, then one that leaves padding.
    let fim = Fim::new(
        config(FimSplit::Character, 1.0, 0.5),
        Some(Box::new(PairCodec)),
    )
    .unwrap();
    let length = 120;
    let (mut first, mut first_ids) = sample_of_documents(&[30, 40, 45]);
    first.resize(length, 0);
    first_ids.resize(length, 1);
    let mut second = vec![1i64; 60];
    second.resize(length, 0);
    let mut second_ids = vec![0; 60];
    second_ids.resize(length, 1);
    let real = [length - 2, 60];
    let mut tokens = [first.clone(), second.clone()].concat();
    let mut ids = [first_ids.clone(), second_ids.clone()].concat();
    let mut mask = vec![0u8; 2 * length];
    fim.fill(3, 10, &mut tokens, &mut ids, &mut mask, &real)
        .unwrap();
    for (k, (mut alone, mut alone_ids)) in [(first, first_ids), (second, second_ids)]
        .into_iter()
        .enumerate()
    {
        let kept = fim
            .apply(3, 10 + k as u64, &mut alone, &mut alone_ids, real[k])
            .unwrap();
        // Re-encoded shorter ("aa" for "a a"), the second sample gets more padding.
        assert!(k == 0 || kept < real[k], "{kept}");
        let sample = k * length..(k + 1) * length;
        assert_eq!(tokens[sample.start..sample.start + kept], alone[..kept]);
        assert_eq!(ids[sample.start..sample.start + kept], alone_ids[..kept]);
        assert!(mask[sample.start..sample.start + kept]
            .iter()
            .all(|&m| m == 1));
        let padding = sample.start + kept..sample.end;
        assert!(tokens[padding.clone()].iter().all(|&t| t == PAD));
        assert!(ids[padding.clone()]
            .iter()
            .all(|&id| id == alone_ids[kept - 1] + 1));
        assert!(mask[padding].iter().all(|&m| m == 0));
    }
    let error = fim
        .fill(3, 0, &mut tokens, &mut ids, &mut mask, &[length + 1, 0])
        .unwrap_err();
    assert!(matches!(error, DataError::BadFimBuffers { .. }), "{error}");
}

//! Loss-masking spans end to end: `prepare` of text with Fast-LLM's character spans and of
//! conversations, the `.spans` sidecar (checked on open), and the loss mask of sampling.

mod text_fixtures;

use std::fs;
use std::path::Path;

use fastllm_data::{
    prepare, Cancel, ChatTemplate, DataError, IndexedDataset, Progress, SampleSource,
    SampleSourceConfig, SamplingMode, TrainOn,
};
use text_fixtures::{options, read_metadata, write_tokenizer};

fn encode(tokenizer: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    tokenizer.encode(text, false).unwrap().get_ids().to_vec()
}

#[test]
fn character_spans_mask_the_tokens_of_their_text_through_sampling() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer_path = write_tokenizer(&dir.path().join("tokenizer"), false);
    let texts = [
        ("The quick brown fox jumps", vec![[4, 8]]),
        ("Ünïcödé façade — naïve café", vec![[0, 6], [21, 26]]),
        ("no spans", vec![]),
    ];
    let input = dir.path().join("spans.jsonl");
    let lines: String = texts
        .iter()
        .map(|(text, spans)| serde_json::json!({"text": text, "mask": spans}).to_string() + "\n")
        .collect();
    fs::write(&input, lines).unwrap();
    let output = dir.path().join("out");
    let mut options = options(&[&input], &tokenizer_path, &output);
    options.input.loss_masking_spans = Some("mask".to_owned());
    prepare(&options, &Progress::new()).unwrap();

    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path).unwrap();
    let eos = tokenizer.token_to_id("<|endoftext|>").unwrap() as i64;
    let dataset = IndexedDataset::open(output.join("shard_00000")).unwrap();
    let spans = dataset.loss_spans().expect("a sidecar");
    let mut trained = 0;
    for (document, (text, character_spans)) in texts.iter().enumerate() {
        // Fast-LLM's tokenization: each part apart, spans with both ends included.
        let characters: Vec<char> = text.chars().collect();
        let (mut ids, mut expected, mut position) = (Vec::new(), Vec::new(), 0);
        for &[begin, end] in character_spans {
            let before: String = characters[position..begin].iter().collect();
            ids.extend(encode(&tokenizer, &before));
            let span: String = characters[begin..=end].iter().collect();
            let start = ids.len() as u32;
            ids.extend(encode(&tokenizer, &span));
            expected.push([start, ids.len() as u32]);
            position = end + 1;
        }
        let rest: String = characters[position..].iter().collect();
        ids.extend(encode(&tokenizer, &rest));
        let mut ids: Vec<i64> = ids.into_iter().map(i64::from).collect();
        ids.push(eos);
        assert_eq!(dataset.document(document).unwrap().to_vec(), ids);
        assert_eq!(spans.document(document), &expected[..]);
        trained += spans.trained_tokens(document, ids.len() as u32) as u64;
    }
    let metadata = read_metadata(&output);
    assert_eq!(metadata["trained_tokens"], trained);
    assert_eq!(metadata["loss_masking_spans"], true);

    // Truncated sampling: one document per sample; the mask is 0 on spans and padding.
    let config = SampleSourceConfig {
        sequence_length: 40,
        num_samples: 3,
        seed: 5,
        mode: SamplingMode::Truncated,
        weights: None,
        cache_dir: dir.path().join("cache"),
        threads: 1,
        vocab_size: None,
    };
    let source = SampleSource::new(vec![dataset], config, None, &Cancel::default()).unwrap();
    let length = source.sample_length();
    let (mut tokens, mut ids, mut mask) = (
        vec![0; 3 * length],
        vec![0; 3 * length],
        vec![0; 3 * length],
    );
    source
        .fill(0, &mut tokens, &mut ids, &mut mask, None)
        .unwrap();
    let dataset = IndexedDataset::open(output.join("shard_00000")).unwrap();
    let spans = dataset.loss_spans().unwrap();
    for sample in 0..3 {
        let sample_tokens = &tokens[sample * length..(sample + 1) * length];
        let document = (0..3)
            .find(|&d| sample_tokens.starts_with(&dataset.document(d).unwrap().to_vec()))
            .unwrap();
        let real = dataset.document(document).unwrap().len();
        let mut expected = vec![0u8; length];
        expected[..real].fill(1);
        for &[begin, end] in spans.document(document) {
            expected[begin as usize..end as usize].fill(0);
        }
        assert_eq!(&mask[sample * length..(sample + 1) * length], &expected[..]);
    }
}

#[test]
fn a_truncated_or_foreign_sidecar_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let mut prepared = Vec::new();
    for (name, texts) in [
        ("a", vec!["one two", "three"]),
        ("b", vec!["four", "five six"]),
    ] {
        let input = dir.path().join(format!("{name}.jsonl"));
        let lines: String = texts
            .iter()
            .map(|text| serde_json::json!({"text": text, "mask": [[0, 1]]}).to_string() + "\n")
            .collect();
        fs::write(&input, lines).unwrap();
        let output = dir.path().join(name);
        let mut options = options(&[&input], &tokenizer, &output);
        options.input.loss_masking_spans = Some("mask".to_owned());
        prepare(&options, &Progress::new()).unwrap();
        prepared.push(output.join("shard_00000"));
    }
    let sidecar = |prefix: &Path| prefix.with_extension("spans");
    let bytes = fs::read(sidecar(&prepared[0])).unwrap();
    fs::write(sidecar(&prepared[0]), &bytes[..bytes.len() - 3]).unwrap();
    let error = IndexedDataset::open(&prepared[0]).err().unwrap();
    assert!(matches!(error, DataError::BadLossSpans { .. }), "{error}");
    assert!(error
        .to_string()
        .starts_with(&format!("{}: file is", sidecar(&prepared[0]).display())));

    fs::copy(sidecar(&prepared[1]), sidecar(&prepared[0])).unwrap();
    let error = IndexedDataset::open(&prepared[0])
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains("but the index has 2 documents of"),
        "{error}"
    );
}

#[test]
fn generation_blocks_mark_their_rendered_text_whatever_the_whitespace_control() {
    let source = "{%- for m in messages %}\n  {%- if m.role == 'assistant' %}A:\n    {%- generation %}\n {{ m.content }}!\n    {%- endgeneration %}\n{% else %}U: {{ m.content }}\n{% endif %}{% endfor %}";
    let template = ChatTemplate::new(source, Default::default(), "inline".into()).unwrap();
    assert!(template.has_generation_blocks());
    let messages = serde_json::json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye", "name": null},
        {"role": "assistant", "content": "ciao"},
    ]);
    let rendered = template
        .render_for_training(&messages, TrainOn::Assistant)
        .unwrap();
    // What transformers 5.24's `render_jinja_template(..., return_assistant_tokens_mask=True)`
    // gives for this template: trim_blocks eats the newline after each tag, `{%-` the
    // whitespace before.
    assert_eq!(rendered.text, "U: hi\nA: hello!U: bye\nA: ciao!");
    let trained: Vec<&str> = rendered
        .trained
        .iter()
        .map(|r| &rendered.text[r.clone()])
        .collect();
    assert_eq!(trained, [" hello!", " ciao!"]);
    let last = template
        .render_for_training(&messages, TrainOn::LastAssistant)
        .unwrap();
    assert_eq!(last.trained.len(), 1);
    assert_eq!(&last.text[last.trained[0].clone()], " ciao!");
}

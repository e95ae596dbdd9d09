mod text_fixtures;

use std::fs;

use fastllm_data::{SpecialToken, Tokenizer, TokenizerError, TokenizerImplementation};
use text_fixtures::{reference_ids, sample_texts, write_tokenizer};

#[test]
fn encodes_like_the_tokenizers_crate_with_either_implementation() {
    let dir = tempfile::tempdir().unwrap();
    for normalize in [false, true] {
        let path = write_tokenizer(&dir.path().join(format!("{normalize}")), normalize);
        let tokenizer = Tokenizer::load(&path).unwrap();
        let expected = if normalize {
            TokenizerImplementation::Tokenizers
        } else {
            TokenizerImplementation::FastllmBpe
        };
        assert_eq!(
            tokenizer.implementation(),
            expected,
            "{:?}",
            tokenizer.fallback_reason()
        );
        assert_eq!(tokenizer.fallback_reason().is_some(), normalize);
        let mut texts = sample_texts();
        texts.push("unseen words: zyzzyva quixotic \u{1F980}\u{200D} e\u{301}".into());
        for text in texts {
            let mut ids = vec![7];
            tokenizer.encode(&text, &mut ids).unwrap();
            assert_eq!(ids[0], 7, "encode appends");
            assert_eq!(ids[1..], reference_ids(&path, &text), "{text:?}");
            if !normalize {
                assert_eq!(tokenizer.decode(&ids[1..]).unwrap(), text);
            }
        }
    }
}

#[test]
fn loads_a_directory_and_takes_special_tokens_from_its_config() {
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer(dir.path(), false);
    let tokenizer = Tokenizer::load(dir.path()).unwrap();
    assert_eq!(tokenizer.json_path(), dir.path().join("tokenizer.json"));
    let reference = tokenizers::Tokenizer::from_file(tokenizer.json_path()).unwrap();
    assert_eq!(tokenizer.vocab_size(), reference.get_vocab_size(true));
    let token = |text: &str| SpecialToken {
        text: text.into(),
        id: tokenizer.token_to_id(text).unwrap(),
    };
    // No config: the usual names.
    assert_eq!(
        tokenizer.eos_token(None).unwrap(),
        Some(token("<|endoftext|>"))
    );
    assert_eq!(tokenizer.bos_token(None).unwrap(), Some(token("<s>")));

    // A string, or an object with `content`, as transformers writes either.
    let config =
        r#"{"eos_token": {"content": "<|pad|>", "special": true}, "bos_token": "<|endoftext|>"}"#;
    fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
    let tokenizer = Tokenizer::load(dir.path()).unwrap();
    assert_eq!(tokenizer.eos_token(None).unwrap(), Some(token("<|pad|>")));
    assert_eq!(
        tokenizer.bos_token(None).unwrap(),
        Some(token("<|endoftext|>"))
    );
    assert_eq!(
        tokenizer.eos_token(Some("<s>")).unwrap(),
        Some(token("<s>"))
    );

    let error = tokenizer.eos_token(Some("</s>")).unwrap_err();
    assert!(matches!(error, TokenizerError::UnknownToken { .. }));
    assert!(
        error
            .to_string()
            .contains("\"</s>\" is not in the vocabulary"),
        "{error}"
    );
}

#[test]
fn a_missing_or_invalid_tokenizer_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let error = Tokenizer::load(dir.path()).err().unwrap();
    assert!(matches!(error, TokenizerError::Io { .. }));
    assert!(error.to_string().contains("tokenizer.json"), "{error}");

    let path = dir.path().join("tokenizer.json");
    fs::write(&path, "{\"model\": 3}").unwrap();
    let error = Tokenizer::load(&path).err().unwrap();
    assert!(matches!(error, TokenizerError::Invalid { .. }), "{error}");
    assert!(error.to_string().contains("tokenizer.json"), "{error}");
}

#[test]
fn sha256_is_that_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_tokenizer(dir.path(), false);
    let tokenizer = Tokenizer::load(&path).unwrap();
    assert_eq!(tokenizer.sha256().len(), 64);
    fs::write(&path, fs::read_to_string(&path).unwrap() + "\n").unwrap();
    assert_ne!(Tokenizer::load(&path).unwrap().sha256(), tokenizer.sha256());
}

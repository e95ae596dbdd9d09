mod text_fixtures;

use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use fastllm_data::{prepare, PrepareError, PrepareOptions, Progress, TokenizerError};
use text_fixtures::{
    entries, options, read_documents, read_metadata, reference_ids, sample_texts, write_jsonl,
    write_parquet, write_tokenizer,
};

/// One input file (or tree) per format, and the texts each holds, in order.
fn inputs_of_every_format(dir: &Path) -> (Vec<PathBuf>, Vec<String>) {
    let texts = sample_texts();
    let (jsonl, gz, zst, parquet, text, tree) = (
        dir.join("a.jsonl"),
        dir.join("b.jsonl.gz"),
        dir.join("c.json.zst"),
        dir.join("d.parquet"),
        dir.join("e.txt"),
        dir.join("tree"),
    );
    write_jsonl(&jsonl, &texts[..10]);
    write_jsonl(&gz, &texts[10..20]);
    write_jsonl(&zst, &texts[20..30]);
    let rows: Vec<Option<&str>> = texts[30..40].iter().map(|t| Some(t.as_str())).collect();
    write_parquet(&parquet, &rows, 3);
    fs::write(&text, &texts[40]).unwrap();
    fs::create_dir_all(tree.join("src")).unwrap();
    fs::write(tree.join("src/b.py"), &texts[41]).unwrap();
    fs::write(tree.join("a.rs"), &texts[42]).unwrap();
    fs::write(tree.join("blob.bin"), b"\x00\x01\x02").unwrap();
    let expected = [&texts[..41], &texts[42..43], &texts[41..42]].concat();
    (vec![jsonl, gz, zst, parquet, text, tree], expected)
}

fn paths(paths: &[PathBuf]) -> Vec<&Path> {
    paths.iter().map(PathBuf::as_path).collect()
}

/// About `bytes` of text as JSON lines in three files, so runs span several batches.
fn large_inputs(dir: &Path, bytes: usize) -> Vec<PathBuf> {
    let base = sample_texts();
    let texts: Vec<String> = (0..)
        .map(|i| format!("{} #{i}", base[i % base.len()]).repeat(1 + i % 5))
        .scan(0, |total, text| {
            *total += text.len();
            (*total <= bytes).then_some(text)
        })
        .collect();
    let third = texts.len() / 3;
    let files = vec![
        dir.join("x.jsonl"),
        dir.join("y.jsonl.zst"),
        dir.join("z.jsonl.gz"),
    ];
    for (file, texts) in files.iter().zip(texts.chunks(third + 1)) {
        write_jsonl(file, texts);
    }
    files
}

fn assert_no_output(output: &Path) {
    assert!(!output.exists());
    let leftovers: Vec<String> = entries(output.parent().unwrap())
        .into_iter()
        .filter(|name| name.contains(".partial-") || name.contains(".old-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn every_format_is_tokenized_in_input_order_like_the_tokenizers_crate_plus_eos() {
    let dir = tempfile::tempdir().unwrap();
    let (inputs, texts) = inputs_of_every_format(dir.path());
    for (normalize, implementation) in [(false, "fastllm-bpe"), (true, "tokenizers")] {
        let tokenizer = write_tokenizer(
            &dir.path().join(format!("tokenizer-{normalize}")),
            normalize,
        );
        let eos = tokenizers::Tokenizer::from_file(&tokenizer)
            .unwrap()
            .token_to_id("<|endoftext|>")
            .unwrap();
        let output = dir.path().join(format!("out-{normalize}"));
        let report = prepare(
            &options(&paths(&inputs), &tokenizer, &output),
            &Progress::new(),
        )
        .unwrap();

        let expected: Vec<Vec<u32>> = texts
            .iter()
            .map(|text| [reference_ids(&tokenizer, text), vec![eos]].concat())
            .collect();
        assert_eq!(read_documents(&output), expected);
        assert_eq!(report.documents, expected.len() as u64);
        assert_eq!(
            report.tokens,
            expected.iter().map(Vec::len).sum::<usize>() as u64
        );
        assert_eq!(report.tokenizer.implementation.to_string(), implementation);
        assert_eq!(report.skipped_files, 1);
        assert_eq!(
            entries(&output),
            [
                "metadata.json",
                "shard_00000.bin",
                "shard_00000.idx",
                "tokenizer.json"
            ]
        );
        let metadata = read_metadata(&output);
        assert_eq!(metadata, serde_json::to_value(&report).unwrap());
        assert_eq!(metadata["tokenizer"]["implementation"], implementation);
    }
}

#[test]
fn metadata_describes_the_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let (inputs, _) = inputs_of_every_format(dir.path());
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let output = dir.path().join("out");
    prepare(
        &options(&paths(&inputs), &tokenizer, &output),
        &Progress::new(),
    )
    .unwrap();
    let metadata = read_metadata(&output);
    let reference = tokenizers::Tokenizer::from_file(&tokenizer).unwrap();

    assert_eq!(metadata["documents"], 43);
    assert_eq!(metadata["vocab_size"], reference.get_vocab_size(true));
    assert_eq!(metadata["dtype"], "uint16");
    let eos = reference.token_to_id("<|endoftext|>").unwrap();
    assert_eq!(
        metadata["eos_token"],
        serde_json::json!({"text": "<|endoftext|>", "id": eos})
    );
    assert_eq!(metadata["bos_token"]["text"], "<s>");
    assert_eq!(
        (metadata["add_eos"].as_bool(), metadata["add_bos"].as_bool()),
        (Some(true), Some(false))
    );
    assert_eq!(
        metadata["tokenizer"]["path"],
        std::path::absolute(&tokenizer).unwrap().to_str().unwrap()
    );
    let sha256 = metadata["tokenizer"]["sha256"].as_str().unwrap();
    assert_eq!(
        sha256,
        fastllm_data::Tokenizer::load(&tokenizer).unwrap().sha256()
    );
    assert_eq!(
        metadata["tokenizer"]["fallback_reason"],
        serde_json::Value::Null
    );

    let formats: Vec<&str> = metadata["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|input| input["format"].as_str().unwrap())
        .collect();
    assert_eq!(
        formats,
        ["jsonl", "jsonl", "jsonl", "parquet", "text", "files"]
    );
    for (input, path) in metadata["inputs"].as_array().unwrap().iter().zip(&inputs) {
        assert_eq!(input["path"], path.to_str().unwrap());
        if path.is_file() {
            assert_eq!(input["bytes"], fs::metadata(path).unwrap().len());
        }
    }
    let documents: Vec<u64> = metadata["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|input| input["documents"].as_u64().unwrap())
        .collect();
    assert_eq!(documents, [10, 10, 10, 10, 1, 2]);
    assert_eq!(metadata["inputs"][5]["skipped_files"], 1);
    assert_eq!(metadata["bad_records"], 0);
    assert_eq!(metadata["first_bad_records"], serde_json::json!([]));
    assert_eq!(metadata["shards"][0]["name"], "shard_00000");
    assert_eq!(metadata["shards"][0]["documents"], 43);
    assert_eq!(metadata["shards"][0]["tokens"], metadata["tokens"]);
}

#[test]
fn output_is_identical_for_one_and_four_workers() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = large_inputs(dir.path(), 3_500_000);
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let mut outputs = Vec::new();
    for workers in [1, 4] {
        let output = dir.path().join(format!("out-{workers}"));
        let mut options = options(&paths(&inputs), &tokenizer, &output);
        options.workers = workers;
        options.shard_size_tokens = 300_000;
        let report = prepare(&options, &Progress::new()).unwrap();
        assert!(report.shards.len() > 1);
        outputs.push(output);
    }
    assert_eq!(entries(&outputs[0]), entries(&outputs[1]));
    for name in entries(&outputs[0]) {
        let read = |output: &PathBuf| fs::read(output.join(&name)).unwrap();
        assert!(read(&outputs[0]) == read(&outputs[1]), "{name} differs");
    }
}

#[test]
fn bos_and_eos_frame_each_document_as_asked() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    write_jsonl(&input, &["hello world".into(), String::new()]);
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let reference = tokenizers::Tokenizer::from_file(&tokenizer).unwrap();
    let id = |token| reference.token_to_id(token).unwrap();
    let hello = reference_ids(&tokenizer, "hello world");
    for (add_bos, add_eos, bos, eos, expected) in [
        (
            true,
            true,
            None,
            Some("<|pad|>"),
            vec![
                [vec![id("<s>")], hello.clone(), vec![id("<|pad|>")]].concat(),
                vec![id("<s>"), id("<|pad|>")],
            ],
        ),
        (
            true,
            false,
            Some("<|endoftext|>"),
            None,
            vec![
                [vec![id("<|endoftext|>")], hello.clone()].concat(),
                vec![id("<|endoftext|>")],
            ],
        ),
        (false, false, None, None, vec![hello.clone(), vec![]]),
    ] {
        let output = dir.path().join(format!("out-{add_bos}-{add_eos}"));
        let mut options = options(&[&input], &tokenizer, &output);
        (options.add_bos, options.add_eos) = (add_bos, add_eos);
        options.bos_token = bos.map(str::to_owned);
        options.eos_token = eos.map(str::to_owned);
        prepare(&options, &Progress::new()).unwrap();
        assert_eq!(read_documents(&output), expected);
    }

    let output = dir.path().join("out-unknown");
    let mut options = options(&[&input], &tokenizer, &output);
    options.eos_token = Some("</s>".into());
    let error = prepare(&options, &Progress::new()).unwrap_err();
    assert!(
        matches!(
            error,
            PrepareError::Tokenizer(TokenizerError::UnknownToken { .. })
        ),
        "{error}"
    );
    assert_no_output(&output);
}

#[test]
fn shards_rotate_once_full_and_never_split_documents() {
    let dir = tempfile::tempdir().unwrap();
    let (inputs, _) = inputs_of_every_format(dir.path());
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let whole = dir.path().join("whole");
    prepare(
        &options(&paths(&inputs), &tokenizer, &whole),
        &Progress::new(),
    )
    .unwrap();
    let sharded = dir.path().join("sharded");
    let mut options = options(&paths(&inputs), &tokenizer, &sharded);
    options.shard_size_tokens = 100;
    let report = prepare(&options, &Progress::new()).unwrap();

    let documents = read_documents(&whole);
    assert_eq!(read_documents(&sharded), documents);
    let names: Vec<&str> = report.shards.iter().map(|s| s.name.as_str()).collect();
    let expected: Vec<String> = (0..names.len()).map(|i| format!("shard_{i:05}")).collect();
    assert_eq!(names, expected);
    assert!(names.len() > 3);
    let mut next = documents.iter();
    for (i, shard) in report.shards.iter().enumerate() {
        let lengths: Vec<u64> = next
            .by_ref()
            .take(shard.documents as usize)
            .map(|d| d.len() as u64)
            .collect();
        assert_eq!(lengths.iter().sum::<u64>(), shard.tokens);
        let before_last = shard.tokens - lengths.last().unwrap();
        assert!(
            before_last < 100,
            "shard {i} was full before its last document"
        );
        if i + 1 < report.shards.len() {
            assert!(shard.tokens >= 100, "shard {i} closed before it was full");
        }
    }
}

#[test]
fn bad_records_are_counted_and_the_first_quoted_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let lines: String = (1..=60)
        .map(|line| match line % 2 {
            0 => format!("{{\"text\": \"line {line}\"}}\n"),
            _ => format!("{{\"content\": \"line {line}\"}}\n"),
        })
        .collect();
    fs::write(&input, lines).unwrap();
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let output = dir.path().join("out");
    let progress = Progress::new();
    let report = prepare(&options(&[&input], &tokenizer, &output), &progress).unwrap();
    assert_eq!((report.documents, report.bad_records), (30, 30));
    assert_eq!(progress.bad_records(), 30);
    assert_eq!(
        (progress.documents(), progress.tokens()),
        (30, report.tokens)
    );
    assert_eq!(progress.bytes_read(), fs::metadata(&input).unwrap().len());
    assert_eq!(progress.total_bytes(), progress.bytes_read());
    assert_eq!(report.inputs[0].bad_records, 30);
    let expected: Vec<String> = (0..20)
        .map(|i| format!("{}:{}: no field \"text\"", input.display(), 2 * i + 1))
        .collect();
    assert_eq!(report.first_bad_records, expected);
    assert_eq!(
        read_metadata(&output)["first_bad_records"],
        serde_json::json!(expected)
    );
}

#[test]
fn strict_mode_stops_at_the_first_bad_record_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    fs::write(
        &input,
        "{\"text\": \"fine\"}\n{\"text\": null}\n{\"text\": [1]}\n",
    )
    .unwrap();
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let output = dir.path().join("out");
    let mut options = options(&[&input], &tokenizer, &output);
    options.strict = true;
    let error = prepare(&options, &Progress::new()).unwrap_err();
    let PrepareError::BadRecord(record) = &error else {
        panic!("{error}");
    };
    assert_eq!(record.location.line_or_row, 2);
    assert!(
        error
            .to_string()
            .starts_with(&format!("{}:2: invalid type: null", input.display())),
        "{error}"
    );
    assert_no_output(&output);
}

#[test]
fn cancelling_stops_promptly_and_leaves_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = large_inputs(dir.path(), 20_000_000);
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let output = dir.path().join("out");
    let options = options(&paths(&inputs), &tokenizer, &output);

    let progress = Progress::new();
    progress.cancel();
    assert!(matches!(
        prepare(&options, &progress),
        Err(PrepareError::Cancelled)
    ));
    assert_no_output(&output);

    let progress = Progress::new();
    let cancelled_at = thread::scope(|scope| {
        let run = scope.spawn(|| prepare(&options, &progress));
        while progress.documents() == 0 {
            assert!(!run.is_finished(), "finished before any progress was seen");
            thread::sleep(Duration::from_millis(1));
        }
        assert!(progress.bytes_read() > 0 && progress.total_bytes() > progress.bytes_read());
        progress.cancel();
        let cancelled_at = Instant::now();
        assert!(matches!(run.join().unwrap(), Err(PrepareError::Cancelled)));
        cancelled_at.elapsed()
    });
    assert!(
        cancelled_at < Duration::from_secs(5),
        "took {cancelled_at:?} to stop"
    );
    assert_no_output(&output);
}

#[test]
fn an_existing_output_is_replaced_only_with_overwrite_and_only_once_complete() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    write_jsonl(&input, &["first".into()]);
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let output = dir.path().join("out");
    let mut options: PrepareOptions = options(&[&input], &tokenizer, &output);
    prepare(&options, &Progress::new()).unwrap();
    let first = read_documents(&output);

    write_jsonl(&input, &["second".into(), "third".into()]);
    let error = prepare(&options, &Progress::new()).unwrap_err();
    assert!(
        matches!(error, PrepareError::OutputExists { .. }),
        "{error}"
    );
    assert_eq!(read_documents(&output), first);

    // A failing run keeps the old dataset.
    options.overwrite = true;
    options.strict = true;
    fs::write(&input, "not json\n").unwrap();
    assert!(matches!(
        prepare(&options, &Progress::new()),
        Err(PrepareError::BadRecord(_))
    ));
    assert_eq!(read_documents(&output), first);

    write_jsonl(&input, &["second".into(), "third".into()]);
    prepare(&options, &Progress::new()).unwrap();
    assert_eq!(read_documents(&output).len(), 2);
    assert_eq!(entries(dir.path()), ["in.jsonl", "out", "tokenizer"]);

    // Never deletes what is not a dataset.
    let precious = dir.path().join("precious");
    fs::create_dir(&precious).unwrap();
    fs::write(precious.join("notes.txt"), "keep me").unwrap();
    options.output = precious.clone();
    let error = prepare(&options, &Progress::new()).unwrap_err();
    assert!(matches!(error, PrepareError::NotADataset { .. }), "{error}");
    assert_eq!(
        fs::read_to_string(precious.join("notes.txt")).unwrap(),
        "keep me"
    );
}

#[test]
fn input_without_a_valid_record_is_an_error_leaving_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    fs::write(&input, "{}\n").unwrap();
    let tokenizer = write_tokenizer(&dir.path().join("tokenizer"), false);
    let output = dir.path().join("out");
    let error = prepare(&options(&[&input], &tokenizer, &output), &Progress::new()).unwrap_err();
    assert!(
        matches!(error, PrepareError::NoDocuments { bad_records: 1, .. }),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.starts_with(&format!("{}: no valid record", input.display())),
        "{message}"
    );
    assert!(message.contains("in.jsonl:1: "), "{message}");
    assert_no_output(&output);
}

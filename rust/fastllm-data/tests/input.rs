mod text_fixtures;

use std::fs;
use std::path::Path;

use fastllm_data::{DocumentReader, InputError, InputFormat, InputSpec};
use text_fixtures::{write_jsonl, write_parquet};

fn spec(paths: &[&Path]) -> InputSpec {
    InputSpec {
        paths: paths.iter().map(|p| p.display().to_string()).collect(),
        ..InputSpec::default()
    }
}

/// Reads everything: (texts, bad records as "file:line: reason", skipped files).
fn read_all(spec: &InputSpec) -> (Vec<String>, Vec<String>, u64) {
    let mut reader = DocumentReader::open(spec).unwrap();
    let (mut texts, mut bad, mut skipped) = (Vec::new(), Vec::new(), 0);
    while let Some(batch) = reader.next_batch(64) {
        texts.extend(batch.documents.into_iter().map(|d| d.text));
        bad.extend(batch.bad_records.iter().map(ToString::to_string));
        skipped += batch.skipped_files;
    }
    assert_eq!(reader.bytes_read(), reader.total_bytes());
    (texts, bad, skipped)
}

fn texts(n: usize, prefix: &str) -> Vec<String> {
    (0..n)
        .map(|i| format!("{prefix} {i}\nwith \"quotes\" and é"))
        .collect()
}

#[test]
fn reads_plain_gzip_and_zstd_json_lines_in_the_order_given() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, gz, zst) = (
        dir.path().join("c.jsonl"),
        dir.path().join("a.json.gz"),
        dir.path().join("b.ndjson.zst"),
    );
    write_jsonl(&plain, &texts(3, "plain"));
    write_jsonl(&gz, &texts(100, "gzip"));
    write_jsonl(&zst, &texts(50, "zstd"));
    let (read, bad, _) = read_all(&spec(&[&plain, &gz, &zst]));
    let expected: Vec<String> = [texts(3, "plain"), texts(100, "gzip"), texts(50, "zstd")].concat();
    assert_eq!(read, expected);
    assert!(bad.is_empty());
}

#[test]
fn glob_matches_are_read_in_sorted_order() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["b", "a", "c"] {
        write_jsonl(&dir.path().join(format!("{name}.jsonl")), &texts(2, name));
    }
    let pattern = dir.path().join("*.jsonl");
    let (read, _, _) = read_all(&spec(&[&pattern]));
    assert_eq!(read, [texts(2, "a"), texts(2, "b"), texts(2, "c")].concat());
}

#[test]
fn bad_lines_become_bad_records_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.jsonl");
    let mut bytes = b"{\"text\": \"one\"}\n\n{\"text\": 2}\n{\"body\": \"x\"}\nnot json\n".to_vec();
    bytes.extend(b"{\"text\": \"\xff\"}\n{\"text\": \"two\"}");
    fs::write(&path, bytes).unwrap();
    let (read, bad, _) = read_all(&spec(&[&path]));
    assert_eq!(read, ["one", "two"]);
    let file = path.display();
    assert_eq!(bad.len(), 4, "{bad:?}");
    assert!(
        bad[0].starts_with(&format!("{file}:3: invalid type: integer")),
        "{}",
        bad[0]
    );
    assert_eq!(bad[1], format!("{file}:4: no field \"text\""));
    assert!(
        bad[2].starts_with(&format!("{file}:5: invalid JSON")),
        "{}",
        bad[2]
    );
    assert_eq!(bad[3], format!("{file}:6: invalid UTF-8"));
}

#[test]
fn a_corrupt_compressed_file_is_one_bad_record_after_its_good_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.jsonl.gz");
    write_jsonl(&path, &texts(1000, "line"));
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let (read, bad, _) = read_all(&spec(&[&path]));
    assert!(!read.is_empty() && read.len() < 1000);
    assert_eq!(read[..], texts(1000, "line")[..read.len()]);
    assert_eq!(bad.len(), 1);
    assert!(bad[0].contains("cannot read"), "{}", bad[0]);
}

#[test]
fn reads_a_parquet_column_by_name_across_row_groups() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.parquet");
    let rows = [
        Some("zero"),
        Some("one"),
        None,
        Some("three"),
        Some(""),
        Some("five 日本"),
    ];
    write_parquet(&path, &rows, 4);
    let (read, bad, _) = read_all(&spec(&[&path]));
    assert_eq!(read, ["zero", "one", "three", "", "five 日本"]);
    assert_eq!(
        bad,
        [format!("{}:3: null instead of a string", path.display())]
    );

    let wrong_column = InputSpec {
        field: "id".into(),
        ..spec(&[&path])
    };
    let (read, bad, _) = read_all(&wrong_column);
    assert!(read.is_empty());
    assert_eq!(bad.len(), 1);
    assert!(bad[0].contains("column \"id\" holds INT64"), "{}", bad[0]);
}

#[test]
fn a_text_file_is_one_document_and_invalid_utf8_a_bad_record() {
    let dir = tempfile::tempdir().unwrap();
    let (good, bad_file) = (dir.path().join("a.txt"), dir.path().join("b.txt"));
    fs::write(&good, "whole\nfile\n").unwrap();
    fs::write(&bad_file, b"bad \xc3").unwrap();
    let (read, bad, skipped) = read_all(&spec(&[&good, &bad_file]));
    assert_eq!(read, ["whole\nfile\n"]);
    assert_eq!(bad, [format!("{}: invalid UTF-8", bad_file.display())]);
    assert_eq!(skipped, 0);
}

#[test]
fn a_source_tree_is_walked_in_order_skipping_hidden_entries_and_binaries() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("repo");
    for (path, bytes) in [
        ("src/main.rs", &b"fn main() {}\n"[..]),
        ("src/lib.rs", b"pub mod a;\n"),
        ("README.md", b"# Readme\n"),
        ("setup.py", b"import setuptools\n"),
        (".git/config", b"[core]\n"),
        (".env", b"SECRET=1\n"),
        ("logo.png", b"\x89PNG\r\n\x1a\n\x00\x00"),
        ("latin1.txt", b"caf\xe9"),
    ] {
        let path = root.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
    }
    let (read, bad, skipped) = read_all(&spec(&[&root]));
    assert_eq!(
        read,
        [
            "# Readme\n",
            "import setuptools\n",
            "pub mod a;\n",
            "fn main() {}\n"
        ]
    );
    assert!(bad.is_empty());
    assert_eq!(skipped, 2);

    let only_rust = InputSpec {
        extensions: Some(vec![".rs".into()]),
        ..spec(&[&root])
    };
    let mut reader = DocumentReader::open(&only_rust).unwrap();
    let batch = reader.next_batch(usize::MAX).unwrap();
    let names: Vec<_> = batch
        .documents
        .iter()
        .map(|d| d.location.to_string())
        .collect();
    let src = root.join("src");
    assert_eq!(
        names,
        [
            src.join("lib.rs").display().to_string(),
            src.join("main.rs").display().to_string()
        ]
    );
    let input = &reader.inputs()[0];
    assert_eq!(
        (input.format, input.documents, input.bytes),
        (InputFormat::Files, 2, 24)
    );
}

#[test]
fn batches_hold_about_max_bytes_and_count_per_input() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.jsonl");
    // 22 bytes a line: a batch of 50 bytes takes 3 lines.
    let lines: String = (0..100)
        .map(|i| format!("{{\"text\": \"{i:09}\"}}\n"))
        .collect();
    fs::write(&path, lines).unwrap();
    let mut reader = DocumentReader::open(&spec(&[&path])).unwrap();
    let mut sizes = Vec::new();
    while let Some(batch) = reader.next_batch(50) {
        sizes.push(batch.documents.len());
    }
    let expected: Vec<usize> = [3; 33].into_iter().chain([1]).collect();
    assert_eq!(sizes, expected);
    assert_eq!(reader.inputs()[0].documents, 100);
    assert_eq!(reader.bytes_read(), fs::metadata(&path).unwrap().len());
}

#[test]
fn paths_that_match_nothing_are_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.jsonl");
    let error = DocumentReader::open(&spec(&[&missing])).err().unwrap();
    assert!(matches!(error, InputError::Io { .. }));
    assert!(error.to_string().contains("missing.jsonl"), "{error}");

    let pattern = dir.path().join("*.parquet");
    let error = DocumentReader::open(&spec(&[&pattern])).err().unwrap();
    assert!(
        matches!(error, InputError::NothingMatches { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("*.parquet"), "{error}");

    let empty = dir.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let error = DocumentReader::open(&spec(&[&empty])).err().unwrap();
    assert!(
        matches!(error, InputError::NothingMatches { .. }),
        "{error}"
    );

    let unknown = dir.path().join("data.csv");
    fs::write(&unknown, "a,b").unwrap();
    let error = DocumentReader::open(&spec(&[&unknown])).err().unwrap();
    assert!(matches!(error, InputError::UnknownFormat { .. }), "{error}");
    let as_text = InputSpec {
        format: InputFormat::Text,
        ..spec(&[&unknown])
    };
    assert_eq!(read_all(&as_text).0, ["a,b"]);
}

#[test]
fn a_named_pipe_is_opened_once_and_read_whole() {
    // The format sniffing that regular files get would take the pipe's first lines from the
    // reader, and open it a second time: once the writer is gone, that open blocks for good.
    let dir = tempfile::tempdir().unwrap();
    let pipe = dir.path().join("stream.jsonl");
    let made = std::process::Command::new("mkfifo")
        .arg(&pipe)
        .status()
        .unwrap();
    assert!(made.success());
    let expected = texts(2_000, "streamed");
    let lines: String = expected
        .iter()
        .map(|text| serde_json::json!({ "text": text }).to_string() + "\n")
        .collect();
    let writer = {
        let pipe = pipe.clone();
        std::thread::spawn(move || fs::write(pipe, lines).unwrap())
    };
    let (sender, receiver) = std::sync::mpsc::channel();
    let spec = spec(&[&pipe]);
    std::thread::spawn(move || {
        let mut reader = DocumentReader::open(&spec).unwrap();
        let mut read = (Vec::new(), Vec::new());
        while let Some(batch) = reader.next_batch(4096) {
            read.0.extend(batch.documents.into_iter().map(|d| d.text));
            read.1
                .extend(batch.bad_records.iter().map(ToString::to_string));
        }
        sender.send(read).unwrap();
    });
    let (got, bad) = receiver
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("reading the pipe is stuck");
    writer.join().unwrap();
    assert_eq!(bad, Vec::<String>::new());
    assert_eq!(got, expected);
}

#[test]
fn fed_records_are_read_in_order_as_the_records_of_a_file_are() {
    use std::sync::Arc;

    use fastllm_data::{Content, FedBatch, FedKind, Feed};

    let (sender, batches) = crossbeam_channel::bounded(2);
    let feed = Feed {
        inputs: vec![("dataset".into(), 100), ("other".into(), 50)],
        format: InputFormat::Chat,
        batches,
    };
    let mut reader = DocumentReader::fed(feed, &InputSpec::default());
    let batch =
        |input, kind, rows: Vec<u64>, values: Vec<Option<&str>>, reasons: Vec<&str>| FedBatch {
            input,
            file: Arc::from(Path::new(if input == 0 { "dataset" } else { "other" })),
            bytes: 10,
            kind,
            rows,
            values: values.into_iter().map(|v| v.map(str::to_owned)).collect(),
            reasons: reasons.into_iter().map(str::to_owned).collect(),
            skipped: input as u64,
        };
    let messages = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    sender
        .send(batch(
            0,
            FedKind::Text,
            vec![1, 2],
            vec![Some("a"), None],
            vec!["null"],
        ))
        .unwrap();
    sender
        .send(batch(
            1,
            FedKind::Json,
            vec![7, 9],
            vec![Some(messages), Some("[]")],
            vec![],
        ))
        .unwrap();
    drop(sender);
    let first = reader.next_batch(usize::MAX).unwrap();
    assert_eq!(first.documents.len(), 1);
    assert_eq!(first.documents[0].text, "a");
    assert_eq!(first.bad_records[0].to_string(), "dataset:2: null");
    let second = reader.next_batch(usize::MAX).unwrap();
    assert!(matches!(
        second.documents[0].content,
        Content::Conversation(_)
    ));
    assert_eq!(second.documents[0].location.to_string(), "other:7");
    assert_eq!(
        second.bad_records[0].to_string(),
        "other:9: not a JSON object"
    );
    assert_eq!(second.skipped_files, 1);
    assert!(reader.next_batch(usize::MAX).is_none());
    assert_eq!(reader.bytes_read(), 20);
    assert_eq!(reader.total_bytes(), 150);
    let counts: Vec<_> = reader
        .inputs()
        .iter()
        .map(|i| (i.documents, i.bad_records, i.skipped_files))
        .collect();
    assert_eq!(counts, [(1, 1, 0), (1, 1, 1)]);
}

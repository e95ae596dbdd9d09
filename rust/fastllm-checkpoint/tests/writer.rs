mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{f32_tensor, read_safetensors, tensor};
use fastllm_checkpoint::{
    commit, verify, AsyncWriter, CheckpointError, Dtype, FileToWrite, TensorRef, WriteJob,
};
use serde_json::json;

fn file(name: &str, tensors: Vec<TensorRef>) -> FileToWrite {
    FileToWrite {
        file_name: name.to_owned(),
        tensors,
        metadata: BTreeMap::from([("format".to_owned(), "pt".to_owned())]),
    }
}

#[test]
fn a_job_writes_every_file_and_reports_them_in_order() {
    let root = tempfile::tempdir().unwrap();
    let partial = root.path().join(".10.partial");
    // Shared with the caller, as pinned buffers are: the writer must not need its own copy.
    let big: Arc<Vec<u8>> = Arc::new((0..4_000_000u32).map(|i| (i % 251) as u8).collect());
    let job = WriteJob {
        directory: partial.clone(),
        files: vec![
            file(
                "model.safetensors",
                vec![
                    TensorRef::new("embedding", Dtype::BF16, vec![1000, 2000], big.clone()),
                    f32_tensor("norm", &[1.0, 2.0, 3.0]),
                ],
            ),
            file(
                "optimizer.safetensors",
                vec![tensor(
                    "step",
                    Dtype::I64,
                    &[],
                    10i64.to_le_bytes().to_vec(),
                )],
            ),
        ],
    };
    let mut writer = AsyncWriter::new();
    let reports = writer.submit(job).wait().unwrap();

    let names: Vec<_> = reports
        .iter()
        .map(|report| report.file_name.as_str())
        .collect();
    assert_eq!(names, ["model.safetensors", "optimizer.safetensors"]);
    let model = read_safetensors(&partial.join("model.safetensors"));
    assert_eq!(model.tensors["embedding"].data, *big);
    assert_eq!(model.metadata.unwrap()["format"], "pt");
    let optimizer = read_safetensors(&partial.join("optimizer.safetensors"));
    assert_eq!(optimizer.tensors["step"].shape, Vec::<u64>::new());

    let final_dir = root.path().join("10");
    commit(&partial, &final_dir, json!({"step": 10}), &reports).unwrap();
    assert_eq!(verify(&final_dir).unwrap().files.len(), 2);
}

#[test]
fn jobs_run_one_after_another_and_each_reports_finished() {
    let root = tempfile::tempdir().unwrap();
    let mut writer = AsyncWriter::new();
    let handles: Vec<_> = (0..3)
        .map(|step| {
            writer.submit(WriteJob {
                directory: root.path().join(step.to_string()),
                files: vec![file(
                    "rank_0.safetensors",
                    vec![f32_tensor("w", &[step as f32; 1000])],
                )],
            })
        })
        .collect();
    // Submitting job n waited for job n - 1.
    assert!(handles[0].is_finished() && handles[1].is_finished());
    for handle in handles {
        assert_eq!(handle.wait().unwrap().len(), 1);
    }
}

#[test]
fn an_error_in_a_job_surfaces_at_wait_naming_the_file() {
    let root = tempfile::tempdir().unwrap();
    let mut writer = AsyncWriter::new();
    let handle = writer.submit(WriteJob {
        directory: root.path().to_owned(),
        files: vec![
            file("good.safetensors", vec![f32_tensor("w", &[1.0])]),
            file(
                "bad.safetensors",
                vec![tensor("w", Dtype::F32, &[2], vec![0; 4])],
            ),
        ],
    });
    let error = handle.wait().unwrap_err();
    assert!(
        matches!(error, CheckpointError::TensorSize { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("bad.safetensors"), "{error}");
}

#[test]
fn a_job_refuses_file_names_that_leave_the_directory_or_repeat() {
    let root = tempfile::tempdir().unwrap();
    let mut writer = AsyncWriter::new();
    for names in [
        vec!["../escape.safetensors"],
        vec!["a.safetensors", "a.safetensors"],
    ] {
        let files = names
            .iter()
            .map(|name| file(name, vec![f32_tensor("w", &[1.0])]))
            .collect();
        let handle = writer.submit(WriteJob {
            directory: root.path().join("job"),
            files,
        });
        let error = handle.wait().unwrap_err();
        assert!(
            matches!(
                error,
                CheckpointError::BadFileName { .. } | CheckpointError::DuplicateFile { .. }
            ),
            "{error}"
        );
    }
    assert!(!root.path().join("escape.safetensors").exists());
}

/// Bytes whose owner panics when read: the job must end in an error, not hang its waiter.
struct Exploding;

impl AsRef<[u8]> for Exploding {
    fn as_ref(&self) -> &[u8] {
        panic!("buffer gone")
    }
}

#[test]
fn a_panicking_writer_thread_ends_the_job_in_an_error() {
    let root = tempfile::tempdir().unwrap();
    let mut writer = AsyncWriter::new();
    let handle = writer.submit(WriteJob {
        directory: root.path().to_owned(),
        files: vec![file(
            "x.safetensors",
            vec![TensorRef::new("x", Dtype::U8, vec![0], Arc::new(Exploding))],
        )],
    });
    assert!(matches!(
        handle.wait(),
        Err(CheckpointError::WriterPanicked { .. })
    ));
}

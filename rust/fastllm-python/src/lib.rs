//! `fastllm._native`: the Python face of fastllm's Rust crates.
//!
//! This crate only converts types, maps errors and releases the GIL around real work;
//! the work itself lives in the plain-Rust crates beside it.

mod buffer_layout;
mod chat;
mod checkpoint;
mod dataset;
mod errors;
mod prepare;
mod samples;
mod tokenizer;

use pyo3::prelude::*;

/// Version of the Rust extension; `fastllm --version` shows it beside the Python package's, so an
/// extension built from another version than the installed package shows at once.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_class::<chat::ChatTemplate>()?;
    m.add_class::<checkpoint::CheckpointWriter>()?;
    m.add_class::<checkpoint::PendingWrite>()?;
    m.add_function(wrap_pyfunction!(checkpoint::commit_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::verify_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::latest_checkpoint, m)?)?;
    m.add_class::<dataset::TokenDataset>()?;
    m.add_class::<buffer_layout::BufferLayout>()?;
    m.add_class::<prepare::PrepareJob>()?;
    m.add_class::<prepare::DocumentReader>()?;
    m.add_function(wrap_pyfunction!(prepare::start_prepare, m)?)?;
    m.add_class::<samples::SampleSource>()?;
    m.add_class::<samples::FimOptions>()?;
    m.add_class::<samples::FimTransform>()?;
    m.add("Cancelled", m.py().get_type::<errors::Cancelled>())?;
    m.add(
        "TokenRangeError",
        m.py().get_type::<errors::TokenRangeError>(),
    )?;
    Ok(())
}

//! Where every parameter of a model lives in flat training buffers.
//!
//! Parameters are grouped into *stages* (consecutive layers that ZeRO-3 gathers together); each
//! stage is one flat buffer in which every parameter is a view. Gradients use a parallel buffer
//! with the same [`Layout`]; fp32 master weights and optimizer states exist only for the
//! [`Shard`] of each stage that a data-parallel rank owns.
//!
//! - [`Layout`]: aligned offsets per parameter, stage sizes padded so every rank's shard is
//!   equal and aligned, lookups by index and by name.
//! - [`Shard`]: one rank's part of one stage, the parameter pieces it owns ([`ShardPiece`]) and
//!   its runs of equal weight-decay flag ([`DecayRun`]), one fused optimizer call each.
//!
//! Plain Rust with typed errors ([`LayoutError`]); the Python binding lives in `fastllm-python`.

mod error;
mod layout;
mod shard;

pub use error::LayoutError;
pub use layout::{Layout, LayoutConfig, ParameterSpec, PlacedParameter, Stage};
pub use shard::{DecayRun, Shard, ShardPiece};

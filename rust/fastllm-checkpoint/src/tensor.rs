use std::sync::Arc;

use crate::Dtype;

/// Bytes shared with their owner, who keeps them unchanged until the write is finished; the
/// writer reads them in place and never copies them.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// One tensor to write: its name, element type, shape and raw little-endian bytes.
#[derive(Clone)]
pub struct TensorRef {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: SharedBytes,
}

impl TensorRef {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<u64>, data: SharedBytes) -> Self {
        Self {
            name: name.into(),
            dtype,
            shape,
            data,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        (*self.data).as_ref()
    }

    /// Bytes that `dtype` and `shape` call for; u128 so that no shape overflows.
    pub(crate) fn expected_len(&self) -> u128 {
        self.shape
            .iter()
            .fold(self.dtype.size() as u128, |len, &dim| {
                len.saturating_mul(dim.into())
            })
    }
}

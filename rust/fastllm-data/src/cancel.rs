//! A flag another thread raises to stop a long build (a sampling or blending index of many
//! millions of samples) between steps, so that a stopped run does not wait for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::DataError;

/// Steps between two looks at the flag: a look is one relaxed load, so checking every
/// few thousand steps costs nothing and stops within microseconds.
const STEPS_PER_CHECK: usize = 1 << 14;

/// Shared between the building thread and whoever may stop it; clones share one flag.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// Ask every build holding this flag to stop with [`DataError::Cancelled`].
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// [`DataError::Cancelled`] once cancelled.
    pub fn check(&self) -> Result<(), DataError> {
        match self.is_cancelled() {
            true => Err(DataError::Cancelled),
            false => Ok(()),
        }
    }

    /// Like [`Cancel::check`], looking only at every [`STEPS_PER_CHECK`]th `step` of a loop.
    pub(crate) fn check_at(&self, step: usize) -> Result<(), DataError> {
        match step % STEPS_PER_CHECK {
            0 => self.check(),
            _ => Ok(()),
        }
    }
}

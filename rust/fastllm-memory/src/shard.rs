//! One rank's shard of one stage: which parameter elements it owns and how to step them.

use std::ops::Range;

use crate::PlacedParameter;

/// Elements of one parameter that one shard holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShardPiece {
    /// Index in the layout's parameter list.
    pub parameter: usize,
    /// The elements, counted within the (flattened) parameter.
    pub parameter_range: Range<u64>,
    /// Where they lie, counted within the shard.
    pub shard_range: Range<u64>,
}

/// A maximal run of a shard whose elements share one weight-decay flag, counted within the shard.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DecayRun {
    pub range: Range<u64>,
    pub weight_decay: bool,
}

/// The part of one stage's buffer that one rank owns: its fp32 master weights and optimizer
/// states, and the slice of the gradient buffer that reduce-scatter leaves with it.
#[derive(Clone, Debug)]
pub struct Shard<'a> {
    stage: u32,
    /// The stage's parameters, in offset order.
    parameters: &'a [PlacedParameter],
    /// Layout index of `parameters[0]`.
    first_parameter: usize,
    range: Range<u64>,
}

impl<'a> Shard<'a> {
    pub(crate) fn new(
        stage: u32,
        parameters: &'a [PlacedParameter],
        first_parameter: usize,
        range: Range<u64>,
    ) -> Self {
        Self {
            stage,
            parameters,
            first_parameter,
            range,
        }
    }

    pub fn stage(&self) -> u32 {
        self.stage
    }

    /// The shard's elements within the stage buffer.
    pub fn range(&self) -> Range<u64> {
        self.range.clone()
    }

    /// The parameter elements the shard holds, in order; padding and empty parameters hold none.
    pub fn pieces(&self) -> Vec<ShardPiece> {
        let first = self
            .parameters
            .partition_point(|parameter| parameter.range().end <= self.range.start);
        self.parameters[first..]
            .iter()
            .take_while(|parameter| parameter.offset < self.range.end)
            .zip(self.first_parameter + first..)
            .filter_map(|(parameter, index)| self.clip(parameter, index))
            .collect()
    }

    /// The elements of parameter `index` (a layout index) that the shard holds, if any.
    pub fn piece(&self, index: usize) -> Option<ShardPiece> {
        let parameter = self
            .parameters
            .get(index.checked_sub(self.first_parameter)?)?;
        self.clip(parameter, index)
    }

    /// The shard cut into maximal runs of one weight-decay flag, covering it exactly; the
    /// optimizer makes one fused call per run.
    ///
    /// Padding joins the run before it, and padding before the shard's first parameter joins
    /// the run after it. Every run then starts at the shard's start or at a parameter's (aligned)
    /// start and ends at the next run's start or the shard's end, so all run boundaries are
    /// aligned. Padding stays zero either way: its gradient is zero, and so is decay applied to
    /// zero. A shard with no parameter elements is one run without decay.
    pub fn decay_runs(&self) -> Vec<DecayRun> {
        let mut runs: Vec<DecayRun> = Vec::new();
        for piece in self.pieces() {
            let weight_decay = self.parameters[piece.parameter - self.first_parameter].weight_decay;
            match runs.last_mut() {
                None => runs.push(DecayRun {
                    range: 0..piece.shard_range.end,
                    weight_decay,
                }),
                Some(last) if last.weight_decay == weight_decay => {
                    last.range.end = piece.shard_range.end;
                }
                Some(last) => {
                    last.range.end = piece.shard_range.start;
                    runs.push(DecayRun {
                        range: piece.shard_range,
                        weight_decay,
                    });
                }
            }
        }
        let len = self.range.end - self.range.start;
        match runs.last_mut() {
            Some(last) => last.range.end = len,
            None if len > 0 => runs.push(DecayRun {
                range: 0..len,
                weight_decay: false,
            }),
            None => {}
        }
        runs
    }

    fn clip(&self, parameter: &PlacedParameter, index: usize) -> Option<ShardPiece> {
        let start = parameter.offset.max(self.range.start);
        let end = parameter.range().end.min(self.range.end);
        (start < end).then(|| ShardPiece {
            parameter: index,
            parameter_range: start - parameter.offset..end - parameter.offset,
            shard_range: start - self.range.start..end - self.range.start,
        })
    }
}

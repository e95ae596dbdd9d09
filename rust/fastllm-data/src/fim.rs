//! Fill-in-the-middle (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in
//! the Middle"), as StarCoder was trained with it (bigcode's Megatron-LM, `permute` in
//! `megatron/data/gpt_dataset.py`).
//!
//! A sample is cut into document segments: a segment ends after each EOS token and wherever the
//! sample passes from one document piece to the next. Each segment, without its final EOS, is
//! independently transformed with probability `rate` into
//!
//! - PSM: `<prefix> prefix <suffix> suffix <middle> middle`, or, with probability `spm_rate`,
//! - SPM: `<prefix> <suffix> suffix <middle> prefix middle` (the paper's variant StarCoder used),
//!
//! and its EOS, if any, follows. Empty segments are left alone. The sentinels make the sample
//! longer (and re-encoded text may make it shorter), so the result is cut or padded back to the
//! sample's length.
//!
//! Randomness is a function of the seed and the sample index alone, so a sample gets the same
//! transform whichever thread, batch or restart computes it (bigcode's fork draws from one
//! generator shared by all samples, so there it depends on the order samples are read).

use crate::random::{mix, SplitMix64};
use crate::sample_source::pad_sample;
use crate::DataError;

/// Separates the FIM random stream from the sampling index's, which may use the same seed.
const FIM_STREAM: u64 = 0x4649_4d5f_7374_7265;

/// Turns tokens into text and back, for [`FimSplit::Character`].
///
/// `encode` must add no special tokens (no BOS or EOS), since the prefix, middle and suffix are
/// encoded separately and placed between FIM sentinels. Errors (tokens the codec does not know:
/// a dataset made with another tokenizer) are reported, as [`DataError::Codec`].
pub trait TextCodec {
    fn decode(&self, tokens: &[u32]) -> Result<String, String>;
    fn encode(&self, text: &str) -> Result<Vec<u32>, String>;
}

/// Where documents are split into prefix, middle and suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FimSplit {
    /// At characters (Unicode scalar values, like Python's `str`) of the decoded text, as
    /// StarCoder did; the three parts are re-encoded, which needs a [`TextCodec`]. Decoding a
    /// segment that starts or ends inside a multi-byte character is lossy (the codec decides
    /// how), which is why the paper trims such fragments.
    Character,
    /// At tokens: exact and cheap, no codec needed.
    Token,
}

/// FIM settings. Token ids of the sentinels are the caller's to resolve from their strings
/// (StarCoder: `<fim_prefix>`, `<fim_middle>`, `<fim_suffix>`, `<fim_pad>`, `<|endoftext|>`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FimConfig {
    /// Probability that a document segment is transformed.
    pub rate: f64,
    /// Among transformed segments, the probability of SPM rather than PSM.
    pub spm_rate: f64,
    /// Longest middle, in tokens ([`FimSplit::Token`]) or characters ([`FimSplit::Character`]).
    /// With a limit, as in Fast-LLM, the middle's length is drawn uniformly in
    /// `0..=min(limit, n)` for a segment of length `n`, then its start uniformly among the places
    /// it fits; without one, the two split points are drawn uniformly in `0..=n` and sorted.
    pub max_middle_len: Option<usize>,
    pub split: FimSplit,
    pub prefix: u32,
    pub middle: u32,
    pub suffix: u32,
    /// Fills the end of a sample that came out shorter than it went in.
    pub pad: u32,
    /// Ends documents: segments are cut after it, and it stays at the end of its segment.
    pub eos: u32,
}

/// A validated [`FimConfig`], with the codec that character splitting needs.
pub struct Fim {
    config: FimConfig,
    splitter: Splitter,
}

enum Splitter {
    Token,
    Character(Box<dyn TextCodec + Send + Sync>),
}

/// The three parts of a segment, in original order.
struct Parts<'a> {
    prefix: &'a [i64],
    middle: &'a [i64],
    suffix: &'a [i64],
}

impl Fim {
    /// Checks that both rates lie in `0..=1` and that character splitting has a codec (token
    /// splitting ignores one).
    pub fn new(
        config: FimConfig,
        codec: Option<Box<dyn TextCodec + Send + Sync>>,
    ) -> Result<Self, DataError> {
        for (name, value) in [("rate", config.rate), ("spm_rate", config.spm_rate)] {
            if !(0.0..=1.0).contains(&value) {
                return Err(DataError::BadFimRate { name, value });
            }
        }
        let splitter = match (config.split, codec) {
            (FimSplit::Token, _) => Splitter::Token,
            (FimSplit::Character, Some(codec)) => Splitter::Character(codec),
            (FimSplit::Character, None) => return Err(DataError::FimNeedsCodec),
        };
        Ok(Self { config, splitter })
    }

    pub fn config(&self) -> &FimConfig {
        &self.config
    }

    /// Transforms sample number `sample` in place and returns how many of its tokens are real.
    ///
    /// On entry `tokens[..real]` are the sample's tokens and `document_ids[..real]` the index of
    /// the document piece each belongs to; the rest is padding and is ignored. On return the
    /// transformed tokens, cut to `tokens.len()`, fill `tokens[..r]`, each with the document id
    /// of the segment it came from, where `r` is the returned count; positions from `r` on are
    /// padding, left for the caller to fill.
    ///
    /// Panics if `real > tokens.len()` or the two slices differ in length.
    pub fn apply(
        &self,
        seed: u64,
        sample: u64,
        tokens: &mut [i64],
        document_ids: &mut [i32],
        real: usize,
    ) -> Result<usize, DataError> {
        assert!(
            real <= tokens.len() && tokens.len() == document_ids.len(),
            "tokens and document ids must have equal lengths, at least `real`"
        );
        if self.config.rate == 0.0 {
            return Ok(real);
        }
        let mut rng = SplitMix64::new(mix(mix(seed ^ FIM_STREAM).wrapping_add(sample)));
        let eos = i64::from(self.config.eos);
        let mut out_tokens = Vec::with_capacity(tokens.len() + 16);
        let mut out_ids = Vec::with_capacity(tokens.len() + 16);
        let mut start = 0;
        // Segments past the sample's length would be cut off anyway.
        while start < real && out_tokens.len() < tokens.len() {
            let id = document_ids[start];
            let stop = tokens[start..real]
                .iter()
                .zip(&document_ids[start..real])
                .position(|(&t, &d)| t == eos || d != id)
                .map(|p| start + p);
            let (content_end, end) = match stop {
                Some(p) if document_ids[p] == id => (p, p + 1),
                Some(p) => (p, p),
                None => (real, real),
            };
            let content = &tokens[start..content_end];
            if !content.is_empty() && chance(&mut rng, self.config.rate) {
                self.permute(content, &mut rng, &mut out_tokens)?;
            } else {
                out_tokens.extend_from_slice(content);
            }
            out_tokens.extend_from_slice(&tokens[content_end..end]);
            out_ids.resize(out_tokens.len(), id);
            start = end;
        }
        let kept = out_tokens.len().min(tokens.len());
        tokens[..kept].copy_from_slice(&out_tokens[..kept]);
        document_ids[..kept].copy_from_slice(&out_ids[..kept]);
        Ok(kept)
    }

    /// Transforms sample number `sample` as a training batch holds it: [`apply`](Self::apply)
    /// to its first `real` tokens, then every token of the result trained (loss mask 1) and the
    /// positions after it padding with the pad token ([`pad_sample`]). Returns how many tokens
    /// are real after the transform.
    ///
    /// Panics as [`apply`](Self::apply) does, or if `loss_mask` has another length.
    pub fn fill_sample(
        &self,
        seed: u64,
        sample: u64,
        tokens: &mut [i64],
        document_ids: &mut [i32],
        loss_mask: &mut [u8],
        real: usize,
    ) -> Result<usize, DataError> {
        let real = self.apply(seed, sample, tokens, document_ids, real)?;
        loss_mask[..real].fill(1);
        pad_sample(
            tokens,
            document_ids,
            loss_mask,
            real,
            i64::from(self.config.pad),
        );
        Ok(real)
    }

    /// [`fill_sample`](Self::fill_sample) for samples `first_sample, first_sample + 1, …`, laid
    /// end to end in the buffers, as many as `real` has entries: sample `k` holds `real[k]` real
    /// tokens on entry (at most the sample length, the buffers' length over the sample count).
    pub fn fill(
        &self,
        seed: u64,
        first_sample: u64,
        tokens: &mut [i64],
        document_ids: &mut [i32],
        loss_mask: &mut [u8],
        real: &[usize],
    ) -> Result<(), DataError> {
        let length = tokens.len().checked_div(real.len()).unwrap_or(0);
        if tokens.len() != length * real.len()
            || document_ids.len() != tokens.len()
            || loss_mask.len() != tokens.len()
            || real.iter().any(|&r| r > length)
        {
            return Err(DataError::BadFimBuffers {
                samples: real.len(),
                tokens: tokens.len(),
                document_ids: document_ids.len(),
                loss_mask: loss_mask.len(),
                real: real.iter().copied().max().unwrap_or(0),
            });
        }
        let samples = tokens
            .chunks_exact_mut(length.max(1))
            .zip(document_ids.chunks_exact_mut(length.max(1)))
            .zip(loss_mask.chunks_exact_mut(length.max(1)));
        for (k, (((tokens, document_ids), loss_mask), &real)) in samples.zip(real).enumerate() {
            let sample = first_sample + k as u64;
            self.fill_sample(seed, sample, tokens, document_ids, loss_mask, real)?;
        }
        Ok(())
    }

    /// Appends the FIM form of `content` to `out`.
    fn permute(
        &self,
        content: &[i64],
        rng: &mut SplitMix64,
        out: &mut Vec<i64>,
    ) -> Result<(), DataError> {
        match &self.splitter {
            Splitter::Token => {
                let (start, end) = self.split_points(content.len(), rng);
                let parts = Parts {
                    prefix: &content[..start],
                    middle: &content[start..end],
                    suffix: &content[end..],
                };
                self.arrange(&parts, chance(rng, self.config.spm_rate), out);
            }
            Splitter::Character(codec) => {
                let ids = content
                    .iter()
                    .map(|&token| u32::try_from(token).map_err(|_| DataError::BadTokenId { token }))
                    .collect::<Result<Vec<u32>, _>>()?;
                let text = codec.decode(&ids).map_err(DataError::Codec)?;
                let (start, end) = self.split_points(text.chars().count(), rng);
                let byte = |char_index| {
                    text.char_indices()
                        .nth(char_index)
                        .map_or(text.len(), |(i, _)| i)
                };
                let (start, end) = (byte(start), byte(end));
                let encode = |part: &str| -> Result<Vec<i64>, DataError> {
                    let ids = codec.encode(part).map_err(DataError::Codec)?;
                    Ok(ids.into_iter().map(i64::from).collect())
                };
                let (prefix, middle, suffix) = (
                    encode(&text[..start])?,
                    encode(&text[start..end])?,
                    encode(&text[end..])?,
                );
                let parts = Parts {
                    prefix: &prefix,
                    middle: &middle,
                    suffix: &suffix,
                };
                self.arrange(&parts, chance(rng, self.config.spm_rate), out);
            }
        }
        Ok(())
    }

    /// Start and end of the middle in a segment of `n` tokens or characters.
    fn split_points(&self, n: usize, rng: &mut SplitMix64) -> (usize, usize) {
        let mut draw = |bound: usize| rng.below(bound as u64 + 1) as usize;
        match self.config.max_middle_len {
            None => {
                let (a, b) = (draw(n), draw(n));
                (a.min(b), a.max(b))
            }
            Some(limit) => {
                let length = draw(limit.min(n));
                let start = draw(n - length);
                (start, start + length)
            }
        }
    }

    fn arrange(&self, parts: &Parts<'_>, spm: bool, out: &mut Vec<i64>) {
        let [prefix, middle, suffix] =
            [self.config.prefix, self.config.middle, self.config.suffix].map(i64::from);
        if spm {
            out.extend([prefix, suffix]);
            out.extend_from_slice(parts.suffix);
            out.push(middle);
            out.extend_from_slice(parts.prefix);
            out.extend_from_slice(parts.middle);
        } else {
            out.push(prefix);
            out.extend_from_slice(parts.prefix);
            out.push(suffix);
            out.extend_from_slice(parts.suffix);
            out.push(middle);
            out.extend_from_slice(parts.middle);
        }
    }
}

/// True with probability `p`: a uniform double in `[0, 1)` (53 random bits) below `p`.
fn chance(rng: &mut SplitMix64, p: f64) -> bool {
    ((rng.next_u64() >> 11) as f64) * (1.0 / (1u64 << 53) as f64) < p
}

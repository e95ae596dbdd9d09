//! One document to tokens and masked token spans: plain text, text with Fast-LLM's character
//! spans, a conversation rendered with the chat template, or a preference pair (see
//! `preference`).

use std::ops::Range;

use crate::chat::{ChatTemplate, TrainOn};
use crate::input::{Content, Document};
use crate::tokenizer::Tokenizer;
use crate::{PairSpans, TokenizerError};

/// Tokens added around every text document; conversations are framed by their template.
#[derive(Clone, Copy)]
pub(super) struct Framing {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
}

/// Everything that turns documents into tokens.
pub(super) struct DocumentEncoder<'a> {
    pub tokenizer: &'a Tokenizer,
    pub framing: Framing,
    /// Loaded when some input is a chat or preference input.
    pub chat: Option<&'a ChatTemplate>,
    pub train_on: TrainOn,
    /// Preference pairs of more tokens are bad records.
    pub max_pair_tokens: Option<u64>,
}

/// Reusable buffers of one worker.
#[derive(Default)]
pub(super) struct Scratch {
    pub tokens: Vec<u32>,
    /// Masked token ranges of the document, in order.
    pub masked: Vec<[u32; 2]>,
    /// The spans of a preference pair.
    pub pair: Option<PairSpans>,
    offsets: Vec<(usize, usize)>,
    trained: Vec<bool>,
}

/// Why a document is a bad record rather than tokens.
pub(super) enum Refusal {
    Bad(String),
    Encode(TokenizerError),
}

impl From<TokenizerError> for Refusal {
    fn from(error: TokenizerError) -> Self {
        Self::Encode(error)
    }
}

impl DocumentEncoder<'_> {
    /// Tokenizes `document` into `scratch.tokens` (framed) and its masked spans into
    /// `scratch.masked`.
    pub fn encode(&self, document: &Document, scratch: &mut Scratch) -> Result<(), Refusal> {
        scratch.tokens.clear();
        scratch.masked.clear();
        scratch.pair = None;
        match &document.content {
            Content::Conversation(messages) => return self.encode_conversation(messages, scratch),
            Content::Preference(pair) => return self.encode_preference(pair, scratch),
            Content::Text | Content::TextWithSpans(_) => {}
        }
        scratch.tokens.extend(self.framing.bos);
        match &document.content {
            Content::TextWithSpans(spans) => {
                self.encode_with_spans(&document.text, spans, scratch)?
            }
            _ => self.tokenizer.encode(&document.text, &mut scratch.tokens)?,
        }
        scratch.tokens.extend(self.framing.eos);
        Ok(())
    }

    /// Fast-LLM's way: the text between spans and each span are tokenized apart, so spans end
    /// on token boundaries; the framing tokens are trained on.
    fn encode_with_spans(
        &self,
        text: &str,
        spans: &[[u64; 2]],
        scratch: &mut Scratch,
    ) -> Result<(), Refusal> {
        let bytes = byte_ranges(text, spans).map_err(Refusal::Bad)?;
        let mut position = 0;
        for range in bytes {
            self.tokenizer
                .encode(&text[position..range.start], &mut scratch.tokens)?;
            let begin = scratch.tokens.len() as u32;
            self.tokenizer
                .encode(&text[range.clone()], &mut scratch.tokens)?;
            let end = scratch.tokens.len() as u32;
            if begin < end {
                scratch.masked.push([begin, end]);
            }
            position = range.end;
        }
        self.tokenizer
            .encode(&text[position..], &mut scratch.tokens)?;
        Ok(())
    }

    /// The rendered conversation; tokens overlapping the trained text are trained on, as in
    /// transformers' `assistant_masks`, the rest masked.
    fn encode_conversation(
        &self,
        messages: &serde_json::Value,
        scratch: &mut Scratch,
    ) -> Result<(), Refusal> {
        let template = self
            .chat
            .expect("a chat template is loaded for chat inputs");
        let rendered = template
            .render_for_training(messages, self.train_on)
            .map_err(Refusal::Bad)?;
        scratch.offsets.clear();
        self.tokenizer.encode_with_offsets(
            &rendered.text,
            &mut scratch.tokens,
            &mut scratch.offsets,
        )?;

        scratch.trained.clear();
        scratch
            .trained
            .resize(scratch.tokens.len(), self.train_on == TrainOn::All);
        let spans = &rendered.trained;
        let mut span = 0;
        for (k, &(start, end)) in scratch.offsets.iter().enumerate() {
            while span < spans.len() && start >= spans[span].end {
                span += 1;
            }
            if span == spans.len() {
                break;
            }
            if end > spans[span].start {
                scratch.trained[k] = true;
            }
        }
        if !scratch.trained.contains(&true) {
            return Err(Refusal::Bad(match self.train_on {
                TrainOn::All => "the conversation renders to no tokens".to_owned(),
                _ => "nothing to train on: no assistant tokens".to_owned(),
            }));
        }
        let mut run_start = None;
        for (k, &trained) in scratch.trained.iter().chain([&true]).enumerate() {
            match (trained, run_start) {
                (false, None) => run_start = Some(k as u32),
                (true, Some(begin)) => {
                    scratch.masked.push([begin, k as u32]);
                    run_start = None;
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Fast-LLM's character spans (`[begin, end]`, both included) as sorted byte ranges of `text`,
/// or why they are not spans of it.
fn byte_ranges(text: &str, spans: &[[u64; 2]]) -> Result<Vec<Range<usize>>, String> {
    let mut sorted = spans.to_vec();
    sorted.sort_unstable();
    // Byte offset of each character, and of the end.
    let starts: Vec<usize> = text
        .char_indices()
        .map(|(at, _)| at)
        .chain([text.len()])
        .collect();
    let characters = starts.len() as u64 - 1;
    let mut ranges = Vec::with_capacity(sorted.len());
    let mut previous_end: Option<u64> = None;
    for [begin, end] in sorted {
        if begin > end || end >= characters {
            return Err(format!(
                "loss-masking span [{begin}, {end}] is out of range for a text of {characters} \
                 characters"
            ));
        }
        if previous_end.is_some_and(|previous| begin <= previous) {
            return Err(format!(
                "loss-masking span [{begin}, {end}] overlaps another"
            ));
        }
        previous_end = Some(end);
        ranges.push(starts[begin as usize]..starts[end as usize + 1]);
    }
    Ok(ranges)
}

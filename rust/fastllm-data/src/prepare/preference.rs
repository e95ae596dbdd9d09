//! One preference record to one document: the prompt's tokens once, then the chosen answer's,
//! then the rejected answer's, as TRL's `DPOTrainer` (1.x) makes them: the prompt alone and the
//! prompt followed by each answer are tokenized whole, and the answers start where those tokens
//! part, so that an answer's tokens are those of the whole text (an answer after a prompt that
//! ends with a space, or mid-word, is not tokenized as if the text broke there) and both
//! answers follow the very same prompt tokens.
//!
//! Strings: the texts framed by BOS (when `add_bos`), each answer by EOS (when `add_eos`).
//! Lists of messages: rendered with the chat template as TRL's `maybe_apply_chat_template`
//! renders them (the prompt with the generation prompt, each whole conversation without),
//! framed by the template alone.

use serde_json::Value as Json;

use super::encode::{DocumentEncoder, Refusal, Scratch};
use crate::input::PreferencePair;
use crate::PairSpans;

/// A pair as texts to tokenize: the prompt, and the prompt followed by each answer.
struct PairText {
    prompt: String,
    chosen: String,
    rejected: String,
}

impl DocumentEncoder<'_> {
    /// Tokenizes `pair` into `scratch.tokens` and its spans into `scratch.pair`.
    pub(super) fn encode_preference(
        &self,
        pair: &PreferencePair,
        scratch: &mut Scratch,
    ) -> Result<(), Refusal> {
        let (text, framed) = match (&pair.chosen, &pair.rejected) {
            (Json::String(chosen), Json::String(rejected)) => {
                (strings(pair.prompt.as_ref(), chosen, rejected)?, true)
            }
            (Json::Array(chosen), Json::Array(rejected)) => (
                self.conversations(pair.prompt.as_ref(), chosen, rejected)?,
                false,
            ),
            _ => {
                return Err(Refusal::Bad(
                    "chosen and rejected must both be strings or both lists of messages".into(),
                ))
            }
        };
        let encode = |text: &str, answer: bool| -> Result<Vec<u32>, Refusal> {
            let mut tokens = Vec::new();
            if framed {
                tokens.extend(self.framing.bos);
            }
            self.tokenizer.encode(text, &mut tokens)?;
            if framed && answer {
                tokens.extend(self.framing.eos);
            }
            Ok(tokens)
        };
        let prompt = encode(&text.prompt, false)?;
        let chosen = encode(&text.chosen, true)?;
        let rejected = encode(&text.rejected, true)?;
        // TRL's prompt: the tokens the prompt alone shares with both whole texts.
        let shared = common_start(&prompt, &chosen).min(common_start(&prompt, &rejected));
        if shared == 0 {
            return Err(Refusal::Bad(
                "the prompt has no tokens of its own (it is empty, or its tokens merge with the \
                 answers'): nothing would predict the answers' first tokens"
                    .into(),
            ));
        }
        for (name, whole) in [("chosen", &chosen), ("rejected", &rejected)] {
            if whole.len() == shared {
                return Err(Refusal::Bad(format!("the {name} answer is empty")));
            }
        }
        let tokens = &mut scratch.tokens;
        tokens.extend_from_slice(&prompt[..shared]);
        tokens.extend_from_slice(&chosen[shared..]);
        tokens.extend_from_slice(&rejected[shared..]);
        let [prompt, chosen, rejected] =
            [shared, chosen.len() - shared, rejected.len() - shared].map(|n| n as u32);
        let length = tokens.len() as u64;
        if let Some(limit) = self.max_pair_tokens.filter(|&limit| length > limit) {
            return Err(Refusal::Bad(format!(
                "the pair has {length} tokens ({prompt} prompt, {chosen} chosen, {rejected} \
                 rejected), more than max_pair_tokens {limit}"
            )));
        }
        scratch.pair = Some(PairSpans::of_lengths(prompt, chosen, rejected));
        Ok(())
    }

    /// The parts of a conversational pair as text: the prompt rendered with the generation
    /// prompt, and what each whole conversation adds to the text it shares with the prompt.
    fn conversations(
        &self,
        prompt: Option<&Json>,
        chosen: &[Json],
        rejected: &[Json],
    ) -> Result<PairText, Refusal> {
        let template = self.chat.ok_or_else(|| {
            Refusal::Bad(
                "messages need a chat template, and the tokenizer has none; name one \
                 (input.chat_template)"
                    .into(),
            )
        })?;
        let (prompt, chosen, rejected) = match prompt {
            Some(Json::Array(prompt)) => (prompt.clone(), chosen, rejected),
            Some(_) => {
                return Err(Refusal::Bad(
                    "the prompt is not a list of messages (the answers are)".into(),
                ))
            }
            None => {
                let shared = implicit_prompt(chosen, rejected)?;
                (
                    chosen[..shared].to_vec(),
                    &chosen[shared..],
                    &rejected[shared..],
                )
            }
        };
        let render = |messages: &[Json], generation_prompt: bool| {
            template
                .render(&Json::Array(messages.to_vec()), generation_prompt)
                .map_err(Refusal::Bad)
        };
        let whole = |answer: &[Json]| {
            let mut messages = prompt.clone();
            messages.extend_from_slice(answer);
            render(&messages, false)
        };
        // A template may write the generation prompt otherwise once an answer follows: the
        // prompt's tokens are only those the whole conversations share with it.
        Ok(PairText {
            prompt: render(&prompt, true)?,
            chosen: whole(chosen)?,
            rejected: whole(rejected)?,
        })
    }
}

/// The texts of a pair of strings; without a prompt, TRL's `extract_prompt`: the answers'
/// common start, less a space just before where they differ.
fn strings(prompt: Option<&Json>, chosen: &str, rejected: &str) -> Result<PairText, Refusal> {
    let (prompt, chosen, rejected) = match prompt {
        Some(Json::String(prompt)) => (prompt.as_str(), chosen, rejected),
        Some(_) => {
            return Err(Refusal::Bad(
                "the prompt is not a string (the answers are)".into(),
            ))
        }
        None => {
            let mut shared = common_prefix(chosen, rejected).len();
            if chosen[..shared].ends_with(' ') {
                shared -= 1;
            }
            (&chosen[..shared], &chosen[shared..], &rejected[shared..])
        }
    };
    for (name, answer) in [("chosen", chosen), ("rejected", rejected)] {
        if answer.is_empty() {
            return Err(Refusal::Bad(format!("the {name} answer is empty")));
        }
    }
    Ok(PairText {
        prompt: prompt.to_owned(),
        chosen: format!("{prompt}{chosen}"),
        rejected: format!("{prompt}{rejected}"),
    })
}

/// How many messages two whole conversations share before their answers: all up to the first
/// that differs, which must be an assistant message in both.
fn implicit_prompt(chosen: &[Json], rejected: &[Json]) -> Result<usize, Refusal> {
    let shared = chosen
        .iter()
        .zip(rejected)
        .take_while(|(a, b)| a == b)
        .count();
    if shared == 0 {
        return Err(Refusal::Bad(
            "no prompt field, and chosen and rejected share no first message to be the prompt"
                .into(),
        ));
    }
    let role = |messages: &[Json]| {
        messages
            .get(shared)
            .and_then(|message| message.get("role"))
            .and_then(Json::as_str)
            .map(str::to_owned)
    };
    match (role(chosen), role(rejected)) {
        (Some(a), Some(b)) if a == "assistant" && b == "assistant" => Ok(shared),
        (a, b) => Err(Refusal::Bad(format!(
            "the prompt parts differ: message {shared} is {} in chosen and {} in rejected, where \
             an assistant answer must start the part after the shared prompt",
            describe_role(a),
            describe_role(b)
        ))),
    }
}

fn describe_role(role: Option<String>) -> String {
    role.map_or_else(|| "missing".to_owned(), |role| format!("a {role} message"))
}

/// How many tokens `a` and `b` share from their start.
fn common_start(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The longest common start of `a` and `b`, on a character boundary.
fn common_prefix<'a>(a: &'a str, b: &str) -> &'a str {
    let end = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((at, _), _)| at);
    &a[..end]
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn messages(value: Json) -> Vec<Json> {
        value.as_array().unwrap().clone()
    }

    #[test]
    fn an_implicit_string_prompt_is_trls_common_start_less_the_last_space_and_leads_each_text() {
        let text = |result: Result<PairText, Refusal>| {
            let text = result.ok().unwrap();
            (text.prompt, text.chosen, text.rejected)
        };
        assert_eq!(
            text(strings(None, "The sky is blue.", "The sky is green.")),
            (
                "The sky is".into(),
                "The sky is blue.".into(),
                "The sky is green.".into()
            )
        );
        assert_eq!(
            text(strings(None, "Café ☕ oui", "Café ☕ non")),
            ("Café ☕".into(), "Café ☕ oui".into(), "Café ☕ non".into())
        );
        assert_eq!(
            text(strings(Some(&json!("Q:")), " a", " b")),
            ("Q:".into(), "Q: a".into(), "Q: b".into())
        );
        assert!(strings(Some(&json!(["Q"])), "a", "b").is_err());
        assert!(strings(Some(&json!("Q:")), "", "b").is_err());
    }

    #[test]
    fn an_implicit_conversation_prompt_ends_where_the_assistant_answers_differ() {
        let user = json!({"role": "user", "content": "Sky?"});
        let chosen = messages(json!([user, {"role": "assistant", "content": "Blue."}]));
        let rejected = messages(json!([user, {"role": "assistant", "content": "Green."}]));
        assert!(matches!(implicit_prompt(&chosen, &rejected), Ok(1)));

        let other = messages(json!([{"role": "user", "content": "Grass?"}, chosen[1]]));
        let Err(Refusal::Bad(reason)) = implicit_prompt(&chosen, &other) else {
            panic!("different first messages share no prompt");
        };
        assert!(reason.contains("share no first message"), "{reason}");

        let system = json!({"role": "system", "content": "Be brief."});
        let a = messages(json!([system, user, chosen[1]]));
        let b = messages(json!([system, {"role": "user", "content": "Grass?"}, chosen[1]]));
        let Err(Refusal::Bad(reason)) = implicit_prompt(&a, &b) else {
            panic!("differing user turns are not answers");
        };
        assert!(
            reason.contains("the prompt parts differ: message 1 is a user message"),
            "{reason}"
        );
        let Err(Refusal::Bad(reason)) = implicit_prompt(&chosen, &chosen) else {
            panic!("identical conversations have no answers");
        };
        assert!(reason.contains("message 2 is missing"), "{reason}");
    }

    #[test]
    fn the_common_prefix_stops_on_a_character_boundary() {
        assert_eq!(common_prefix("é", "è"), "");
        assert_eq!(common_prefix("abc", "ab"), "ab");
        assert_eq!(common_prefix("ab", "abc"), "ab");
    }
}

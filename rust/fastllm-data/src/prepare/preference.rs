//! One preference record to one document: the prompt's tokens once, then the chosen answer's,
//! then the rejected answer's, each part tokenized apart (as TRL's `DPOTrainer` tokenizes
//! them), so that both answers follow the very same prompt tokens.
//!
//! Strings: the prompt framed by BOS (when `add_bos`), each answer by EOS (when `add_eos`).
//! Lists of messages: rendered with the chat template as TRL's `maybe_apply_chat_template`
//! renders them (the prompt with the generation prompt, each answer as what the whole
//! conversation adds to it), framed by the template alone.

use serde_json::Value as Json;

use super::encode::{DocumentEncoder, Refusal, Scratch};
use crate::input::PreferencePair;
use crate::PairSpans;

/// The parts of a pair as text to tokenize.
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
        for (name, answer) in [("chosen", &text.chosen), ("rejected", &text.rejected)] {
            if answer.is_empty() {
                return Err(Refusal::Bad(format!("the {name} answer is empty")));
            }
        }
        let tokens = &mut scratch.tokens;
        if framed {
            tokens.extend(self.framing.bos);
        }
        self.tokenizer.encode(&text.prompt, tokens)?;
        let prompt = tokens.len() as u32;
        if prompt == 0 {
            return Err(Refusal::Bad(
                "the prompt is empty: nothing would predict the answers' first tokens".into(),
            ));
        }
        let answer = |text: &str, tokens: &mut Vec<u32>| -> Result<u32, Refusal> {
            let start = tokens.len();
            self.tokenizer.encode(text, tokens)?;
            if framed {
                tokens.extend(self.framing.eos);
            }
            Ok((tokens.len() - start) as u32)
        };
        let chosen = answer(&text.chosen, tokens)?;
        let rejected = answer(&text.rejected, tokens)?;
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
        let prompt_text = render(&prompt, true)?;
        let (chosen, rejected) = (whole(chosen)?, whole(rejected)?);
        // TRL's way: the prompt is what its rendering shares with the whole conversations (a
        // template may write the generation prompt otherwise once an answer follows).
        let shared = common_prefix(common_prefix(&prompt_text, &chosen), &rejected).len();
        Ok(PairText {
            prompt: chosen[..shared].to_owned(),
            chosen: chosen[shared..].to_owned(),
            rejected: rejected[shared..].to_owned(),
        })
    }
}

/// The parts of a pair of strings; without a prompt, TRL's `extract_prompt`: the answers'
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
    Ok(PairText {
        prompt: prompt.to_owned(),
        chosen: chosen.to_owned(),
        rejected: rejected.to_owned(),
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
    fn an_implicit_string_prompt_is_trls_common_start_less_the_last_space() {
        let text = |result: Result<PairText, Refusal>| {
            let text = result.ok().unwrap();
            (text.prompt, text.chosen, text.rejected)
        };
        assert_eq!(
            text(strings(None, "The sky is blue.", "The sky is green.")),
            ("The sky is".into(), " blue.".into(), " green.".into())
        );
        assert_eq!(
            text(strings(None, "Café ☕ oui", "Café ☕ non")),
            ("Café ☕".into(), " oui".into(), " non".into())
        );
        assert_eq!(
            text(strings(Some(&json!("Q:")), " a", " b")),
            ("Q:".into(), " a".into(), " b".into())
        );
        assert!(strings(Some(&json!(["Q"])), "a", "b").is_err());
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

//! Conversations rendered with a tokenizer's chat template as `transformers`'
//! `apply_chat_template` renders them, and which characters of the result are trained on.
//!
//! The template is Jinja, rendered by minijinja set up as transformers sets up Jinja (in a
//! sandbox: no file or environment access, and a budget of work per rendering): blocks
//! trimmed and left-stripped, loop controls, `raise_exception`, transformers' `tojson` (Python's
//! `json.dumps`), the Python string and dict methods (`.strip()`, `.items()` …), messages with
//! their keys in the order written, and the tokenizer's special tokens as variables.
//!
//! Trained text: inside `{% generation %}` … `{% endgeneration %}` blocks when the template has
//! them (transformers' assistant-token marker, which minijinja does not know: each tag becomes
//! a block that writes a marker character, so whitespace control works as on the original tag);
//! otherwise the text each assistant turn adds after the generation prompt, found by rendering
//! the conversation up to that turn.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::ChatError;

/// Which tokens of a conversation are training targets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainOn {
    /// Every assistant turn (or `{% generation %}` block).
    #[default]
    Assistant,
    /// The last assistant turn only.
    LastAssistant,
    /// Every token, as in pretraining.
    All,
}

/// Written where a `{% generation %}` block starts and ends; noncharacters, never in text.
const GENERATION_START: char = '\u{FDD0}';
const GENERATION_END: char = '\u{FDD1}';
/// The special tokens transformers passes to templates (its `special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];
/// The work one rendering may do, in minijinja's fuel: about one unit per instruction and per
/// 64 bytes of data created (output included), so about 4M instructions or 256 MB, some
/// hundred milliseconds. Real templates spend a few hundred units per message; a template that
/// loops without end or writes a huge output (a template comes with a tokenizer, from anyone)
/// stops there, and its conversation is a bad record, instead of hanging or exhausting memory.
const RENDER_FUEL: u64 = 1 << 22;
/// transformers copies a message's reasoning under all these names.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

pub struct ChatTemplate {
    source: String,
    env: Environment<'static>,
    has_generation_blocks: bool,
    special_tokens: Map<String, Json>,
    path: PathBuf,
}

/// A rendered conversation and the byte ranges of it that are trained on, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderedChat {
    pub text: String,
    pub trained: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// The chat template of the tokenizer at `tokenizer` (a `tokenizer.json` or its directory):
    /// `chat_template.jinja` beside it, else `tokenizer_config.json`'s `chat_template` (its
    /// `default` entry when it lists several); or the file `template`, when given.
    pub fn load(tokenizer: &Path, template: Option<&Path>) -> Result<Self, ChatError> {
        let dir = if tokenizer.is_dir() {
            tokenizer.to_owned()
        } else {
            tokenizer.parent().unwrap_or(Path::new(".")).to_owned()
        };
        let config_path = dir.join("tokenizer_config.json");
        let config = match fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| ChatError::Config {
                path: config_path.clone(),
                source,
            })?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Json::Null,
            Err(source) => {
                return Err(ChatError::Io {
                    path: config_path,
                    source,
                })
            }
        };
        let jinja_path = dir.join("chat_template.jinja");
        let (path, source) = match template {
            Some(path) => (path.to_owned(), read(path)?),
            None if jinja_path.is_file() => (jinja_path.clone(), read(&jinja_path)?),
            None => (
                config_path.clone(),
                configured_template(&config).ok_or(ChatError::NoTemplate { path: config_path })?,
            ),
        };
        let special_tokens = SPECIAL_TOKENS
            .iter()
            .filter_map(|&key| {
                let value = config.get(key)?;
                let text = value.as_str().or_else(|| value.get("content")?.as_str())?;
                Some((key.to_owned(), Json::String(text.to_owned())))
            })
            .collect();
        Self::new(&source, special_tokens, path)
    }

    /// The template `source`, given `special_tokens` (name to text); `path` names it in errors.
    pub fn new(
        source: &str,
        special_tokens: Map<String, Json>,
        path: PathBuf,
    ) -> Result<Self, ChatError> {
        let (marked, has_generation_blocks) = mark_generation_blocks(source);
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", marked)
            .map_err(|error| ChatError::Syntax {
                path: path.clone(),
                reason: describe(&error),
            })?;
        Ok(Self {
            source: source.to_owned(),
            env,
            has_generation_blocks,
            special_tokens,
            path,
        })
    }

    /// Where the template was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The template as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether `{% generation %}` blocks mark the trained text.
    pub fn has_generation_blocks(&self) -> bool {
        self.has_generation_blocks
    }

    /// The text of `messages` (a JSON array of message objects), as `apply_chat_template(
    /// messages, tokenize=False, add_generation_prompt=...)` gives it; or why it cannot be.
    pub fn render(&self, messages: &Json, add_generation_prompt: bool) -> Result<String, String> {
        let messages = checked_messages(messages)?;
        let (text, _) = self.render_marked(&messages, add_generation_prompt)?;
        Ok(text)
    }

    /// The text of `messages` and the bytes of it trained on under `train_on`, or why the
    /// conversation cannot be rendered.
    pub fn render_for_training(
        &self,
        messages: &Json,
        train_on: TrainOn,
    ) -> Result<RenderedChat, String> {
        let messages = checked_messages(messages)?;
        let (text, blocks) = self.render_marked(&messages, false)?;
        let mut trained = match train_on {
            TrainOn::All => std::iter::once(0..text.len()).collect(),
            _ if self.has_generation_blocks => blocks,
            _ => self.assistant_turns(&messages, &text)?,
        };
        if train_on == TrainOn::LastAssistant {
            trained.drain(..trained.len().saturating_sub(1));
        }
        trained.retain(|range| !range.is_empty());
        Ok(RenderedChat { text, trained })
    }

    /// The text each assistant turn adds after the generation prompt: the rendering of the
    /// turns before it with the prompt must prefix the rendering up to it, which must prefix
    /// `text`, or the turn has no place of its own in the conversation.
    fn assistant_turns(&self, messages: &[Json], text: &str) -> Result<Vec<Range<usize>>, String> {
        let mut turns = Vec::new();
        for (k, message) in messages.iter().enumerate() {
            if message.get("role").and_then(Json::as_str) != Some("assistant") {
                continue;
            }
            let (prompt, _) = self.render_marked(&messages[..k], true)?;
            let (through, _) = self.render_marked(&messages[..=k], false)?;
            if !through.starts_with(&prompt) || !text.starts_with(&through) {
                return Err(format!(
                    "{}: the template renders message {k} differently once later messages \
                     follow, so its tokens cannot be told apart; mark them with \
                     {{% generation %}} blocks",
                    self.path.display()
                ));
            }
            turns.push(prompt.len()..through.len());
        }
        Ok(turns)
    }

    /// Renders, and takes the generation markers out of the text: their byte ranges.
    fn render_marked(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<Range<usize>>), String> {
        let mut context = self.special_tokens.clone();
        context.insert("messages".to_owned(), Json::Array(messages.to_vec()));
        context.insert(
            "add_generation_prompt".to_owned(),
            Json::Bool(add_generation_prompt),
        );
        context.insert("tools".to_owned(), Json::Null);
        context.insert("documents".to_owned(), Json::Null);
        let template = self.env.get_template("chat").expect("added at creation");
        let marked = template
            .render(Value::from(minijinja::value::Serde(&context)))
            .map_err(|error| match error.kind() {
                ErrorKind::OutOfFuel => format!(
                    "the chat template exceeds its limit of {RENDER_FUEL} units of work per \
                     rendering (about as many instructions, or 64 bytes each of output and \
                     data): a loop without end or a huge output"
                ),
                _ => format!("the chat template fails: {}", describe(&error)),
            })?;
        if !self.has_generation_blocks {
            return Ok((marked, Vec::new()));
        }
        let mut text = String::with_capacity(marked.len());
        let mut blocks = Vec::new();
        let mut start = None;
        for c in marked.chars() {
            match (c, start) {
                (GENERATION_START, None) => start = Some(text.len()),
                (GENERATION_END, Some(begin)) => {
                    blocks.push(begin..text.len());
                    start = None;
                }
                (GENERATION_START | GENERATION_END, _) => {
                    return Err("the chat template nests {% generation %} blocks".to_owned())
                }
                _ => text.push(c),
            }
        }
        Ok((text, blocks))
    }
}

/// transformers' `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, not minijinja's HTML-safe compact form.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let invalid = |message: &str| Error::new(ErrorKind::InvalidOperation, message.to_owned());
    let indent = match indent.or(kwargs.get::<Option<Value>>("indent")?) {
        None => None,
        Some(value) if value.is_none() => None,
        Some(value) => match (value.as_i64(), value.as_str()) {
            (Some(width), _) => Some(" ".repeat(width.max(0) as usize)),
            (_, Some(text)) => Some(text.to_owned()),
            _ => return Err(invalid("tojson: indent must be an integer or a string")),
        },
    };
    let (item, key) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(separators) if separators.len() == 2 => (separators[0].clone(), separators[1].clone()),
        Some(_) => return Err(invalid("tojson: separators must be a pair")),
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let _ = kwargs.get::<Option<bool>>("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|error| invalid(&format!("tojson: {error}")))?;
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys,
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(out)
}

struct JsonStyle {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
}

impl JsonStyle {
    fn write(&self, value: &Json, level: usize, out: &mut String) {
        match value {
            Json::Array(items) if !items.is_empty() => {
                out.push('[');
                for (k, item) in items.iter().enumerate() {
                    self.separate(k, level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Json::Object(map) if !map.is_empty() => {
                let mut entries: Vec<_> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (k, (name, item)) in entries.into_iter().enumerate() {
                    self.separate(k, level + 1, out);
                    out.push_str(&Json::String(name.clone()).to_string());
                    out.push_str(&self.key);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
            scalar => out.push_str(&scalar.to_string()),
        }
    }

    fn separate(&self, k: usize, level: usize, out: &mut String) {
        if k > 0 {
            out.push_str(&self.item);
        }
        self.newline(level, out);
    }

    fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(level));
        }
    }
}

fn read(path: &Path) -> Result<String, ChatError> {
    fs::read_to_string(path).map_err(|source| ChatError::Io {
        path: path.to_owned(),
        source,
    })
}

/// `chat_template` of a tokenizer_config.json: a string, or a list of named templates.
fn configured_template(config: &Json) -> Option<String> {
    match config.get("chat_template")? {
        Json::String(template) => Some(template.clone()),
        Json::Array(templates) => templates
            .iter()
            .find(|entry| entry.get("name").and_then(Json::as_str) == Some("default"))?
            .get("template")?
            .as_str()
            .map(str::to_owned),
        _ => None,
    }
}

/// The error and what caused it, on one line.
fn describe(error: &Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The messages as transformers hands them to the template (keys holding null dropped, the
/// reasoning copied under each of its names), or what is wrong with them.
fn checked_messages(messages: &Json) -> Result<Vec<Json>, String> {
    let Json::Array(messages) = messages else {
        return Err("messages is not a list".to_owned());
    };
    if messages.is_empty() {
        return Err("messages is empty".to_owned());
    }
    messages
        .iter()
        .enumerate()
        .map(|(k, message)| {
            let Json::Object(message) = message else {
                return Err(format!("message {k} is not an object"));
            };
            let mut message: Map<String, Json> = message
                .iter()
                .filter(|(_, value)| !value.is_null())
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect();
            match message.get("role") {
                Some(Json::String(_)) => {}
                Some(_) => return Err(format!("message {k}: role is not a string")),
                None => return Err(format!("message {k} has no role")),
            }
            if let Some(content) = message.get("content") {
                if !content.is_string() {
                    return Err(format!("message {k}: content is not a string"));
                }
            }
            if contains_marker(&Json::Object(message.clone())) {
                return Err(format!(
                    "message {k} holds the noncharacter U+FDD0 or U+FDD1"
                ));
            }
            alias_reasoning(&mut message);
            Ok(Json::Object(message))
        })
        .collect()
}

/// `{"thinking": r, **message, "reasoning_content": r}`, as transformers writes it.
fn alias_reasoning(message: &mut Map<String, Json>) {
    let Some(reasoning) = REASONING_FIELDS
        .iter()
        .find_map(|field| message.get(*field))
        .cloned()
    else {
        return;
    };
    let mut aliased = Map::new();
    aliased.insert("thinking".to_owned(), reasoning.clone());
    aliased.extend(std::mem::take(message));
    aliased.insert("reasoning_content".to_owned(), reasoning);
    *message = aliased;
}

fn contains_marker(value: &Json) -> bool {
    match value {
        Json::String(text) => text.contains([GENERATION_START, GENERATION_END]),
        Json::Array(items) => items.iter().any(contains_marker),
        Json::Object(map) => map.iter().any(|(key, value)| {
            key.contains([GENERATION_START, GENERATION_END]) || contains_marker(value)
        }),
        _ => false,
    }
}

/// Replaces each `{% generation %}` / `{% endgeneration %}` tag (with any whitespace control)
/// by an `{% if true %}` block writing a marker, keeping the tag's whitespace control on the
/// block's outer tags. Returns the new source and whether it had any such tag.
fn mark_generation_blocks(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        match generation_tag(tag) {
            Some((length, left, name, right)) => {
                let marker = if name == "generation" {
                    GENERATION_START
                } else {
                    GENERATION_END
                };
                out.push_str(&format!(
                    "{{%{left} if true %}}{marker}{{% endif {right}%}}"
                ));
                rest = &tag[length..];
                found = true;
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    (out, found)
}

/// If `tag` starts with a generation tag: its length, left modifier, name and right modifier.
fn generation_tag(tag: &str) -> Option<(usize, &str, &str, &str)> {
    let inner = &tag[2..];
    let left = modifier(inner);
    let inner = inner[left.len()..].trim_start();
    let name = ["endgeneration", "generation"]
        .into_iter()
        .find(|name| inner.starts_with(name))?;
    let after_name = &inner[name.len()..];
    if after_name.starts_with(|c: char| c.is_alphanumeric() || c == '_') {
        return None;
    }
    let after = after_name.trim_start();
    let right = modifier(after);
    let after = after[right.len()..].strip_prefix("%}")?;
    Some((tag.len() - after.len(), left, name, right))
}

fn modifier(text: &str) -> &str {
    match text.as_bytes().first() {
        Some(b'-') => "-",
        Some(b'+') => "+",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_marker_blocks_keeping_whitespace_control() {
        let (source, found) = mark_generation_blocks(
            "a{%- generation %}b{% endgeneration -%}\nc{% if x %}{% endif %}",
        );
        assert!(found);
        assert_eq!(
            source,
            "a{%- if true %}\u{FDD0}{% endif %}b{% if true %}\u{FDD1}{% endif -%}\nc{% if x %}{% endif %}"
        );
        assert_eq!(
            mark_generation_blocks("{% generations %}").0,
            "{% generations %}"
        );
    }
}

//! A tokenizer's chat template (`chat_template.jinja` in its directory, else `chat_template` in its
//! `tokenizer_config.json`, as transformers reads them), rendered as
//! transformers' `apply_chat_template(..., tokenize=False)` renders it: Jinja with `trim_blocks`
//! and `lstrip_blocks`, the trailing newline of the template dropped, `raise_exception`, a
//! `tojson` that is Python's `json.dumps` (no HTML escaping), Python's string methods, and the
//! special tokens (`bos_token`, `eos_token`, ...) as variables beside `messages` and
//! `add_generation_prompt`.
use std::path::{Path, PathBuf};

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

/// The tokenizer's settings, and the file transformers writes its chat template to.
pub const CONFIG: &str = "tokenizer_config.json";
pub const JINJA: &str = "chat_template.jinja";

/// The special tokens transformers passes to a template (`special_tokens_map`).
const SPECIAL: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A tokenizer's `tokenizer_config.json`: its special tokens and its chat template, if any.
#[derive(Debug)]
pub struct TokenizerConfig {
    pub path: PathBuf,
    /// (name, text) of each special token the file sets.
    pub special: Vec<(&'static str, String)>,
    env: Option<Environment<'static>>,
}

impl TokenizerConfig {
    /// Reads the tokenizer directory `dir`; without the files, a config with no template and no
    /// special token.
    pub fn read(dir: &Path) -> Result<TokenizerConfig, String> {
        let path = dir.join(CONFIG);
        let mut config = TokenizerConfig { path: path.clone(), special: Vec::new(), env: None };
        let json: serde_json::Value = if path.is_file() {
            let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?
        } else {
            serde_json::Value::Null
        };
        for name in SPECIAL {
            // A token is its text, or an AddedToken written as {"content": ...}.
            let token = json.get(name).and_then(|v| v.as_str().or_else(|| v.get("content")?.as_str()));
            if let Some(t) = token {
                config.special.push((name, t.to_owned()));
            }
        }
        let jinja = dir.join(JINJA);
        let template = if jinja.is_file() {
            config.path = jinja.clone();
            std::fs::read_to_string(&jinja).map_err(|e| format!("cannot read {}: {e}", jinja.display()))?
        } else {
            match json.get("chat_template") {
                None | Some(serde_json::Value::Null) => return Ok(config),
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(_) => {
                    return Err(format!(
                        "{}: chat_template is not a string (a list of named templates is not read): give the \
                         template's text",
                        path.display()
                    ))
                }
            }
        };
        let parsed = environment(template)
            .map_err(|e| format!("{}: the chat template does not parse: {e}", config.path.display()))?;
        config.env = Some(parsed);
        Ok(config)
    }

    pub fn has_template(&self) -> bool {
        self.env.is_some()
    }

    /// The text of special token `name` (`"eos_token"`), if the file sets it.
    pub fn token(&self, name: &str) -> Option<&str> {
        self.special.iter().find(|(n, _)| *n == name).map(|(_, t)| t.as_str())
    }

    /// `messages` rendered by the chat template; the template's own error (a `raise_exception`,
    /// an undefined method) as its message.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, String> {
        let env = self.env.as_ref().ok_or_else(|| {
            format!(
                "{} has no chat_template (nor is there a {JINJA} beside it): messages are rendered by the tokenizer's \
                 chat template; add one, or give prompt/response pairs",
                self.path.display()
            )
        })?;
        let mut ctx: std::collections::BTreeMap<&str, Value> =
            self.special.iter().map(|(n, t)| (*n, Value::from(t.as_str()))).collect();
        ctx.insert("messages", Value::from(minijinja::value::Serde(messages)));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        let template = env.get_template(NAME).expect("added when read");
        template.render(ctx).map_err(|e| match e.detail() {
            Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_owned(),
            // The message and the template's line; `{:#}` would add a page of debug information.
            _ => e.to_string(),
        })
    }
}

const NAME: &str = "chat_template";

fn environment(template: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build()?);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_filter("tojson", tojson);
    env.add_template_owned(NAME, template)?;
    Ok(env)
}

/// Python's `json.dumps(x, ensure_ascii=False)`: separators ", " and ": ", a mapping's keys in
/// their order, nothing escaped beyond JSON's own.
fn tojson(value: Value) -> Result<Value, Error> {
    let mut out = String::new();
    python_json(&value, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn python_json(v: &Value, out: &mut String) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    let items = |v: &Value| v.try_iter().map(|i| i.collect::<Vec<Value>>());
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::String => out.push_str(&serde_json::Value::String(v.to_string()).to_string()),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in items(v)?.iter().enumerate() {
                out.push_str(if i > 0 { ", " } else { "" });
                python_json(item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in items(v)?.iter().enumerate() {
                out.push_str(if i > 0 { ", " } else { "" });
                out.push_str(&serde_json::Value::String(key.to_string()).to_string());
                out.push_str(": ");
                python_json(&v.get_item(key)?, out)?;
            }
            out.push('}');
        }
        other => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson cannot write a {other:?}"))),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(template: &str) -> TokenizerConfig {
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::json!({"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}});
        std::fs::write(dir.path().join(CONFIG), json.to_string()).unwrap();
        TokenizerConfig::read(dir.path()).unwrap()
    }

    fn msg(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_trims_them() {
        let t = config(
            "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\nU: {{ m.content.strip() }}\n  \
             {% else %}\nA: {{ m['content'] }}{{ eos_token }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt \
             %}A:{% endif %}\n",
        );
        let m = [msg("user", " hi "), msg("assistant", "hello")];
        assert_eq!(t.render(&m, false).unwrap(), "<s>U: hi\nA: hello</s>\n");
        assert_eq!(t.render(&m[..1], true).unwrap(), "<s>U: hi\nA:");
    }

    #[test]
    fn raise_exception_and_tojson_are_transformers_own() {
        let t = config("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok");
        assert_eq!(t.render(&[msg("system", "x")], false).unwrap_err(), "first must be user");
        let t = config("{{ messages[0] | tojson }} {{ [1, 2.5, none, true] | tojson }}");
        let want = r#"{"role": "user", "content": "<é>\n"} [1, 2.5, null, true]"#;
        assert_eq!(t.render(&[msg("user", "<é>\n")], false).unwrap(), want);
    }
}

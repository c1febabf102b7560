//! Instruction examples from a JSON Lines file: each line an object with `prompt` and `response`
//! strings, or with `messages` (a list of `{"role", "content"}`); other fields are left alone.
//! A line that is not JSON, or lacks the fields, is refused with the file and the line; a blank
//! line holds no example and is passed over.
use std::path::Path;

use serde_json::Value;

use super::template::Message;

/// What one line asks the model to learn.
#[derive(Debug, Clone, PartialEq)]
pub enum Example {
    /// The loss on `response` (and the end-of-sequence token after it), given `prompt`.
    Pair { prompt: String, response: String },
    /// A conversation rendered by the chat template; the loss on the assistant's messages.
    Chat(Vec<Message>),
}

/// An example and the line (from 1) of its file.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub line: usize,
    pub example: Example,
}

/// Every example of `path`, in the file's order.
pub fn read(path: &Path) -> Result<Vec<Line>, String> {
    let p = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {p} as UTF-8 text: {e}"))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let example = parse(line).map_err(|why| format!("{p}:{}: {why}", i + 1))?;
        out.push(Line { line: i + 1, example });
    }
    if out.is_empty() {
        return Err(format!("{p} holds no example: one JSON object a line, with prompt and response, or messages"));
    }
    Ok(out)
}

const FIELDS: &str = "give \"prompt\" and \"response\" (strings), or \"messages\" (a list of {\"role\", \"content\"})";

fn parse(line: &str) -> Result<Example, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("is not JSON ({e})"))?;
    let Value::Object(o) = v else { return Err(format!("is not a JSON object: {FIELDS}")) };
    let text = |key: &str| match o.get(key) {
        Some(Value::String(s)) => Ok(Some(s.clone())),
        None => Ok(None),
        Some(other) => Err(format!("\"{key}\" is {}, not a string", kind(other))),
    };
    match (text("prompt")?, text("response")?, o.get("messages")) {
        (Some(prompt), Some(response), None) => Ok(Example::Pair { prompt, response }),
        (None, None, Some(m)) => messages(m).map(Example::Chat),
        (_, _, Some(_)) => Err(format!("has both \"messages\" and prompt/response: {FIELDS}")),
        (Some(_), None, None) => Err(format!("has \"prompt\" but no \"response\": {FIELDS}")),
        (None, Some(_), None) => Err(format!("has \"response\" but no \"prompt\": {FIELDS}")),
        (None, None, None) => {
            let keys: Vec<&str> = o.keys().map(String::as_str).collect();
            Err(format!("has none of the fields (it has {}): {FIELDS}", list(&keys)))
        }
    }
}

fn messages(v: &Value) -> Result<Vec<Message>, String> {
    let Value::Array(items) = v else { return Err(format!("\"messages\" is {}, not a list", kind(v))) };
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let field = |key: &str| match m.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!("messages[{i}].{key} is {}, not a string", kind(other))),
            None => Err(format!("messages[{i}] has no \"{key}\": each message is {{\"role\", \"content\"}}")),
        };
        out.push(Message { role: field("role")?, content: field("content")? });
    }
    if !out.iter().any(|m| m.role == "assistant") {
        return Err(
            "has no message of role \"assistant\": the loss is on the assistant's messages, and there is none".into()
        );
    }
    Ok(out)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn list(keys: &[&str]) -> String {
    if keys.is_empty() {
        "no field".into()
    } else {
        keys.iter().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bad_line_is_refused_with_its_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        let cases = [
            ("{\"prompt\": \"a\"", "is not JSON"),
            ("[1]", "is not a JSON object"),
            ("{\"prompt\": \"a\"}", "has \"prompt\" but no \"response\""),
            ("{\"text\": \"a\"}", "has none of the fields (it has \"text\")"),
            ("{\"prompt\": 3, \"response\": \"b\"}", "\"prompt\" is a number, not a string"),
            ("{\"messages\": [{\"role\": \"user\"}]}", "messages[0] has no \"content\""),
            ("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", "has no message of role \"assistant\""),
        ];
        for (bad, why) in cases {
            std::fs::write(&path, format!("{{\"prompt\": \"p\", \"response\": \"r\"}}\n\n{bad}\n")).unwrap();
            let e = read(&path).unwrap_err();
            assert!(e.starts_with(&format!("{}:3: {why}", path.display())), "{e}");
        }
        std::fs::write(&path, "{\"prompt\": \"p\", \"response\": \"r\", \"id\": 7}\n").unwrap();
        let lines = read(&path).unwrap();
        assert_eq!(lines[0].example, Example::Pair { prompt: "p".into(), response: "r".into() });
    }
}

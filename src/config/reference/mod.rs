//! The configuration reference, generated from the pipeline file's JSON Schema: every key with its
//! type, its default and its doc comment. `runner schema --markdown` prints it as Markdown, the
//! page docs/reference/configuration.md, which a test keeps equal to this output; so the reference
//! cannot miss a key, and a key without a doc comment fails the tests.
mod markdown;

pub use markdown::{anchor, key_heading, markdown};

use serde_json::{Map, Value};

use super::schema::{with_every_key, Config};

/// The JSON Schema of pipeline files, generated from the serde types that read them. With
/// `every_default`, every key carries its default, those the run id leaves out while they hold it
/// included (the reference shows them all; `runner schema` keeps editors' schema as it was).
pub fn json_schema(every_default: bool) -> Value {
    let generate = || schemars::schema_for!(Config);
    let mut schema = if every_default { with_every_key(generate) } else { generate() };
    schema.insert("title".into(), "runner pipeline file".into());
    // Read by config::extends before the sections, so not a field of Config.
    let extends = serde_json::json!({
        "description": "A pipeline file this one builds on, relative to this file: its tables merge key by key \
                        under this file's, arrays and other values are replaced.",
        "type": "string"
    });
    let unset = serde_json::json!({
        "description": "Keys that the files this one extends set, removed before this file's values apply: \
                        each takes its default unless this file sets it (unset = [\"train.epochs\"] for a run \
                        in train.steps). On the command line, --set '~train.epochs' removes a key from every layer.",
        "type": "array",
        "items": { "type": "string" }
    });
    if let Some(Value::Object(properties)) = schema.get_mut("properties") {
        properties.insert("extends".into(), extends);
        properties.insert(super::extends::UNSET.into(), unset);
    }
    schema.to_value()
}

/// One key of a pipeline file, as the reference shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Key {
    /// The dotted path (`train.schedule.kind`; `wrap.model.conv[].channels` for a list of tables).
    pub path: String,
    /// Which `wrap.model.kind` the key belongs to, for the model's keys.
    pub kind: Option<String>,
    pub ty: String,
    /// The default as TOML, `None` where the key is absent unless set (its doc says what that
    /// means) or required.
    pub default: Option<String>,
    pub required: bool,
    pub doc: String,
    /// The allowed values of an enumeration, each with its doc comment.
    pub values: Vec<(String, String)>,
}

/// A table of the file and its keys.
#[derive(Debug, Clone)]
pub struct Section {
    /// `run`, `wrap.model`, `wrap.model.conv[]`; empty for the file's top level.
    pub table: String,
    pub kind: Option<String>,
    pub doc: String,
    pub keys: Vec<Key>,
}

/// Every section of the file, in the order of the types' fields (the order `config.toml` writes),
/// parents before their children.
pub fn sections() -> Vec<Section> {
    let schema = json_schema(true);
    let mut out = Vec::new();
    let walker = Walker {
        defs: schema.get("$defs").and_then(Value::as_object).cloned().unwrap_or_default(),
        order: declaration_order(),
    };
    walker.table("", None, "", object(&schema), &mut out);
    let order = &walker.order;
    let at = |path: &str| order.iter().position(|p| p == path).unwrap_or(usize::MAX);
    let top = |table: &str| at(table.split('.').next().unwrap_or_default());
    // A stable sort: a section keeps its place among the sections of its top-level table.
    out.sort_by_key(|s| if s.table.is_empty() { 0 } else { top(&s.table).saturating_add(1) });
    for s in &mut out {
        let key = |k: &Key| (at(&k.path), k.path.clone());
        s.keys.sort_by_key(key);
    }
    out
}

/// Every key's dotted path in the order its type declares it: read off the TOML that the
/// defaults serialize to (the schema's maps are sorted by name). Tables precede their keys.
fn declaration_order() -> Vec<String> {
    use super::schema::{Cnn, ConvBlock, EarlyStop, Mlp, Transformer};
    fn add(prefix: &str, text: &str, out: &mut Vec<String>) {
        let mut table = prefix.to_owned();
        for line in text.lines() {
            if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                table = if prefix.is_empty() { header.to_owned() } else { format!("{prefix}.{header}") };
                for (i, _) in table.match_indices('.').chain([(table.len(), "")]) {
                    out.push(table[..i].to_owned());
                }
            } else if let Some((key, _)) = line.split_once(" = ") {
                out.push(if table.is_empty() { key.to_owned() } else { format!("{table}.{key}") });
            }
        }
    }
    let toml_of = |v: &dyn Fn() -> Result<String, toml::ser::Error>| with_every_key(v).unwrap_or_default();
    let mut out = Vec::new();
    add("", &toml_of(&|| toml::to_string(&Config::default())), &mut out);
    add("wrap.model", &toml_of(&|| toml::to_string(&Mlp::default())), &mut out);
    add("wrap.model", &toml_of(&|| toml::to_string(&Cnn::default())), &mut out);
    add("wrap.model.conv[]", &toml_of(&|| toml::to_string(&ConvBlock::default())), &mut out);
    add("wrap.model", &toml_of(&|| toml::to_string(&Transformer::default())), &mut out);
    add("train.early_stop", &toml_of(&|| toml::to_string(&EarlyStop::default())), &mut out);
    out
}

/// Every key, in the order of the reference.
pub fn keys() -> Vec<Key> {
    sections().into_iter().flat_map(|s| s.keys).collect()
}

fn object(v: &Value) -> &Map<String, Value> {
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    v.as_object().unwrap_or_else(|| EMPTY.get_or_init(Map::new))
}

fn doc_of(v: &Value) -> String {
    v.get("description").and_then(Value::as_str).map(one_paragraph).unwrap_or_default()
}

/// A doc comment's lines, wrapped in the source, as one paragraph.
fn one_paragraph(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

struct Walker {
    defs: Map<String, Value>,
    /// Dotted paths in declaration order ([`declaration_order`]).
    order: Vec<String>,
}

impl Walker {
    /// `v` with its `$ref` followed, and an `anyOf` of one schema and null (an `Option`) opened;
    /// the bool says whether null was allowed.
    fn resolve(&self, v: &Value) -> (Value, bool) {
        if let Some(r) = v.get("$ref").and_then(Value::as_str) {
            let name = r.trim_start_matches("#/$defs/");
            let target = self.defs.get(name).cloned().unwrap_or(Value::Null);
            return (target, false);
        }
        if let Some(any) = v.get("anyOf").and_then(Value::as_array) {
            let some: Vec<&Value> =
                any.iter().filter(|s| s.get("type").and_then(Value::as_str) != Some("null")).collect();
            if some.len() == 1 && any.len() == 2 {
                return (self.resolve(some[0]).0, true);
            }
        }
        if let Some(Value::Array(types)) = v.get("type") {
            if types.iter().any(|t| t == "null") {
                let mut one = v.clone();
                let rest: Vec<Value> = types.iter().filter(|t| *t != "null").cloned().collect();
                one["type"] = if rest.len() == 1 { rest[0].clone() } else { Value::Array(rest) };
                return (one, true);
            }
        }
        (v.clone(), false)
    }

    fn is_table(v: &Value) -> bool {
        v.get("properties").is_some()
    }

    /// The variants of a tagged enum (`kind = "..."`), each an object naming its tag.
    fn tagged_variants(v: &Value) -> Option<Vec<(String, &Value)>> {
        let variants = v.get("oneOf")?.as_array()?;
        variants
            .iter()
            .map(|variant| {
                let kind = variant.get("properties")?.get("kind")?.get("const")?.as_str()?;
                Some((kind.to_owned(), variant))
            })
            .collect()
    }

    /// An enumeration's values and their docs (`"a" | "b"` or one `const` per documented variant).
    fn values(&self, v: &Value) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if let Some(e) = v.get("enum").and_then(Value::as_array) {
            out.extend(e.iter().map(|x| (toml_value(x), String::new())));
        }
        if let Some(c) = v.get("const") {
            out.push((toml_value(c), doc_of(v)));
        }
        for variant in v.get("oneOf").and_then(Value::as_array).into_iter().flatten() {
            out.extend(self.values(variant));
        }
        out
    }

    fn type_name(&self, v: &Value) -> String {
        let (v, _) = self.resolve(v);
        if !self.values(&v).is_empty() {
            return "string, one of the values below".into();
        }
        if let Some(any) = v.get("anyOf").and_then(Value::as_array) {
            return any.iter().map(|s| self.type_name(s)).collect::<Vec<_>>().join(" or ");
        }
        match v.get("type").and_then(Value::as_str) {
            Some("array") => {
                let items = v.get("items").map(|i| self.type_name(i)).unwrap_or_else(|| "values".into());
                match (v.get("minItems"), v.get("maxItems")) {
                    (Some(a), Some(b)) if a == b => format!("list of {a} {}", plural(&items)),
                    _ => format!("list of {}", plural(&items)),
                }
            }
            Some("integer") => {
                if v.get("minimum").and_then(Value::as_f64) == Some(0.0) {
                    "integer ≥ 0".into()
                } else {
                    "integer".into()
                }
            }
            Some("number") => "number".into(),
            Some("boolean") => "boolean".into(),
            Some("string") => "string".into(),
            Some("object") if Self::is_table(&v) => "table".into(),
            _ => "value".into(),
        }
    }

    fn table(&self, table: &str, kind: Option<&str>, doc: &str, schema: &Map<String, Value>, out: &mut Vec<Section>) {
        let index = out.len();
        out.push(Section { table: table.into(), kind: kind.map(Into::into), doc: doc.into(), keys: Vec::new() });
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut children = Vec::new();
        let path_of = |name: &str| if table.is_empty() { name.to_owned() } else { format!("{table}.{name}") };
        // In declaration order, whatever order the schema's map keeps (serde_json's depends on
        // its features), so that the page is the same from every build.
        let mut properties: Vec<(&String, &Value)> =
            schema.get("properties").map(object).into_iter().flatten().collect();
        properties.sort_by_key(|(name, _)| {
            let path = path_of(name);
            (self.order.iter().position(|p| *p == path).unwrap_or(usize::MAX), path)
        });
        for (name, property) in properties {
            if kind.is_some() && name == "kind" {
                continue;
            }
            let path = path_of(name);
            let (target, _) = self.resolve(property);
            let own_doc = doc_of(property);
            let doc = if own_doc.is_empty() { doc_of(&target) } else { own_doc };
            if let Some(variants) = Self::tagged_variants(&target) {
                children.push((path.clone(), doc.clone(), target.clone(), variants.len()));
                let kinds: Vec<String> = variants.iter().map(|(k, _)| format!("\"{k}\"")).collect();
                let default = property.get("default").and_then(|d| d.get("kind")).map(toml_value);
                out[index].keys.push(Key {
                    path: format!("{path}.kind"),
                    kind: None,
                    ty: format!("string, one of {}", kinds.join(", ")),
                    default,
                    required: false,
                    doc: format!("{doc} The other keys of the table are the kind's own (below)."),
                    values: variants.iter().map(|(k, v)| (format!("\"{k}\""), doc_of(v))).collect(),
                });
                continue;
            }
            if Self::is_table(&target) {
                children.push((path, doc, target, 0));
                continue;
            }
            let item = target.get("items").map(|i| self.resolve(i).0);
            if let Some(item) = item.filter(Self::is_table) {
                children.push((format!("{path}[]"), doc_of(&item), item, 0));
            }
            out[index].keys.push(Key {
                path,
                kind: kind.map(Into::into),
                ty: self.type_name(property),
                default: property.get("default").filter(|d| !d.is_null()).map(toml_value),
                required: required.contains(&name.as_str()),
                doc,
                values: self.values(&target),
            });
        }
        for (path, doc, target, variants) in children {
            if variants > 0 {
                for (k, variant) in Self::tagged_variants(&target).unwrap_or_default() {
                    self.table(&path, Some(&k), &doc_of(variant), object(variant), out);
                }
            } else {
                self.table(&path, None, &doc, object(&target), out);
            }
        }
    }
}

fn plural(s: &str) -> String {
    match s {
        "integer ≥ 0" => "integers ≥ 0".into(),
        "number" | "string" | "boolean" | "table" | "integer" => format!("{s}s"),
        s if s.starts_with("list of ") => format!("lists of {}", &s["list of ".len()..]),
        s => s.into(),
    }
}

/// A JSON value as TOML writes it.
pub fn toml_value(v: &Value) -> String {
    match v {
        Value::Null => "absent".into(),
        Value::String(s) => format!("{s:?}"),
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                if f.fract() == 0.0 && f.abs() < 1e15 {
                    format!("{f:.1}")
                } else {
                    format!("{f}")
                }
            } else {
                n.to_string()
            }
        }
        Value::Bool(b) => b.to_string(),
        Value::Array(a) => format!("[{}]", a.iter().map(toml_value).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => {
            // Sorted: serde_json's map keeps insertion order in some builds and not in others.
            let mut fields: Vec<(&String, &Value)> = o.iter().collect();
            fields.sort_by_key(|(k, _)| *k);
            format!(
                "{{ {} }}",
                fields.iter().map(|(k, v)| format!("{k} = {}", toml_value(v))).collect::<Vec<_>>().join(", ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_has_a_doc_comment_and_a_type() {
        let undocumented: Vec<String> =
            keys().into_iter().filter(|k| k.doc.is_empty() || k.ty == "value").map(|k| key_heading(&k)).collect();
        assert!(
            undocumented.is_empty(),
            "keys without a doc comment (or a type) in src/config/schema/: {undocumented:?}"
        );
    }

    /// The keys and defaults of `Config::default()`, serialized with every key (what config.toml
    /// writes), each model kind's and the optional tables' included: the reference lists each one,
    /// with that default.
    #[test]
    fn the_reference_lists_every_key_of_the_default_configuration_with_its_default() {
        use crate::config::schema::{Cnn, EarlyStop, Mlp, Transformer};
        let mut expected = Vec::new();
        let flat = |prefix: &str, kind: Option<&str>, v: Value, out: &mut Vec<(String, Option<String>, Value)>| {
            fn go(prefix: &str, kind: Option<&str>, v: &Value, out: &mut Vec<(String, Option<String>, Value)>) {
                for (k, v) in object(v) {
                    let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    let is_model = path == "wrap.model";
                    match v {
                        Value::Object(_) if !is_model => go(&path, kind, v, out),
                        Value::Object(_) => {}
                        _ if kind.is_some() && k == "kind" => {}
                        _ => out.push((path, kind.map(Into::into), v.clone())),
                    }
                }
            }
            go(prefix, kind, &v, out)
        };
        let every = |v: &dyn erased::Ser| with_every_key(|| v.to_json());
        flat("", None, every(&Config::default()), &mut expected);
        flat("wrap.model", Some("mlp"), every(&Mlp::default()), &mut expected);
        flat("wrap.model", Some("cnn"), every(&Cnn::default()), &mut expected);
        flat("wrap.model", Some("transformer"), every(&Transformer::default()), &mut expected);
        flat("train.early_stop", None, every(&EarlyStop::default()), &mut expected);
        flat("wrap.model.conv[]", Some("cnn"), every(&crate::config::schema::ConvBlock::default()), &mut expected);
        let keys = keys();
        let mut wrong = Vec::new();
        for (path, kind, value) in expected {
            // Within a kind, the keys of the conv blocks carry the kind of their table.
            let found = keys.iter().find(|k| k.path == path && (k.kind == kind || path.contains("[]")));
            let default = Some(toml_value(&value)).filter(|_| !value.is_null());
            match found {
                None => wrong.push(format!("{path} ({kind:?}) is missing")),
                Some(k) if k.default != default => {
                    wrong.push(format!("{path}: the reference says {:?}, the default is {default:?}", k.default))
                }
                _ => {}
            }
        }
        let model_kind = keys.iter().find(|k| k.path == "wrap.model.kind").map(|k| k.default.clone());
        if model_kind != Some(Some("\"mlp\"".into())) {
            wrong.push(format!("wrap.model.kind: the reference says {model_kind:?}, the default is \"mlp\""));
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
        assert!(keys.iter().any(|k| k.path == "wrap.model.path" && k.required), "torchscript's path is required");
    }

    mod erased {
        pub trait Ser {
            fn to_json(&self) -> serde_json::Value;
        }
        impl<T: serde::Serialize> Ser for T {
            fn to_json(&self) -> serde_json::Value {
                serde_json::to_value(self).expect("a default serializes")
            }
        }
    }

    #[test]
    fn anchors_are_githubs() {
        assert_eq!(anchor("`[wrap.model]` with `kind = \"cnn\"`"), "wrapmodel-with-kind--cnn");
        assert_eq!(anchor("`run.seed`"), "runseed");
    }
}

//! Instruction examples from a parquet file: string columns `prompt` and `response`, or a
//! `messages` column (a list of structs with string fields `role` and `content`), or all three
//! (each row then a pair or a conversation, the other columns null); other columns are left
//! alone. A row is what a JSON Lines line is, a null cell what an absent field is: a row that is
//! neither a pair nor a conversation, or has a null inside its messages, is refused with the file
//! and the row (from 1); a column of the wrong type, or a file that is not parquet, with the file.
//!
//! The columns are read as arrow arrays (polars-parquet) rather than a polars DataFrame, whose
//! list-of-struct columns need polars' `dtype-struct` feature.
use std::path::Path;

use polars::io::parquet::read::_internal::to_deserializer;
use polars_arrow::array::{Array, ListArray, StructArray, Utf8Array, Utf8ViewArray};
use polars_arrow::datatypes::{ArrowDataType, ArrowSchema, Field};
use polars_buffer::Buffer;
use polars_parquet::read::{infer_schema, read_metadata, FileMetadata};

use super::jsonl::{Example, Line};
use super::template::Message;

const COLUMNS: &str = "give string columns \"prompt\" and \"response\", or a column \"messages\" (a list of structs \
                       with string fields \"role\" and \"content\")";

/// Every example of `path`, in the file's order; `line` is the row, from 1.
pub fn read(path: &Path) -> Result<Vec<Line>, String> {
    let p = path.display();
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {p}: {e}"))?;
    let not_parquet = |e: &dyn std::fmt::Display| {
        format!("{p} is not a parquet file ({e}); a load.path ending in .parquet is read as parquet, any other as JSON Lines")
    };
    let meta = read_metadata(&mut std::io::Cursor::new(&bytes)).map_err(|e| not_parquet(&e))?;
    let schema = infer_schema(&meta).map_err(|e| not_parquet(&e))?;
    let (pair, chat) = columns(&schema).map_err(|why| format!("{p}: {why}"))?;
    let buffer = Buffer::from(bytes);
    let mut out = Vec::with_capacity(meta.num_rows);
    for group in 0..meta.row_groups.len() {
        let column = |name: &str| {
            let field = schema.get(name).expect("a column of the schema").clone();
            arrays(&meta, group, &buffer, field).map_err(|e| format!("cannot read column \"{name}\" of {p}: {e}"))
        };
        let prompts = pair.then(|| column("prompt").map(|a| strings(&*a))).transpose()?;
        let responses = pair.then(|| column("response").map(|a| strings(&*a))).transpose()?;
        let messages = chat.then(|| column("messages")).transpose()?;
        let rows = meta.row_groups[group].num_rows();
        for r in 0..rows {
            let line = out.len() + 1;
            let cell = |c: &Option<Vec<Option<String>>>| c.as_ref().and_then(|c| c[r].clone());
            let example = messages
                .as_deref()
                .map(|m| conversation(m, r))
                .transpose()
                .and_then(|c| example(cell(&prompts), cell(&responses), c.flatten(), (pair, chat)))
                .map_err(|why| format!("{p} row {line}: {why}"))?;
            out.push(Line { line, example });
        }
    }
    if out.is_empty() {
        return Err(format!("{p} holds no example: it has no row; {COLUMNS}"));
    }
    Ok(out)
}

/// Whether the file has the pair columns and the messages column; a missing or mistyped column
/// refused.
fn columns(schema: &ArrowSchema) -> Result<(bool, bool), String> {
    let text = |name: &str| match schema.get(name) {
        None => Ok(false),
        Some(f) if is_string(f.dtype()) => Ok(true),
        Some(f) => Err(format!("column \"{name}\" is {:?}, not strings: {COLUMNS}", f.dtype())),
    };
    let (prompt, response) = (text("prompt")?, text("response")?);
    let chat = match schema.get("messages") {
        None => false,
        Some(f) if is_messages(f.dtype()) => true,
        Some(f) => {
            return Err(format!("column \"messages\" is {:?}, not a list of {{role, content}}: {COLUMNS}", f.dtype()))
        }
    };
    match (prompt, response, chat) {
        (true, false, _) => Err(format!("has a column \"prompt\" but no column \"response\": {COLUMNS}")),
        (false, true, _) => Err(format!("has a column \"response\" but no column \"prompt\": {COLUMNS}")),
        (false, false, false) => {
            let names: Vec<String> = schema.iter_names().map(|n| format!("\"{n}\"")).collect();
            let has = if names.is_empty() { "no column".into() } else { names.join(", ") };
            Err(format!("has none of the columns (it has {has}): {COLUMNS}"))
        }
        (pair, _, chat) => Ok((pair, chat)),
    }
}

fn is_string(t: &ArrowDataType) -> bool {
    matches!(t, ArrowDataType::Utf8 | ArrowDataType::LargeUtf8 | ArrowDataType::Utf8View)
}

fn is_messages(t: &ArrowDataType) -> bool {
    let (ArrowDataType::List(item) | ArrowDataType::LargeList(item)) = t else { return false };
    let ArrowDataType::Struct(fields) = item.dtype() else { return false };
    let string = |name: &str| fields.iter().any(|f| f.name.as_str() == name && is_string(f.dtype()));
    string("role") && string("content")
}

/// Column `field` of row group `group`, as one array.
fn arrays(meta: &FileMetadata, group: usize, bytes: &Buffer<u8>, field: Field) -> Result<Box<dyn Array>, String> {
    let chunks = meta.row_groups[group].columns_under_root_iter(&field.name).ok_or("no column chunk")?;
    let chunks = chunks
        .map(|c| {
            let r = c.byte_range();
            (c, bytes.clone().sliced(r.start as usize..r.end as usize))
        })
        .collect();
    let (arrays, _) = to_deserializer(chunks, field, None).map_err(|e| e.to_string())?;
    let mut arrays = arrays.into_iter();
    match (arrays.next(), arrays.next()) {
        (Some(a), None) => Ok(a),
        _ => Err("not one array a row group".into()),
    }
}

/// A string array's cells, `None` where null.
fn strings(a: &dyn Array) -> Vec<Option<String>> {
    let own = |v: Option<&str>| v.map(str::to_owned);
    let any = a.as_any();
    if let Some(a) = any.downcast_ref::<Utf8ViewArray>() {
        a.iter().map(own).collect()
    } else if let Some(a) = any.downcast_ref::<Utf8Array<i64>>() {
        a.iter().map(own).collect()
    } else if let Some(a) = any.downcast_ref::<Utf8Array<i32>>() {
        a.iter().map(own).collect()
    } else {
        unreachable!("a column checked to be strings is {:?}", a.dtype())
    }
}

/// Row `r` of the messages column: `None` where null.
fn conversation(a: &dyn Array, r: usize) -> Result<Option<Vec<Message>>, String> {
    if a.is_null(r) {
        return Ok(None);
    }
    let ((start, end), items) = if let Some(l) = a.as_any().downcast_ref::<ListArray<i64>>() {
        (l.offsets().start_end(r), l.values())
    } else if let Some(l) = a.as_any().downcast_ref::<ListArray<i32>>() {
        (l.offsets().start_end(r), l.values())
    } else {
        unreachable!("a column checked to be a list is {:?}", a.dtype())
    };
    let items = items.as_any().downcast_ref::<StructArray>().expect("a list of structs");
    // This row's messages of a field.
    let field = |name: &str| {
        let i = items.fields().iter().position(|f| f.name.as_str() == name).expect("a field checked");
        strings(&*items.values()[i].sliced(start, end - start))
    };
    let (role, content) = (field("role"), field("content"));
    let mut out = Vec::with_capacity(end - start);
    for (k, j) in (start..end).enumerate() {
        if items.is_null(j) {
            return Err(format!("messages[{k}] is null: each message is {{role, content}}"));
        }
        let text = |v: &[Option<String>], key: &str| {
            v[k].clone().ok_or_else(|| format!("messages[{k}].{key} is null, not a string"))
        };
        out.push(Message { role: text(&role, "role")?, content: text(&content, "content")? });
    }
    Ok(Some(out))
}

/// A row's example from its cells, as a JSON Lines line's from its fields.
fn example(
    prompt: Option<String>,
    response: Option<String>,
    messages: Option<Vec<Message>>,
    (pair, chat): (bool, bool),
) -> Result<Example, String> {
    match (prompt, response, messages) {
        (Some(prompt), Some(response), None) => Ok(Example::Pair { prompt, response }),
        (None, None, Some(m)) => {
            if !m.iter().any(|m| m.role == "assistant") {
                return Err(
                    "has no message of role \"assistant\": the loss is on the assistant's messages, and there \
                            is none"
                        .into(),
                );
            }
            Ok(Example::Chat(m))
        }
        (_, _, Some(_)) => {
            Err(format!("has both \"messages\" and prompt/response (one of them must be null): {COLUMNS}"))
        }
        (Some(_), None, None) => Err("has \"prompt\" but its \"response\" is null".into()),
        (None, Some(_), None) => Err("has \"response\" but its \"prompt\" is null".into()),
        (None, None, None) => Err(match (pair, chat) {
            (true, true) => "\"prompt\", \"response\" and \"messages\" are all null: give a pair or messages".into(),
            (true, false) => "\"prompt\" and \"response\" are null".into(),
            _ => "\"messages\" is null".into(),
        }),
    }
}

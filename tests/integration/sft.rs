//! Supervised fine-tuning data (`load.source = "instructions"`) against transformers and TRL's
//! masking (`benches/reference/sft_twin.py`): on the instruction set and chat-template tokenizer
//! that `scripts/instructions.py` generates, every example renders byte for byte as
//! `tokenizer.apply_chat_template` renders it, with the same ids and the same tokens in the loss
//! as the completion-only collator's labels; a real run's first loss on a tiny Llama equals
//! transformers' masked loss (`model(input_ids, labels=labels).loss` per example, averaged), and
//! its `runner export --hf` tokenizes every example as the data's tokenizer does; packed into
//! windows (`load.packing`), the loss is each example's alone (a block-diagonal mask and positions
//! from 0 per example); and
//! bad lines and templates are refused with the file and the line.
use crate::common;

use std::path::Path;
use std::process::Command;

use common::{assert_ok, reference_python, run, text, write};

/// One step on all 48 training examples, in the file's order: the first loss is the initial
/// model's masked loss over them. The loss test cuts the examples to 48 + 1 tokens.
const PIPELINE: &str = r#"
[run]
name = "sft"
seed = 0
timeout_s = 60
threads_per_rank = 1

[load]
source = "instructions"
path = "data/train.jsonl"
validation_path = "data/val.jsonl"

[normalize]
method = "none"

[shard]
shuffle = false

[wrap]
init = "model"

[wrap.model]
kind = "transformer"
seq_len = 64

[train]
epochs = 1
batch_size = 48
optimizer = "adamw"
lr = 1e-3
"#;

/// Runs a script of the repository with the reference Python in `dir`; its stdout.
fn python(dir: &Path, path: &str, args: &[&str]) -> String {
    let o = Command::new(reference_python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .current_dir(dir)
        .output()
        .expect("python");
    let (out, err) = text(&o);
    assert!(o.status.success(), "{path} {args:?} failed:\n{out}\n{err}");
    out
}

/// The generated instruction set and its tokenizer in `dir/data`, a tiny Llama in `dir/model`,
/// the pipeline in `dir`.
fn setup(dir: &Path) {
    python(dir, "scripts/instructions.py", &["--out", "data", "--train", "48", "--val", "8"]);
    python(dir, "scripts/tiny_llama.py", &["make", "--out", "model", "--vocab", "320", "--positions", "64"]);
    write(dir, "sft.toml", PIPELINE);
}

/// The examples `runner data` shows: (text, ids, counted) each.
fn shown(out: &str) -> Vec<(String, Vec<u32>, Vec<bool>)> {
    let field = |line: &str, name: &str| line.trim_start().strip_prefix(name).map(|v| v.trim().to_owned());
    // A text: the lines after "  │", each less one space, joined by newlines.
    let framed = |lines: &[&str]| -> (String, usize) {
        let body: Vec<&str> = lines.iter().take_while(|l| l.starts_with("  │")).map(|l| &l[5..]).collect();
        (body.iter().map(|l| l.strip_prefix(' ').unwrap_or(l)).collect::<Vec<_>>().join("\n"), body.len())
    };
    let mut examples = Vec::new();
    let lines: Vec<&str> = out.lines().collect();
    for (i, l) in lines.iter().enumerate().filter(|(_, l)| l.starts_with("example ")) {
        assert!(l.contains("data/train.jsonl:") && lines[i + 1] == "  text:", "{l}");
        let (text, n) = framed(&lines[i + 2..]);
        let ids = field(lines[i + 2 + n], "ids:").unwrap().split(' ').map(|v| v.parse().unwrap()).collect();
        let counted = field(lines[i + 3 + n], "in the loss:").unwrap().chars().map(|c| c == '1').collect();
        examples.push((text, ids, counted));
    }
    examples
}

#[test]
fn examples_render_as_transformers_and_mask_as_the_completion_only_collator() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let o = run(&["data", "sft.toml", "--rows", "1000"], dir.path());
    assert_ok(&o);
    let ours = shown(&text(&o).0);
    let twin: serde_json::Value = serde_json::from_str(&python(
        dir.path(),
        "benches/reference/sft_twin.py",
        &["render", "data", "data/train.jsonl"],
    ))
    .unwrap();
    let twin = twin.as_array().unwrap();
    assert_eq!(ours.len(), 48);
    assert_eq!(twin.len(), 48);
    let mut turns = 0;
    for (k, ((text, ids, counted), t)) in ours.iter().zip(twin).enumerate() {
        assert_eq!(text, t["text"].as_str().unwrap(), "example {}: the rendering", k + 1);
        let want: Vec<u32> = t["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(ids, &want, "example {}: the ids", k + 1);
        let want: Vec<bool> = t["counted"].as_array().unwrap().iter().map(|v| v.as_bool().unwrap()).collect();
        assert_eq!(counted, &want, "example {}: the tokens in the loss", k + 1);
        turns += text.matches("<|assistant|>").count().saturating_sub(1);
    }
    // The set holds pairs, system messages and conversations of two turns.
    assert!(turns >= 10, "{turns} second turns");
    assert!(ours.iter().any(|e| e.0.contains("<|system|>")) && ours.iter().any(|e| e.0.starts_with("Question:")));
}

#[test]
fn the_first_loss_is_transformers_masked_loss() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let cut = ["--set", "wrap.model.seq_len=48", "--set", "load.too_long=\"truncate\""];
    let o = run(&[&["run", "sft.toml", "--out", "results"][..], &cut].concat(), dir.path());
    assert_ok(&o);
    let trace = common::trace(&dir.path().join("results"));
    let ours = trace.column("train_loss").unwrap().f64().unwrap().get(0).unwrap();
    let args = ["loss", "model", "data", "data/train.jsonl", "--examples", "48", "--seq-len", "48"];
    let twin: serde_json::Value =
        serde_json::from_str(&python(dir.path(), "benches/reference/sft_twin.py", &args)).unwrap();
    let theirs = twin["loss"].as_f64().unwrap();
    assert!((ours - theirs).abs() < 1e-5, "runner {ours}, transformers {theirs}");
    // Some examples were cut, and the plan said how many.
    assert!(text(&o).0.contains("cut to seq_len + 1 = 49 tokens"), "{}", text(&o).0);
    // The exported model's tokenizer has the chat template and the special tokens of the data's.
    assert_ok(&run(&["export", "results", "--hf", "hf"], dir.path()));
    let args = ["exported", "hf", "data", "data/train.jsonl"];
    let same: serde_json::Value =
        serde_json::from_str(&python(dir.path(), "benches/reference/sft_twin.py", &args)).unwrap();
    assert_eq!(same["same"], same["examples"], "{same}");
    assert_eq!(same["eos"], serde_json::json!([4, 4, 4]), "{same}");
}

#[test]
fn packed_windows_give_transformers_loss_of_each_example_alone() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    // The twin's windows (each a mean over its examples' counted targets, every example run
    // alone): one step over all of them.
    let args = ["loss", "model", "data", "data/train.jsonl", "--examples", "48", "--seq-len", "64", "--packed"];
    let twin: serde_json::Value =
        serde_json::from_str(&python(dir.path(), "benches/reference/sft_twin.py", &args)).unwrap();
    let windows = twin["losses"].as_array().unwrap().len();
    assert!(windows < 40, "{windows} windows for 48 examples: several a window");
    let batch = format!("train.batch_size={windows}");
    let o = run(&["run", "sft.toml", "--out", "results", "--set", "load.packing=true", "--set", &batch], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains(&format!("packed into {windows} windows of seq_len 64")), "{}", text(&o).0);
    let trace = common::trace(&dir.path().join("results"));
    let ours = trace.column("train_loss").unwrap().f64().unwrap().get(0).unwrap();
    let theirs = twin["loss"].as_f64().unwrap();
    assert!((ours - theirs).abs() < 1e-5, "runner {ours}, transformers {theirs}");
    // Not under a pipeline, whose later stages cannot tell the examples apart.
    let o =
        run(&["validate", "sft.toml", "--set", "load.packing=true", "--set", "wrap.strategy=\"pipeline\""], dir.path());
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).1.contains("`load.packing` (--set load.packing=true): is not built for wrap.strategy"),
        "{}",
        text(&o).1
    );
}

#[test]
fn bad_lines_and_templates_are_refused_with_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let p = dir.path();
    let good = std::fs::read_to_string(p.join("data/train.jsonl")).unwrap();
    let first_two: String = good.lines().take(2).map(|l| format!("{l}\n")).collect();
    let cases = [
        ("{\"prompt\": \"x\",\n", "data/train.jsonl:3: is not JSON"),
        ("{\"text\": \"x\"}\n", "data/train.jsonl:3: has none of the fields (it has \"text\")"),
        (
            "{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}, {\"role\": \"assistant\", \"content\": \"y\"}]}\n",
            "data/train.jsonl:3: unknown role: tool",
        ),
        (
            &format!("{{\"prompt\": \"x\", \"response\": \"{}\"}}\n", "one two ".repeat(40)),
            "data/train.jsonl:3: the example is",
        ),
    ];
    for (line, want) in cases {
        std::fs::write(p.join("data/train.jsonl"), format!("{first_two}{line}")).unwrap();
        let o = run(&["validate", "sft.toml"], p);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{line}\n{out}\n{err}");
        assert!(err.contains(want), "{want}\n{err}");
    }
    // Cut instead of refused, and counted.
    let o = run(&["validate", "sft.toml", "--set", "load.too_long=\"truncate\"", "--set", "train.batch_size=1"], p);
    assert_ok(&o);
    assert!(text(&o).0.contains("1 cut to seq_len + 1 = 65 tokens (load.too_long = \"truncate\")"), "{}", text(&o).0);
    // A prompt that fills the context leaves nothing to learn: refused, not skipped.
    let long = format!("{{\"prompt\": \"{}\", \"response\": \"y\"}}\n", "one two ".repeat(40));
    std::fs::write(p.join("data/train.jsonl"), format!("{first_two}{long}")).unwrap();
    let o = run(&["validate", "sft.toml", "--set", "load.too_long=\"truncate\""], p);
    assert!(text(&o).1.contains("data/train.jsonl:3: no response token within its first 65 tokens"), "{}", text(&o).1);
    // A template that raises for every conversation.
    std::fs::write(p.join("data/train.jsonl"), &good).unwrap();
    let config = std::fs::read_to_string(p.join("data/tokenizer_config.json")).unwrap();
    let broken: serde_json::Value = serde_json::from_str(&config).unwrap();
    let mut broken = broken.as_object().unwrap().clone();
    broken.insert("chat_template".into(), "{{ raise_exception('this template renders nothing') }}".into());
    std::fs::write(p.join("data/tokenizer_config.json"), serde_json::to_string(&broken).unwrap()).unwrap();
    let o = run(&["validate", "sft.toml"], p);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("data/train.jsonl:2: this template renders nothing"), "{}", text(&o).1);
}

/// Writes parquet files with pyarrow from JSON (`{"name": {"columns": {column: type},
/// "rows": [...]}}`, a type "string", "int" or "messages"), in row groups of 20 rows; a name
/// whose value is a string gets that text as it is (a file that is not parquet).
const TO_PARQUET: &str = r#"
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
types = {"string": pa.string(), "int": pa.int64(),
         "messages": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))}
for name, t in json.load(open(sys.argv[1])).items():
    if isinstance(t, str):
        open(name, "w").write(t)
        continue
    schema = pa.schema([(c, types[k]) for c, k in t["columns"].items()])
    pq.write_table(pa.Table.from_pylist(t["rows"], schema=schema), name, row_group_size=20)
"#;

fn to_parquet(dir: &Path, files: serde_json::Value) {
    write(dir, "to_parquet.json", &files.to_string());
    let o = Command::new(reference_python())
        .args(["-c", TO_PARQUET, "to_parquet.json"])
        .current_dir(dir)
        .output()
        .expect("python");
    assert!(o.status.success(), "{}", text(&o).1);
}

/// The JSON Lines file `path` of `dir` as rows, and the columns of every shape.
fn jsonl_rows(dir: &Path, path: &str) -> serde_json::Value {
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(dir.join(path))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let columns = serde_json::json!({"prompt": "string", "response": "string", "messages": "messages"});
    serde_json::json!({"columns": columns, "rows": rows})
}

/// What a command printed, with the parquet file named as the JSON Lines one and the run id
/// (a digest of the files) left out; the plan's table (`table`) without its column widths.
fn as_jsonl(out: &str, table: bool) -> Vec<String> {
    out.replace(".parquet row ", ".jsonl:")
        .replace(".parquet", ".jsonl")
        .lines()
        .filter(|l| !l.starts_with("run sft ("))
        .map(|l| if table { l.split_whitespace().collect::<Vec<_>>().join(" ") } else { l.to_owned() })
        .collect()
}

#[test]
fn parquet_instructions_give_what_the_same_jsonl_gives() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let p = dir.path();
    let files = serde_json::json!({
        "data/train.parquet": jsonl_rows(p, "data/train.jsonl"),
        "data/val.parquet": jsonl_rows(p, "data/val.jsonl"),
    });
    to_parquet(p, files);
    let parquet = ["--set", "load.path=\"data/train.parquet\"", "--set", "load.validation_path=\"data/val.parquet\""];
    let both = |args: &[&str], table: bool| {
        let (j, q) = (run(args, p), run(&[args, &parquet[..]].concat(), p));
        assert_ok(&j);
        assert_ok(&q);
        // runner data names an example by its row.
        let named = if table { "data/train.parquet" } else { "example 1 (data/train.parquet row 1)" };
        assert!(text(&q).0.contains(named), "{}", text(&q).0);
        (as_jsonl(&text(&j).0, table), as_jsonl(&text(&q).0, table))
    };
    // The same examples, texts, ids and masks; the same plan counts.
    let (j, q) = both(&["data", "sft.toml", "--rows", "1000"], false);
    assert_eq!(j, q);
    assert_eq!(shown(&j.join("\n")).len(), 48);
    let (j, q) = both(&["validate", "sft.toml"], true);
    assert_eq!(j, q);
    assert!(j.iter().any(|l| l.starts_with("instructions, training: 48 examples")), "{j:?}");
    // The same losses, step after step: 3 steps an epoch, 2 epochs.
    let train = ["run", "sft.toml", "--set", "train.batch_size=16", "--set", "train.epochs=2", "--out"];
    let (j, q) = (run(&[&train[..], &["rj"]].concat(), p), run(&[&train[..], &["rq"], &parquet[..]].concat(), p));
    assert_ok(&j);
    assert_ok(&q);
    for column in ["train_loss", "val_loss"] {
        let losses = |run: &str| -> Vec<Option<f64>> {
            common::trace(&p.join(run)).column(column).unwrap().f64().unwrap().iter().collect()
        };
        assert_eq!(losses("rj").len(), 2);
        assert_eq!(losses("rj"), losses("rq"), "{column}");
    }
}

#[test]
fn bad_parquet_rows_are_refused_with_the_file_and_row() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let p = dir.path();
    let pair = serde_json::json!({"prompt": "Question: What is 1 plus 2?\nAnswer:", "response": " 3."});
    let talk = |content: serde_json::Value| serde_json::json!({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "3."}]});
    let (pairs, chats) =
        (serde_json::json!({"prompt": "string", "response": "string"}), serde_json::json!({"messages": "messages"}));
    let all = serde_json::json!({"prompt": "string", "response": "string", "messages": "messages"});
    let file = |columns: &serde_json::Value, third: serde_json::Value| {
        let first = if columns.get("prompt").is_some() { pair.clone() } else { talk("1 plus 2?".into()) };
        serde_json::json!({"columns": columns, "rows": [first, first, third]})
    };
    let long = serde_json::json!({"prompt": "x", "response": "one two ".repeat(40)});
    let cases = [
        (file(&pairs, serde_json::json!({"prompt": "x"})), "row 3: has \"prompt\" but its \"response\" is null"),
        (file(&pairs, serde_json::json!({})), "row 3: \"prompt\" and \"response\" are null"),
        (file(&chats, talk(serde_json::Value::Null)), "row 3: messages[0].content is null, not a string"),
        (file(&chats, serde_json::json!({"messages": [null]})), "row 3: messages[0] is null"),
        (file(&chats, serde_json::json!({})), "row 3: \"messages\" is null"),
        (
            file(&chats, serde_json::json!({"messages": [{"role": "user", "content": "x"}]})),
            "row 3: has no message of role \"assistant\"",
        ),
        (
            file(&all, serde_json::json!({"prompt": "x", "response": "y", "messages": []})),
            "row 3: has both \"messages\" and prompt/response",
        ),
        (file(&all, serde_json::json!({})), "row 3: \"prompt\", \"response\" and \"messages\" are all null"),
        (file(&pairs, long), "row 3: the example is"),
        (
            serde_json::json!({"columns": {"prompt": "int", "response": "string"}, "rows": [{"prompt": 1, "response": "y"}]}),
            "bad.parquet: column \"prompt\" is Int64, not strings",
        ),
        (
            file(&serde_json::json!({"prompt": "string"}), serde_json::json!({})),
            "bad.parquet: has a column \"prompt\" but no column \"response\"",
        ),
        (
            serde_json::json!({"columns": {"text": "string"}, "rows": [{"text": "x"}]}),
            "bad.parquet: has none of the columns (it has \"text\")",
        ),
        (serde_json::json!("{\"prompt\": \"x\", \"response\": \"y\"}\n"), "data/bad.parquet is not a parquet file"),
    ];
    for (bad, want) in cases {
        to_parquet(p, serde_json::json!({ "data/bad.parquet": bad }));
        let o = run(&["validate", "sft.toml", "--set", "load.path=\"data/bad.parquet\""], p);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{want}\n{out}\n{err}");
        assert!(err.contains(want) && err.contains("data/bad.parquet"), "{want}\n{err}");
    }
}

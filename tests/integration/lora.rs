//! LoRA (`[wrap.lora]`) against PEFT's own (benches/reference/peft_lora.py, on transformers): a
//! tiny Llama made locally (tests/fixtures/hf_twin.py), adapters that PEFT initialised and saved
//! (B random too, so the adapters count from step 0) read through `wrap.lora.init`, and 20 AdamW
//! steps on the same batch give PEFT's losses; the run's adapters exported with `--peft` load in
//! `PeftModel.from_pretrained` with no missing or unexpected key, and its merged `--hf` export
//! equals PEFT's `merge_and_unload()`; `runner eval` and `runner predict` on the LoRA run give the
//! merged model's loss and greedy text. Checkpoints hold the adapters and their optimizer state,
//! not the frozen base. The workflow of docs/guide/fine-tuning.md, shortened. The refusals, each
//! pinned.
use crate::common;

use std::path::Path;
use std::process::Command;

use common::{assert_ok, reference_python, run, text, write};

use crate::hf::{python as hf_twin, save_windows, windows, SEQ, TWIN};

/// Windows of the book: 16 to train on (one batch, every step), 4 held out.
const ROWS: usize = 16;
const STEPS: usize = 20;

/// Runs the repository's Python script `path` with the reference Python in `dir`; its stdout.
fn script(dir: &Path, path: &str, args: &[&str]) -> String {
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

/// Runs benches/reference/peft_lora.py in `dir`; its JSON line.
fn peft(dir: &Path, args: &[&str]) -> serde_json::Value {
    let out = script(dir, "benches/reference/peft_lora.py", args);
    serde_json::from_str(out.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// The twin's run (hf.rs) with LoRA of rank 4 on four of Llama's modules (v's rows and up's are
/// not the first of their fused matrices), from `init`'s adapters.
fn lora_twin(init: &str) -> String {
    format!(
        "{}\n[wrap.lora]\nrank = 4\nalpha = 8\ntargets = [\"q_proj\", \"v_proj\", \"up_proj\", \"down_proj\"]\n{init}",
        TWIN.replace("INIT", "llama")
    )
}

/// A directory with the book and a tiny Llama (`llama/`) made by transformers.
fn setup(p: &Path) {
    let book: String = (0..200).map(|i| format!("{i}: to be, or not to be, that is the question. ")).collect();
    write(p, "book.txt", &book[..(ROWS + 4) * SEQ + 1]);
    hf_twin(p, &["make", "--arch", "llama", "--out", "llama", "--kv-heads", "2", "--hidden", "48"]);
}

/// The oracle on the model `arch/` of `p`: PEFT's adapters on `targets` (B random too) read
/// through wrap.lora.init, 20 AdamW steps against PEFT's; the run (`arch-run/`) exported with
/// `--peft` loads in PEFT with no missing or unexpected key, and with `--hf` equals PEFT's
/// merge_and_unload(). PEFT's check (the merged model's greedy generation among it).
fn peft_oracle(p: &Path, arch: &str, targets: &[&str]) -> serde_json::Value {
    let (adapter_init, run_dir) = (format!("{arch}-init"), format!("{arch}-run"));
    let made = peft(
        p,
        &[
            "init",
            arch,
            "--out",
            &adapter_init,
            "--r",
            "4",
            "--alpha",
            "8",
            "--targets",
            &targets.join(","),
            "--random-b",
        ],
    );
    assert_eq!(made["files"], serde_json::json!(["README.md", "adapter_config.json", "adapter_model.safetensors"]));
    let theirs = peft(p, &["train", arch, "--adapter", &adapter_init, "--windows", "windows.safetensors"]);

    let lora = lora_twin(&format!("init = \"{adapter_init}\"\n")).replace("\"llama\"", &format!("\"{arch}\""));
    let listed: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
    let lora =
        lora.replace("[\"q_proj\", \"v_proj\", \"up_proj\", \"down_proj\"]", &format!("[{}]", listed.join(", ")));
    write(p, &format!("{arch}.toml"), &lora);
    assert_ok(&run(&["run", &format!("{arch}.toml"), "--out", &run_dir], p));
    let ours = common::rank0(&p.join(&run_dir), "global_train_loss");
    let theirs: Vec<f64> = theirs["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
    assert_eq!((ours.len(), theirs.len()), (STEPS, STEPS));
    for (s, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!((a - b).abs() < 1e-5, "{arch}, step {}: runner {a}, PEFT {b}", s + 1);
    }
    assert!(ours[STEPS - 1] < ours[0] - 0.1, "{arch}: the adapters learn: {ours:?}");

    // The adapters as PEFT saves them, and the model merged.
    let (adapter, merged) = (format!("{arch}-adapter"), format!("{arch}-merged"));
    assert_ok(&run(&["export", &run_dir, "--peft", &adapter, "--hf", &merged], p));
    let got = peft(p, &["check", arch, "--adapter", &adapter, "--merged", &merged]);
    assert_eq!((&got["missing_keys"], &got["unexpected_keys"]), (&serde_json::json!([]), &serde_json::json!([])));
    assert_eq!((&got["config"]["r"], &got["config"]["lora_alpha"]), (&serde_json::json!(4), &serde_json::json!(8.0)));
    assert_eq!(got["merged_keys"], serde_json::json!([]));
    let diff = got["merged_diff"].as_f64().unwrap();
    assert!(diff < 1e-6, "{arch}: the merged export differs from merge_and_unload() by {diff}");
    got
}

/// The book's first windows, for PEFT's side.
fn book_windows(p: &Path) -> Vec<i64> {
    let tokens: Vec<i64> = std::fs::read(p.join("book.txt")).unwrap().iter().map(|&b| b as i64).collect();
    save_windows(&p.join("windows.safetensors"), &windows(&tokens, ROWS));
    tokens
}

#[test]
fn lora_gives_pefts_losses_and_exports_that_peft_and_transformers_load() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    setup(p);
    let tokens = book_windows(p);
    let got = peft_oracle(p, "llama", &["q_proj", "v_proj", "up_proj", "down_proj"]);

    // runner eval and predict on the LoRA run: the merged model's loss and greedy text.
    let ids: Vec<u8> = tokens.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect();
    std::fs::write(p.join("book.bin"), ids).unwrap();
    let eval = |model: &str| -> f64 {
        let o = run(&["eval", model, "book.bin", "--json", "--seq-len", "16"], p);
        assert_ok(&o);
        let v: serde_json::Value = serde_json::from_str(&text(&o).0).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let (lora, merged) = (eval("llama-run"), eval("llama-merged"));
    assert!((lora - merged).abs() < 1e-5, "runner eval: the LoRA run {lora}, its merged export {merged}");
    let o = run(&["predict", "llama-run", "--prompt", "to", "--tokens", "4", "--top-k", "1"], p);
    assert_ok(&o);
    let generated: Vec<u8> = got["generated"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u8).collect();
    assert_eq!(text(&o).0, format!("to{}\n", String::from_utf8_lossy(&generated)));
}

/// GPT-2's Conv1D layers (stored transposed; PEFT's fan_in_fan_out) and its `c_proj`, which is
/// both the attention's output and the MLP's.
#[test]
fn lora_on_gpt2_gives_pefts_losses_and_merge() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    setup(p);
    hf_twin(p, &["make", "--arch", "gpt2", "--out", "gpt2", "--tied", "--hidden", "80", "--positions", "24"]);
    book_windows(p);
    let got = peft_oracle(p, "gpt2", &["c_attn", "c_proj", "c_fc"]);
    assert_eq!(got["config"]["fan_in_fan_out"], serde_json::json!(true));
}

/// The tensors of a safetensors file, by name.
fn tensors(path: &Path) -> std::collections::BTreeMap<String, tch::Tensor> {
    tch::Tensor::read_safetensors(path).unwrap().into_iter().collect()
}

#[test]
fn lora_under_ddp_trains_the_adapters_alone_and_its_checkpoints_resume_from_the_frozen_base() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    setup(p);
    write(p, "lora.toml", &format!("{}\n[checkpoint]\nevery = 10\n", lora_twin("")));
    assert_ok(&run(&["run", "lora.toml", "--out", "one"], p));
    // DDP at 2 ranks: the adapters' gradients averaged, the same losses as one rank's.
    assert_ok(&run(
        &["run", "lora.toml", "--out", "two", "--set", "run.world_size=2", "--set", "train.batch_size=8"],
        p,
    ));
    let one = common::rank0(&p.join("one"), "global_train_loss");
    let two = common::rank0(&p.join("two"), "global_train_loss");
    assert_eq!(one.len(), STEPS);
    for (s, (a, b)) in one.iter().zip(&two).enumerate() {
        assert!((a - b).abs() < 1e-5, "step {}: one rank {a}, two ranks {b}", s + 1);
    }
    assert!(one[STEPS - 1] < one[0] - 0.1, "the adapters learn: {one:?}");

    // The base is frozen: the run's model holds the checkpoint's q_proj as it was.
    let base = tensors(&p.join("llama/model.safetensors"));
    let model = tensors(&p.join("one/model.safetensors"));
    assert!(model["blocks.1.qkv.weight"].narrow(0, 0, 32).equal(&base["model.layers.1.self_attn.q_proj.weight"]));
    assert!(model["blocks.1.self_attn.v_proj.lora_B"].abs().sum(tch::Kind::Float).double_value(&[]) > 0.0);
    // A checkpoint holds the adapters and their optimizer state, not the base.
    let saved = tensors(&p.join("one/checkpoints/epoch-0020/rank-0.safetensors"));
    let names: Vec<&String> = saved.keys().collect();
    assert!(names.iter().all(|n| n.contains(".lora_") || n.as_str() == "optim.steps"), "{names:?}");
    assert_eq!(names.len(), 2 * 4 * 2 * 3 + 1, "{names:?}");
    assert!(saved.contains_key("optim.exp_avg.blocks.0.mlp.up_proj.lora_A"), "{names:?}");

    // Cut at step 10 and resumed: the base read from wrap.init again, the adapters and their
    // state from the checkpoint, the uninterrupted run's losses.
    assert_ok(&run(&["run", "lora.toml", "--out", "cut", "--set", "train.epochs=10"], p));
    assert_ok(&run(&["run", "--resume", "cut", "--set", "train.epochs=20"], p));
    assert_eq!(common::rank0(&p.join("cut"), "global_train_loss"), one);
    // A base that changed since is refused, by its digest.
    let weights = p.join("llama/model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&weights, bytes).unwrap();
    let o = run(&["run", "--resume", "cut", "--set", "train.epochs=21"], p);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("model.safetensors changed since the run started"), "{err}");
}

/// Under FSDP at 2 ranks the frozen base is sharded (no gradients, no optimizer state) and the
/// adapters held whole by every rank: PEFT's losses from PEFT's adapters; each rank's checkpoint
/// holds the adapters' state (rank 0 alone, whole), not the base; a run cut at step 10 and
/// resumed under FSDP gives the uninterrupted run's losses, bit for bit.
#[test]
fn lora_under_fsdp_shards_the_frozen_base_gives_pefts_losses_and_resumes_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    setup(p);
    book_windows(p);
    let targets = "q_proj,v_proj,up_proj,down_proj";
    peft(p, &["init", "llama", "--out", "init", "--r", "4", "--alpha", "8", "--targets", targets, "--random-b"]);
    let theirs = peft(p, &["train", "llama", "--adapter", "init", "--windows", "windows.safetensors"]);
    let theirs: Vec<f64> = theirs["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
    write(p, "fsdp.toml", &format!("{}\n[checkpoint]\nevery = 10\n", lora_twin("init = \"init\"\n")));
    let fsdp = ["--set", "wrap.strategy=\"fsdp\"", "--set", "run.world_size=2", "--set", "train.batch_size=8"];
    let go = |args: &[&str]| assert_ok(&run(&[args, &fsdp[..]].concat(), p));
    go(&["run", "fsdp.toml", "--out", "whole"]);
    let ours = common::rank0(&p.join("whole"), "global_train_loss");
    assert_eq!((ours.len(), theirs.len()), (STEPS, STEPS));
    for (s, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!((a - b).abs() < 1e-5, "step {}: runner under FSDP {a}, PEFT {b}", s + 1);
    }
    assert!(ours[STEPS - 1] < ours[0] - 0.1, "the adapters learn: {ours:?}");

    // Rank 0's checkpoint holds the adapters, their state and the step count; rank 1's nothing
    // of the base.
    let saved = tensors(&p.join("whole/checkpoints/epoch-0020/rank-0.safetensors"));
    let names: Vec<&String> = saved.keys().collect();
    assert!(names.iter().all(|n| n.contains(".lora_") || n.as_str() == "optim.steps"), "{names:?}");
    assert_eq!(names.len(), 2 * 4 * 2 * 3 + 1, "{names:?}");
    let other = p.join("whole/checkpoints/epoch-0020/rank-1.safetensors");
    if other.exists() {
        let names: Vec<String> = tensors(&other).into_keys().collect();
        assert!(names.iter().all(|n| n.contains(".lora_")), "{names:?}");
    }

    go(&["run", "fsdp.toml", "--out", "cut", "--set", "train.epochs=10"]);
    // The run's own settings (FSDP at 2 ranks) hold on resume.
    assert_ok(&run(&["run", "--resume", "cut", "--set", "train.epochs=20"], p));
    assert_eq!(common::rank0(&p.join("cut"), "global_train_loss"), ours);
}

/// `runner validate` of `config` in `dir`: exit 2, and for each of `expected` (key, message) a
/// line naming the key (and where its value came from) with the message.
fn refused(dir: &Path, config: &str, expected: &[(&str, &str)]) {
    write(dir, "bad.toml", config);
    let o = run(&["validate", "bad.toml"], dir);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for (key, e) in expected {
        let found = err.lines().any(|l| l.trim_start().starts_with(&format!("`{key}` (")) && l.contains(e));
        assert!(found, "expected `{key}`: {e:?} in:\n{err}");
    }
}

#[test]
fn lora_that_cannot_be_built_is_refused_on_the_plan_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    setup(p);
    let twin = TWIN.replace("INIT", "llama");
    refused(
        p,
        &format!("{twin}\n[wrap.lora]\ntargets = [\"c_attn\", \"v_proj\"]\nrank = 0\n"),
        &[
            (
                "wrap.lora.targets",
                "the model (LlamaForCausalLM) has no module \"c_attn\"; it has \
             \"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\" (or give \
             [\"all-linear\"])",
            ),
            ("wrap.lora.rank", "is 0; give a rank of at least 1"),
        ],
    );
    refused(
        p,
        &format!("{twin}\n[wrap.lora]\nrank = 33\n"),
        &[("wrap.lora.rank", "is 33, larger than self_attn.q_proj (32 inputs, 32 outputs)")],
    );
    refused(
        p,
        &format!("{twin}\n[wrap.lora]\n").replace("[wrap]", "[wrap]\nstrategy = \"pipeline\""),
        &[("wrap.strategy", "is \"pipeline\", but [wrap.lora] does not cut its frozen base into stages yet")],
    );
    refused(
        p,
        &format!("{twin}\n[wrap.lora]\n[wrap.mesh]\ntensor = 2\n").replace("[run]", "[run]\nworld_size = 2"),
        &[("wrap.mesh.tensor", "splits each layer across ranks, which [wrap.lora] does not support yet")],
    );
    refused(
        p,
        &format!("{twin}\n[wrap.lora]\ninit = \"nowhere\"\n"),
        &[("wrap.lora.init", "cannot read nowhere/adapter_config.json")],
    );
    let scratch = TWIN.replace("init = \"INIT\"\n", "").replace("seq_len = 16", "seq_len = 16\nvocab = 256");
    refused(
        p,
        &format!("{scratch}\n[wrap.lora]\n"),
        &[("wrap.init", "is not set, but [wrap.lora] fine-tunes a published model: set wrap.init to a Hugging Face")],
    );
    let mlp = "[load]\nsource = \"synthetic\"\n[wrap.model]\nkind = \"mlp\"\n[wrap.lora]\n";
    refused(p, mlp, &[("wrap.model.kind", "makes an MLP, but [wrap.lora] adapts a transformer's linear layers")]);
    let scripted = mlp.replace("kind = \"mlp\"", "kind = \"torchscript\"\npath = \"module.pt\"");
    refused(
        p,
        &scripted,
        &[("wrap.model.kind", "makes a TorchScript module (its layers are its own), but [wrap.lora]")],
    );
}

/// docs/guide/fine-tuning.md, shortened to 6 steps: the shipped pipelines/llama_lora.toml trains
/// adapters on the tiny Llama that `scripts/tiny_llama.py` makes, at 2 ranks; exported for PEFT
/// (with the run's tokenizer) and merged. `PeftModel.from_pretrained` over the base and the merged
/// model in transformers both generate `runner predict --top-k 1`'s text.
#[test]
fn the_lora_workflow_gives_an_adapter_peft_loads_and_a_merged_model_that_generates_the_same_text() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir_all(p.join("pipelines")).unwrap();
    let shipped = std::fs::read_to_string(repo.join("pipelines/llama_lora.toml")).unwrap();
    write(&p.join("pipelines"), "llama_lora.toml", &shipped);
    let tempest = repo.join("pipelines/data/tempest.txt");
    let prepare = ["prepare", "text", tempest.to_str().unwrap(), "--out", "data/tempest-bpe", "--tokenizer", "bpe"];
    assert_ok(&run(&[&prepare[..], &["--vocab", "512"]].concat(), p));
    script(p, "scripts/tiny_llama.py", &["make", "--vocab", "512", "--out", "models/tiny-llama"]);
    let short = ["train.steps=6", "train.schedule.warmup_steps=2", "validate.every_steps=6", "validate.batches=2"];
    let sets: Vec<&str> = short.iter().flat_map(|s| ["--set", s]).collect();
    assert_ok(&run(&[&["run", "pipelines/llama_lora.toml", "--out", "tuned"][..], &sets].concat(), p));
    let o = run(&["export", "tuned", "--peft", "tempest-lora", "--hf", "tempest-merged"], p);
    assert_ok(&o);
    let stdout = text(&o).0;
    assert!(stdout.contains("(rank 8, alpha 16, on q_proj, v_proj; 8 tensors in adapter_config.json"), "{stdout}");

    let o = run(&["predict", "tuned", "--prompt", "PROSPERO:", "--tokens", "12", "--top-k", "1"], p);
    assert_ok(&o);
    let ours = text(&o).0;
    let generate = ["generate", "--prompt", "PROSPERO:", "--tokens", "12"];
    let peft = script(
        p,
        "scripts/tiny_llama.py",
        &[&generate[..], &["models/tiny-llama", "--adapter", "tempest-lora"]].concat(),
    );
    let merged = script(p, "scripts/tiny_llama.py", &[&generate[..], &["tempest-merged"]].concat());
    assert_eq!((&peft, &merged), (&ours, &ours), "PEFT over the base, the merged model, runner predict");
}

/// `wrap.lora.rank`, `wrap.lora.alpha` and `train.lr` searched (random search, 3 trials of 4
/// steps): every trial trains its own adapters; a range whose end the model cannot take is named
/// before the first trial.
#[test]
fn the_adapters_rank_and_alpha_are_searchable_and_a_rank_the_model_refuses_is_named_first() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    setup(p);
    write(p, "lora.toml", &lora_twin(""));
    let search = |rank: &str| {
        format!(
            "pipeline = \"lora.toml\"\n\n[set]\n\"train.epochs\" = 4\n\n[search]\nmethod = \"random\"\ntrials = 3\n\
             metric = \"global_train_loss\"\nseed = 0\n\n[search.space]\n\"wrap.lora.rank\" = {{ int = {rank} }}\n\
             \"wrap.lora.alpha\" = {{ uniform = [4.0, 16.0] }}\n\"train.lr\" = {{ log_uniform = [0.001, 0.01] }}\n"
        )
    };
    write(p, "search.toml", &search("[2, 8]"));
    let o = run(&["sweep", "search.toml", "--out", "s"], p);
    assert_ok(&o);
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p.join("s/sweep.json")).unwrap()).unwrap();
    let points = index["points"].as_array().unwrap();
    assert_eq!(points.len(), 3, "{index}");
    for point in points {
        let values = point["values"].to_string();
        assert!(values.contains("wrap.lora.rank") && values.contains("wrap.lora.alpha"), "{values}");
        let run_dir = p.join("s").join(point["dir"].as_str().unwrap());
        assert_eq!(common::rank0(&run_dir, "global_train_loss").len(), 4, "{}", run_dir.display());
    }
    write(p, "bad.toml", &search("[2, 64]"));
    let o = run(&["sweep", "bad.toml", "--out", "b"], p);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("is 64, larger than self_attn.q_proj (32 inputs, 32 outputs)"), "{err}");
}

/// results/lora_search, committed with portable numerics (experiments/lora_search.toml: TPE with
/// successive halving over the adapters' rank and alpha and the learning rate, on the committed
/// tiny Llama and instruction set): a rerun of the whole search reproduces every trial's trace.
#[test]
fn the_committed_lora_search_reproduces() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o =
        common::runner().args(["sweep", "experiments/lora_search.toml", "--check"]).current_dir(root).output().unwrap();
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(
        out.contains("trials reproduce results/lora_search: every non-timing value of every trace is identical."),
        "{out}"
    );
}

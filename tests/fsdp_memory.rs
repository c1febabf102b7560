//! FSDP without the whole model on any rank: built one unit at a time, it starts from DDP's
//! initial weights bit for bit; `wrap.init` and a resume read each rank's share of the file, not
//! the whole; and under an operating-system memory limit that DDP cannot meet, FSDP trains to
//! DDP's losses.
mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{assert_ok, runner, text, write};
use tch::Tensor;

/// A transformer of 8 blocks whose vocabulary of 66 rows 4 ranks do not divide, at 4 ranks.
const MODEL: &str = r#"
[run]
name = "fsdp-memory"
seed = 5
world_size = 4
timeout_s = 120

[load]
rows = 64
validation_rows = 8

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 66
d_model = 64
heads = 4
layers = 8
seq_len = 16
tied = false

[train]
steps = 2
batch_size = 4
optimizer = "adamw"

[validate]
every_steps = 2
"#;

/// Runs `p.toml` in `dir` into `out` with `sets` and the environment `env`.
fn train(dir: &Path, out: &str, sets: &[&str], env: &[(&str, &Path)]) {
    let mut c = runner();
    c.args(["run", "p.toml", "--out", out]).current_dir(dir);
    for s in sets {
        c.args(["--set", s]);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    assert_ok(&c.output().unwrap());
}

fn tensors(path: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).into_iter().collect()
}

/// Bytes of tensor data each of `ranks` ranks read (`RUNNER_TEST_READ_BYTES`).
fn bytes_read(dir: &Path, ranks: usize) -> Vec<u64> {
    (0..ranks).map(|r| std::fs::read_to_string(dir.join(format!("rank-{r}"))).unwrap().parse().unwrap()).collect()
}

/// Bytes of tensor data in a `.safetensors` file: the file less its 8-byte length and header.
fn data_bytes(path: &Path) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    bytes.len() as u64 - 8 - header
}

/// Each of 4 ranks read about a quarter of `total` bytes (its rows, rounded up per tensor), and
/// together every byte once.
fn assert_shares(read: &[u64], total: u64, what: &str) {
    for (r, &b) in read.iter().enumerate() {
        assert!(b as f64 <= 0.27 * total as f64, "{what}: rank {r} read {b} bytes of {total}: {read:?}");
    }
    let sum: u64 = read.iter().sum();
    assert!(sum >= total && sum as f64 <= 1.02 * total as f64, "{what}: the ranks read {sum} bytes of {total}");
}

/// Every tensor of `b` is `a`'s, bit for bit, and they hold the same names.
fn assert_same(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, what: &str) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}");
    for (name, t) in a {
        assert!(t.kind() == b[name].kind() && t.equal(&b[name]), "{what}: `{name}` differs");
    }
}

#[test]
fn built_by_units_fsdp_starts_from_ddps_weights_and_wrap_init_reads_each_ranks_rows() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", MODEL);
    let fsdp = "wrap.strategy=\"fsdp\"";
    for (out, sets) in [("ddp", vec![]), ("fsdp", vec![fsdp])] {
        let dump = d.join(format!("{out}-start"));
        std::fs::create_dir_all(&dump).unwrap();
        train(d, out, &sets, &[("RUNNER_TEST_DUMP_LOADED", &dump)]);
    }
    // What every rank started from, whole (under FSDP its shards gathered), is DDP's to the bit.
    let ddp = tensors(&d.join("ddp-start/rank-0.safetensors"));
    for r in 0..4 {
        assert_same(&ddp, &tensors(&d.join(format!("fsdp-start/rank-{r}.safetensors"))), &format!("rank {r}"));
    }

    // wrap.init: each rank reads its rows of every parameter, and starts from the file's values.
    let init = d.join("ddp/model.safetensors");
    let (read, dump) = (d.join("init-read"), d.join("init-start"));
    std::fs::create_dir_all(&read).unwrap();
    std::fs::create_dir_all(&dump).unwrap();
    let init_key = format!("wrap.init=\"{}\"", init.display());
    train(d, "init", &[fsdp, &init_key], &[("RUNNER_TEST_READ_BYTES", &read), ("RUNNER_TEST_DUMP_LOADED", &dump)]);
    assert_shares(&bytes_read(&read, 4), data_bytes(&init), "wrap.init");
    let started = tensors(&dump.join("rank-2.safetensors"));
    let file = tensors(&init);
    for (name, t) in &file {
        assert!(started[name].equal(t), "`{name}` of wrap.init is not what the run started from");
    }
}

#[test]
fn an_fsdp_run_resumed_at_4_ranks_reads_each_ranks_share_of_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &format!("{MODEL}\n[checkpoint]\nevery_steps = 2\n"));
    train(d, "run", &["wrap.strategy=\"fsdp\""], &[]);
    let ckpt = d.join("run/checkpoints/step-00000002");
    let total: u64 = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .map(|p| data_bytes(&p))
        .sum();
    let read = d.join("read");
    std::fs::create_dir_all(&read).unwrap();
    let o = runner()
        .args(["run", "--resume", "run", "--set", "train.steps=3"])
        .env("RUNNER_TEST_READ_BYTES", &read)
        .current_dir(d)
        .output()
        .unwrap();
    assert_ok(&o);
    assert!(text(&o).0.contains("resuming run"), "{}", text(&o).0);
    assert_shares(&bytes_read(&read, 4), total, "resume");
}

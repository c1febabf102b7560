//! Memory that does not grow with the data: a file of one billion token ids (2 GB, nanoGPT's
//! uint16 format) trains at world size 2 with every process of the run (the launcher, which plans
//! and scans the file, and both ranks) under 1 GiB resident. Alone in its test binary, so that
//! the peak resident size of this process's children is the run's.
use crate::common;

use std::io::Write;

use common::{assert_ok, run, text, write};

const TOKENS: usize = 1_000_000_000;

#[test]
fn a_billion_token_file_trains_at_world_size_two_with_each_rank_under_one_gib() {
    let dir = tempfile::tempdir().unwrap();
    // Ids 0..1000 in a pattern with some structure, written in 64 MiB blocks.
    let block: Vec<u8> =
        (0..(32usize << 20)).flat_map(|i| ((((i * 31) ^ (i >> 7)) % 1000) as u16).to_le_bytes()).collect();
    let mut f = std::io::BufWriter::new(std::fs::File::create(dir.path().join("train.bin")).unwrap());
    let mut left = TOKENS;
    while left > 0 {
        let n = left.min(block.len() / 2);
        f.write_all(&block[..2 * n]).unwrap();
        left -= n;
    }
    f.into_inner().unwrap().sync_all().unwrap();
    std::fs::write(dir.path().join("val.bin"), &block[..2 * 100_000]).unwrap();
    drop(block);
    write(
        dir.path(),
        "p.toml",
        r#"
[run]
name = "big"
world_size = 2
timeout_s = 60

[load]
source = "tokens"
path = "train.bin"
validation_path = "val.bin"
sampling = "random"

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 1024
d_model = 32
heads = 2
layers = 1
seq_len = 64

[train]
steps = 20
batch_size = 8
optimizer = "adamw"
lr = 0.002

[validate]
every_steps = 10
batches = 2
"#,
    );
    let o = run(&["run", "p.toml", "--out", "r"], dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("train.bin (1000000000 tokens)"), "{stdout}");
    assert!(stdout.contains("step 20/20"), "{stdout}");
    // The largest resident size of any process of the run (getrusage of the waited-for children).
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN).unwrap();
    let peak_mib = usage.max_rss() as f64 / 1024.0;
    eprintln!("peak resident size of the run's processes: {peak_mib:.0} MiB");
    assert!(peak_mib < 1024.0, "a process of the run peaked at {peak_mib:.0} MiB resident");
    // The plan's estimate says what a rank holds: the batches, not the file.
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("r/plan.json")).unwrap()).unwrap();
    assert!(plan["memory"]["data"].as_f64().unwrap() < 16.0 * 1024.0 * 1024.0, "{}", plan["memory"]);
}

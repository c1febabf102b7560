//! The GPU path, in a build with `--features cuda`: NCCL's collectives, DDP on CUDA and bf16 on
//! CUDA across real processes (this binary re-runs itself as the ranks, as tests/integration/dist.rs does),
//! and the refusal of `device = "cuda"` where no GPU is visible.
//!
//! Every test that needs GPUs says so and passes without running where there are too few: it
//! prints `SKIPPED (...)` with the reason (see them with `cargo test --features cuda -- --nocapture`).
//! None of these has run on a GPU yet: see docs/gpus.md.
#![cfg(feature = "cuda")]

use crate::common;

use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use runner::dist::{Backend, Ddp, ProcessGroup, ReduceOp, Store};
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};

const TIMEOUT: Duration = Duration::from_secs(60);

fn gpus() -> usize {
    runner::device::cuda_device_count()
}

/// `true` (after printing why) when fewer than `needed` GPUs are visible.
fn skip(test: &str, needed: usize) -> bool {
    let found = gpus();
    if found < needed {
        println!("SKIPPED ({test}): needs {needed} CUDA device(s), libtorch sees {found}");
        return true;
    }
    false
}

/// Runs `scenario` in `world` processes of this binary over `backend` ("nccl" or "gloo"), rank r
/// on cuda:r (or cuda:0 for all with `share_gpu`); returns each rank's output.
fn run_world(scenario: &str, world: usize, backend: &str, share_gpu: bool, dir: &std::path::Path) -> Vec<Output> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let store = Store::serve(listener, world, TIMEOUT).unwrap();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["gpu::gpu_worker_entry", "--exact", "--nocapture", "--test-threads=1"])
                .env("GPU_SCENARIO", scenario)
                .env("GPU_BACKEND", backend)
                .env("GPU_DIR", dir)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", if share_gpu { "0".to_string() } else { rank.to_string() })
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    drop(store);
    outputs
}

fn assert_all_ok(scenario: &str, outputs: &[Output]) {
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("WORKER OK"),
            "{scenario}: rank {rank} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn without_a_gpu_the_plan_refuses_cuda_before_any_rank_starts() {
    if gpus() > 0 {
        println!("SKIPPED (refusal without a GPU): this machine has {} CUDA device(s)", gpus());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    common::write(dir.path(), "p.toml", common::TINY);
    for command in ["validate", "run"] {
        let out = common::runner()
            .current_dir(dir.path())
            .args([command, "p.toml", "--set", "run.device=cuda", "--set", "run.backend=nccl"])
            .output()
            .unwrap();
        let (_, stderr) = common::text(&out);
        assert_eq!(out.status.code(), Some(2), "{command}: {stderr}");
        assert!(
            stderr
                .contains("`run.device` (--set run.device=cuda): \"cuda\" was asked, but libtorch sees 0 CUDA devices"),
            "{command}: {stderr}"
        );
        assert!(!dir.path().join("results").exists(), "{command}: a refused plan wrote results");
    }
    // Below the plan, the bridge: an NCCL group without a GPU is an error, not an abort.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let store = Arc::new(Store::serve(listener, 1, TIMEOUT).unwrap());
    let err = ProcessGroup::new(Backend::Nccl { device: 0 }, store, 0, 1, "127.0.0.1", TIMEOUT).err().unwrap();
    assert!(err.to_string().contains("cuda:0 does not exist: 0 CUDA device(s) visible"), "{err}");
}

#[test]
fn nccl_all_reduce_broadcast_all_gather_and_send_recv_give_the_right_values() {
    if skip("NCCL collectives", 1) {
        return;
    }
    let world = gpus().min(2);
    if world < 2 {
        println!("SKIPPED (NCCL send/recv): needs 2 CUDA devices, libtorch sees 1; collectives run at world size 1");
    }
    let dir = tempfile::tempdir().unwrap();
    assert_all_ok("collectives", &run_world("collectives", world, "nccl", false, dir.path()));
}

#[test]
fn ddp_on_cuda_two_ranks_match_one_process_with_double_batch() {
    if skip("DDP parity on CUDA", 1) {
        return;
    }
    // Two GPUs: NCCL, one rank each. One GPU: both ranks on it over gloo (NCCL refuses two ranks
    // on one device), which still runs the Reducer on CUDA tensors.
    let (backend, share) = if gpus() >= 2 { ("nccl", false) } else { ("gloo", true) };
    if share {
        println!("SKIPPED (DDP parity over NCCL): needs 2 CUDA devices; running it over gloo on cuda:0");
    }
    let dir = tempfile::tempdir().unwrap();
    assert_all_ok("parity", &run_world("parity", 2, backend, share, dir.path()));
    let device = Device::Cuda(0);
    let vs = nn::VarStore::new(device);
    let model = parity_model(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let (x, y) = parity_data(device);
    for step in 0..PARITY_STEPS {
        let rows = Tensor::arange_start(step * 2 * PARITY_B, (step + 1) * 2 * PARITY_B, (Kind::Int64, device));
        let loss = model.forward(&x.index_select(0, &rows)).cross_entropy_for_logits(&y.index_select(0, &rows));
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    let ddp = Tensor::load(dir.path().join("params-0.pt")).unwrap();
    let single = flat_params(&vs).to_device(Device::Cpu);
    let rel = ((&ddp - &single).abs().max().double_value(&[])) / single.abs().max().double_value(&[]);
    assert!(rel < 1e-5, "DDP 2×{PARITY_B} on CUDA differs from 1×{} by {rel:e} (relative)", 2 * PARITY_B);
}

#[test]
fn bf16_autocast_and_bf16_all_reduce_on_cuda() {
    if skip("bf16 on CUDA", 1) {
        return;
    }
    let device = Device::Cuda(0);
    // Autocast computes a linear layer in bf16 once told to (tch's autocast alone means float16).
    runner::dist::set_autocast_dtype(device, Kind::BFloat16).unwrap();
    let vs = nn::VarStore::new(device);
    let layer = nn::linear(vs.root() / "l", 64, 32, Default::default());
    let x = Tensor::randn([16, 64], (Kind::Float, device));
    let full = layer.forward(&x);
    let cast = tch::autocast(true, || layer.forward(&x));
    assert_eq!(full.kind(), Kind::Float);
    assert_eq!(cast.kind(), Kind::BFloat16, "autocast did not compute in bf16");
    let err = (cast.to_kind(Kind::Float) - &full).abs().max().double_value(&[]);
    let scale = full.abs().max().double_value(&[]);
    assert!(err <= 0.02 * scale, "bf16 result off by {err} (scale {scale})");
    // Its gradients reach the float32 parameters.
    let loss = tch::autocast(true, || layer.forward(&x)).to_kind(Kind::Float).sum(Kind::Float);
    loss.backward();
    assert_eq!(layer.ws.grad().kind(), Kind::Float);
    // NCCL all-reduces bf16 tensors (small integers are exact in bf16).
    let dir = tempfile::tempdir().unwrap();
    let world = gpus().min(2);
    assert_all_ok("bf16", &run_world("bf16", world, "nccl", false, dir.path()));
}

// ---- the ranks ----

#[test]
fn gpu_worker_entry() {
    let Ok(scenario) = std::env::var("GPU_SCENARIO") else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap();
    let rank: usize = env("RANK").parse().unwrap();
    let local: usize = env("LOCAL_RANK").parse().unwrap();
    let world: usize = env("WORLD_SIZE").parse().unwrap();
    let port: u16 = env("MASTER_PORT").parse().unwrap();
    let dir = std::path::PathBuf::from(env("GPU_DIR"));
    let backend = match env("GPU_BACKEND").as_str() {
        "nccl" => Backend::Nccl { device: local },
        _ => Backend::Gloo,
    };
    let device = Device::Cuda(local);
    let store = Arc::new(Store::connect("127.0.0.1", port, TIMEOUT).unwrap());
    let pg = ProcessGroup::new(backend, store, rank, world, "127.0.0.1", TIMEOUT).unwrap();
    match scenario.as_str() {
        "collectives" => collectives(&pg, device),
        "parity" => parity(&pg, device, &dir),
        "bf16" => {
            let mut t = Tensor::arange(8, (Kind::BFloat16, device)) + pg.rank() as f64;
            pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
            let w = pg.size() as f64;
            assert_eq!(t.kind(), Kind::BFloat16);
            assert_eq!(t.double_value(&[7]), 7.0 * w + w * (w - 1.0) / 2.0, "bf16 all_reduce");
        }
        other => panic!("unknown scenario {other}"),
    }
    pg.barrier().unwrap();
    println!("WORKER OK");
}

fn collectives(pg: &ProcessGroup, device: Device) {
    let (r, w) = (pg.rank() as f64, pg.size() as f64);
    let of = |t: &Tensor, i: i64| t.double_value(&[i]);
    for n in [5i64, 3_000_000] {
        let base = Tensor::arange(n, (Kind::Float, device));
        let ranks_sum = w * (w - 1.0) / 2.0;
        for (op, expect) in [
            (ReduceOp::Sum, Box::new(move |x: f64| x * w + ranks_sum) as Box<dyn Fn(f64) -> f64>),
            (ReduceOp::Avg, Box::new(move |x: f64| x + ranks_sum / w)),
            (ReduceOp::Min, Box::new(|x: f64| x)),
            (ReduceOp::Max, Box::new(move |x: f64| x + w - 1.0)),
        ] {
            let mut t = &base + r;
            pg.all_reduce(&mut t, op).unwrap();
            assert_eq!(t.device(), device, "{op:?} left the GPU");
            for i in [0, n / 2, n - 1] {
                assert_eq!(of(&t, i), expect(i as f64), "{op:?} n={n} at {i}");
            }
        }
        let root = pg.size() - 1;
        let mut t = &base * (r + 1.0);
        pg.broadcast(&mut t, root).unwrap();
        assert_eq!(of(&t, n - 1), (n - 1) as f64 * w, "broadcast");
        for (src, g) in pg.all_gather(&(&base + r)).unwrap().iter().enumerate() {
            assert_eq!(of(g, n - 1), (n - 1) as f64 + src as f64, "all_gather from {src}");
        }
        // A CPU tensor (the runner's per-epoch metrics) goes through the GPU and comes back.
        let mut cpu = Tensor::from_slice(&[r, 1.0]);
        pg.all_reduce(&mut cpu, ReduceOp::Sum).unwrap();
        assert_eq!((cpu.device(), of(&cpu, 0), of(&cpu, 1)), (Device::Cpu, ranks_sum, w), "CPU tensor over NCCL");
        if pg.size() > 1 {
            let next = (pg.rank() + 1) % pg.size();
            let prev = (pg.rank() + pg.size() - 1) % pg.size();
            let out = &base + r;
            let mut got = base.zeros_like();
            if pg.rank().is_multiple_of(2) {
                pg.send(&out, next, 3).unwrap();
                pg.recv(&mut got, prev, 3).unwrap();
            } else {
                pg.recv(&mut got, prev, 3).unwrap();
                pg.send(&out, next, 3).unwrap();
            }
            assert_eq!(of(&got, n - 1), (n - 1) as f64 + prev as f64, "send/recv");
            // Both directions at once: one NCCL group, or each peer's receive waits for a send
            // queued behind it.
            let mut got = base.zeros_like();
            pg.send_recv(&(&out * 2.0), next, 4, &mut got, prev, 4).unwrap();
            assert_eq!(of(&got, n - 1), 2.0 * ((n - 1) as f64 + prev as f64), "send_recv");
        }
    }
    // DDP's Reducer on CUDA parameters spanning several buckets.
    let vs = nn::VarStore::new(device);
    let root = vs.root();
    let params: Vec<Tensor> = (0..3).map(|i| root.zeros(&format!("p{i}"), &[512 * 1024])).collect();
    let mut ddp = Ddp::new(pg, &vs.trainable_variables(), 1.0, 1, None).unwrap();
    for _ in 0..2 {
        ddp.prepare_forward().unwrap();
        let loss = params
            .iter()
            .map(|p| p.sum(Kind::Float) * (r + 1.0))
            .fold(Tensor::from(0.0f32).to_device(device), |a, b| a + b);
        ddp.prepare_backward().unwrap();
        loss.backward();
        for p in &params {
            assert_eq!(p.grad().double_value(&[1000]), (w + 1.0) / 2.0, "bucketed gradient average on CUDA");
            let _ = p.grad().zero_();
        }
    }
}

const PARITY_B: i64 = 8;
const PARITY_STEPS: i64 = 20;

fn parity_model(p: &nn::Path) -> nn::Sequential {
    tch::manual_seed(7);
    nn::seq().add(nn::linear(p / "l1", 6, 16, Default::default())).add_fn(|x| x.tanh()).add(nn::linear(
        p / "l2",
        16,
        3,
        Default::default(),
    ))
}

/// The same rows on every process: drawn on the CPU, then moved.
fn parity_data(device: Device) -> (Tensor, Tensor) {
    tch::manual_seed(11);
    let n = PARITY_STEPS * 2 * PARITY_B;
    let x = Tensor::randn([n, 6], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(3, [n], (Kind::Int64, Device::Cpu));
    (x.to_device(device), y.to_device(device))
}

fn flat_params(vs: &nn::VarStore) -> Tensor {
    Tensor::cat(&vs.trainable_variables().iter().map(|t| t.flatten(0, -1)).collect::<Vec<_>>(), 0)
}

fn parity(pg: &ProcessGroup, device: Device, dir: &std::path::Path) {
    let vs = nn::VarStore::new(device);
    let model = parity_model(&vs.root());
    let mut ddp = Ddp::new(pg, &vs.trainable_variables(), 25.0, 1, None).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let (x, y) = parity_data(device);
    let r = pg.rank() as i64;
    for step in 0..PARITY_STEPS {
        let start = step * 2 * PARITY_B + r * PARITY_B;
        let rows = Tensor::arange_start(start, start + PARITY_B, (Kind::Int64, device));
        ddp.prepare_forward().unwrap();
        let loss = model.forward(&x.index_select(0, &rows)).cross_entropy_for_logits(&y.index_select(0, &rows));
        ddp.prepare_backward().unwrap();
        // The Reducer's gradients are views of its buckets: dropped, not zeroed in place.
        runner::dist::clear_grads(&vs.trainable_variables()).unwrap();
        loss.backward();
        opt.step();
    }
    flat_params(&vs).to_device(Device::Cpu).save(dir.join(format!("params-{}.pt", pg.rank()))).unwrap();
}

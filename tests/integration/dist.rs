//! The `dist` API across real processes: this test binary re-runs itself as the ranks
//! (`worker_entry` does the work when DIST_SCENARIO is set) while the test hosts the store.
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use runner::dist::{Backend, Ddp, ProcessGroup, ReduceOp, Store};
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};

const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `scenario` in `world` processes of this binary; returns each rank's output.
fn run_world(scenario: &str, world: usize, dir: &std::path::Path) -> (Vec<Output>, Duration) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let store = Store::serve(listener, world, TIMEOUT).unwrap();
    assert_loopback_only(std::process::id());
    let start = Instant::now();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["dist::worker_entry", "--exact", "--nocapture", "--test-threads=1"])
                .env("DIST_SCENARIO", scenario)
                .env("DIST_DIR", dir)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_PORT", port.to_string())
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    drop(store);
    (outputs, start.elapsed())
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
fn collectives_are_right_for_world_sizes_1_to_4() {
    let dir = tempfile::tempdir().unwrap();
    for world in 1..=4 {
        let (outputs, _) = run_world("collectives", world, dir.path());
        assert_all_ok(&format!("collectives at world size {world}"), &outputs);
    }
}

#[test]
fn a_megatron_split_mlp_equals_the_whole_one_at_2_and_4_ranks() {
    let dir = tempfile::tempdir().unwrap();
    for world in [2, 4] {
        let (outputs, _) = run_world("tensor_parallel", world, dir.path());
        assert_all_ok(&format!("tensor_parallel at world size {world}"), &outputs);
    }
}

#[test]
fn ddp_replicas_stay_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let (outputs, _) = run_world("ddp_identical", 3, dir.path());
    assert_all_ok("ddp_identical", &outputs);
}

#[test]
fn ddp_two_ranks_match_one_process_with_double_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (outputs, _) = run_world("parity", 2, dir.path());
    assert_all_ok("parity", &outputs);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = parity_model(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let (x, y) = parity_data();
    for step in 0..PARITY_STEPS {
        let rows = Tensor::arange_start(step * 2 * PARITY_B, (step + 1) * 2 * PARITY_B, (Kind::Int64, Device::Cpu));
        let loss = model.forward(&x.index_select(0, &rows)).cross_entropy_for_logits(&y.index_select(0, &rows));
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    let ddp = Tensor::load(dir.path().join("params-0.pt")).unwrap();
    let single = flat_params(&vs);
    let rel = ((&ddp - &single).abs().max().double_value(&[])) / single.abs().max().double_value(&[]);
    assert!(rel < 1e-5, "DDP 2×{PARITY_B} differs from 1×{} by {rel:e} (relative)", 2 * PARITY_B);
}

/// SyncBatchNorm under DDP: 2 ranks × B rows equal one process × 2B rows (outputs, averaged
/// gradients of the layers before and after the batch norm, running statistics). Each rank
/// checks itself against the single process computed on the whole batch.
#[test]
fn sync_batchnorm_two_ranks_equal_one_process_with_double_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (outputs, _) = run_world("sync_bn", 2, dir.path());
    assert_all_ok("sync_bn", &outputs);
}

#[test]
fn a_peer_that_leaves_is_named_by_the_survivors_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (outputs, elapsed) = run_world("early_exit", 3, dir.path());
    assert!(elapsed < TIMEOUT, "survivors took {elapsed:?}, longer than the {TIMEOUT:?} timeout");
    for (rank, out) in outputs.iter().enumerate().take(2) {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("EXPECTED ERROR") && stdout.contains("because rank 2 left the group"),
            "rank {rank} did not name rank 2:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn single_node_sockets_listen_on_loopback_only() {
    let dir = tempfile::tempdir().unwrap();
    let (outputs, _) = run_world("loopback", 2, dir.path());
    assert_all_ok("loopback", &outputs);
}

/// Fails when a socket of process `pid` listens on anything but 127.0.0.0/8 or ::1.
fn assert_loopback_only(pid: u32) {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_owned))
        .collect();
    let mut listening = 0;
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f[3] != "0A" || !inodes.iter().any(|i| i == f[9]) {
                continue; // not LISTEN, or not this process's socket
            }
            listening += 1;
            let ip = f[1].split(':').next().unwrap();
            let loopback = ip.ends_with("7F") && ip.len() == 8 || ip == "00000000000000000000000001000000";
            assert!(loopback, "process {pid} listens on a non-loopback address: {}", f[1]);
        }
    }
    assert!(listening > 0, "process {pid} has no listening socket to check");
}

// ---- the ranks ----

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

fn parity_data() -> (Tensor, Tensor) {
    tch::manual_seed(11);
    let n = PARITY_STEPS * 2 * PARITY_B;
    let x = Tensor::randn([n, 6], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(3, [n], (Kind::Int64, Device::Cpu));
    (x, y)
}

fn flat_params(vs: &nn::VarStore) -> Tensor {
    Tensor::cat(&vs.trainable_variables().iter().map(|t| t.flatten(0, -1)).collect::<Vec<_>>(), 0)
}

#[test]
fn worker_entry() {
    let Ok(scenario) = std::env::var("DIST_SCENARIO") else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap();
    let rank: usize = env("RANK").parse().unwrap();
    let world: usize = env("WORLD_SIZE").parse().unwrap();
    let port: u16 = env("MASTER_PORT").parse().unwrap();
    let dir = std::path::PathBuf::from(env("DIST_DIR"));
    let store = Arc::new(Store::connect("127.0.0.1", port, TIMEOUT).unwrap());
    let pg = ProcessGroup::new(Backend::Gloo, store, rank, world, "127.0.0.1", TIMEOUT).unwrap();
    match scenario.as_str() {
        "collectives" => collectives(&pg),
        "ddp_identical" => ddp_identical(&pg),
        "sync_bn" => sync_bn(&pg),
        "parity" => parity(&pg, &dir),
        "early_exit" => early_exit(pg),
        "tensor_parallel" => crate::tensor_parallel::column_then_row(&pg),
        "loopback" => {
            pg.barrier().unwrap();
            assert_loopback_only(std::process::id());
            pg.barrier().unwrap();
        }
        other => panic!("unknown scenario {other}"),
    }
    println!("WORKER OK");
}

fn collectives(pg: &ProcessGroup) {
    let (r, w) = (pg.rank() as f64, pg.size() as f64);
    for kind in [Kind::Float, Kind::Double] {
        // 3M elements: larger than gloo's and c10d's chunking, several DDP buckets below.
        for n in [5i64, 3_000_000] {
            let base = Tensor::arange(n, (kind, Device::Cpu));
            let of = |t: &Tensor, i: i64| t.double_value(&[i]);
            let ranks_sum = w * (w - 1.0) / 2.0;
            for (op, expect) in [
                (ReduceOp::Sum, Box::new(move |x: f64| x * w + ranks_sum) as Box<dyn Fn(f64) -> f64>),
                (ReduceOp::Avg, Box::new(move |x: f64| x + ranks_sum / w)),
                (ReduceOp::Min, Box::new(|x: f64| x)),
                (ReduceOp::Max, Box::new(move |x: f64| x + w - 1.0)),
            ] {
                let mut t = &base + r;
                pg.all_reduce(&mut t, op).unwrap();
                for i in [0, n / 2, n - 1] {
                    assert_eq!(of(&t, i), expect(i as f64), "{op:?} {kind:?} n={n} at {i}");
                }
            }
            let root = pg.size() - 1;
            let mut t = &base * (r + 1.0);
            pg.broadcast(&mut t, root).unwrap();
            assert_eq!(of(&t, n - 1), (n - 1) as f64 * w, "broadcast {kind:?}");
            let gathered = pg.all_gather(&(&base + r)).unwrap();
            for (src, g) in gathered.iter().enumerate() {
                assert_eq!(of(g, n - 1), (n - 1) as f64 + src as f64, "all_gather {kind:?} from {src}");
            }
            if pg.size() > 1 {
                let next = (pg.rank() + 1) % pg.size();
                let prev = (pg.rank() + pg.size() - 1) % pg.size();
                let out = &base + r;
                let mut got = base.zeros_like();
                // Even ranks send first so that the ring cannot deadlock.
                if pg.rank().is_multiple_of(2) {
                    pg.send(&out, next, 3).unwrap();
                    pg.recv(&mut got, prev, 3).unwrap();
                } else {
                    pg.recv(&mut got, prev, 3).unwrap();
                    pg.send(&out, next, 3).unwrap();
                }
                assert_eq!(of(&got, n - 1), (n - 1) as f64 + prev as f64, "send/recv {kind:?}");
                // Every rank sends and receives at once: send_recv posts both before waiting.
                let mut got = base.zeros_like();
                pg.send_recv(&(&out * 2.0), next, 4, &mut got, prev, 4).unwrap();
                assert_eq!(of(&got, n - 1), 2.0 * ((n - 1) as f64 + prev as f64), "send_recv {kind:?}");
            }
        }
    }
    // DDP over parameters spanning several buckets (bucket cap 1 MB, 3 × 2 MB params).
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let params: Vec<Tensor> = (0..3).map(|i| root.zeros(&format!("p{i}"), &[512 * 1024])).collect();
    let mut ddp = Ddp::new(pg, &vs.trainable_variables(), 1.0, 1, None).unwrap();
    // torch's first iteration: one bucket; rebuilt by size before the next synchronised step.
    assert_eq!(ddp.buckets().unwrap(), 1);
    // d loss / d p = rank + 1 on each rank.
    let step = |ddp: &mut Ddp, sync: bool| {
        ddp.set_sync(sync);
        ddp.prepare_forward().unwrap();
        let loss = params.iter().map(|p| p.sum(Kind::Float) * (r + 1.0)).fold(Tensor::from(0.0f32), |a, b| a + b);
        ddp.prepare_backward().unwrap();
        loss.backward();
    };
    let grads = |what: &str, expected: f64| {
        for p in &params {
            assert_eq!(p.grad().double_value(&[1000]), expected, "{what}");
        }
    };
    step(&mut ddp, true);
    grads("bucketed gradient average", (w + 1.0) / 2.0);
    for p in &params {
        let _ = p.grad().zero_();
    }
    // no_sync: a micro-step only accumulates locally; the next synchronised step averages the sum.
    step(&mut ddp, false);
    grads("no_sync keeps the local gradient", r + 1.0);
    step(&mut ddp, true);
    let buckets = ddp.buckets().unwrap();
    assert!(buckets >= 3, "expected the rebuilt layout to have several buckets, got {buckets}");
    grads("the synchronised step averages the accumulated gradients", w + 1.0);
    pg.barrier().unwrap();
}

/// A small module built here: linear 6 → 4, SyncBatchNorm(4), relu, linear 4 → 3; one loss and
/// backward on this rank's rows, gradients averaged as DDP does; against the same module on both
/// ranks' rows in one process.
fn sync_bn(pg: &ProcessGroup) {
    use runner::model::batchnorm::SyncBatchNorm;
    const B: i64 = 5;
    let x_all = Tensor::arange(2 * B * 6, (Kind::Float, Device::Cpu)).view([2 * B, 6]).sin() * 2.0;
    let y_all = Tensor::arange(2 * B, (Kind::Int64, Device::Cpu)).remainder(3);
    let build = |vs: &nn::VarStore| {
        let a = nn::linear(vs.root() / "a", 6, 4, Default::default());
        let bn = SyncBatchNorm::new(&(vs.root() / "bn"), 4);
        let b = nn::linear(vs.root() / "b", 4, 3, Default::default());
        (a, bn, b)
    };
    let step = |x: &Tensor, y: &Tensor, group: Option<&ProcessGroup>| {
        tch::manual_seed(7);
        let vs = nn::VarStore::new(Device::Cpu);
        let (a, bn, b) = build(&vs);
        let h = bn.forward(&a.forward(x), true, group).unwrap().relu();
        let out = b.forward(&h);
        let loss = out.cross_entropy_for_logits(y);
        loss.backward();
        let mut grads: Vec<(String, Tensor)> =
            vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).map(|(n, t)| (n, t.grad())).collect();
        grads.sort_by(|p, q| p.0.cmp(&q.0));
        let mut flat = Tensor::cat(&grads.iter().map(|(_, g)| g.view([-1])).collect::<Vec<_>>(), 0);
        if let Some(pg) = group {
            pg.all_reduce(&mut flat, ReduceOp::Avg).unwrap();
        }
        let stats = Tensor::cat(&[bn.running_mean.shallow_clone(), bn.running_var.shallow_clone()], 0);
        (out.detach(), flat, stats)
    };
    let r = pg.rank() as i64;
    let (out, grads, stats) = step(&x_all.narrow(0, r * B, B), &y_all.narrow(0, r * B, B), Some(pg));
    let (out1, grads1, stats1) = step(&x_all, &y_all, None);
    let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    assert!(diff(&out, &out1.narrow(0, r * B, B)) < 1e-5, "outputs differ");
    assert!(diff(&grads, &grads1) < 1e-5, "gradients differ by {}", diff(&grads, &grads1));
    assert!(diff(&stats, &stats1) < 1e-5, "running statistics differ");
    // And plain (unsynchronised) batch norm does differ: the test can tell.
    let (_, local, _) = step(&x_all.narrow(0, r * B, B), &y_all.narrow(0, r * B, B), None);
    let mut local = local;
    pg.all_reduce(&mut local, ReduceOp::Avg).unwrap();
    assert!(diff(&local, &grads1) > 1e-4, "per-rank batch norm should differ");
}

fn ddp_identical(pg: &ProcessGroup) {
    // A different seed on every rank: construction must broadcast rank 0's weights.
    tch::manual_seed(100 + pg.rank() as i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "a", 10, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "b", 64, 4, Default::default()));
    let mut ddp = Ddp::new(pg, &vs.trainable_variables(), 25.0, 1, None).unwrap();
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.05).unwrap();
    for _ in 0..20 {
        let x = Tensor::randn([16, 10], (Kind::Float, Device::Cpu));
        let y = Tensor::randint(4, [16], (Kind::Int64, Device::Cpu));
        ddp.prepare_forward().unwrap();
        let loss = model.forward(&x).cross_entropy_for_logits(&y);
        ddp.prepare_backward().unwrap();
        // The Reducer's gradients are views of its buckets: dropped, not zeroed in place.
        runner::dist::clear_grads(&vs.trainable_variables()).unwrap();
        loss.backward();
        opt.step();
    }
    let mine = flat_params(&vs);
    for (src, other) in pg.all_gather(&mine).unwrap().iter().enumerate() {
        assert!(other.equal(&mine), "rank {src}'s parameters differ from rank {}'s", pg.rank());
    }
}

fn parity(pg: &ProcessGroup, dir: &std::path::Path) {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = parity_model(&vs.root());
    let mut ddp = Ddp::new(pg, &vs.trainable_variables(), 25.0, 1, None).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let (x, y) = parity_data();
    let r = pg.rank() as i64;
    for step in 0..PARITY_STEPS {
        // Disjoint halves of the same global batch of 2B.
        let start = step * 2 * PARITY_B + r * PARITY_B;
        let rows = Tensor::arange_start(start, start + PARITY_B, (Kind::Int64, Device::Cpu));
        ddp.prepare_forward().unwrap();
        let loss = model.forward(&x.index_select(0, &rows)).cross_entropy_for_logits(&y.index_select(0, &rows));
        ddp.prepare_backward().unwrap();
        runner::dist::clear_grads(&vs.trainable_variables()).unwrap();
        loss.backward();
        opt.step();
    }
    flat_params(&vs).save(dir.join(format!("params-{}.pt", pg.rank()))).unwrap();
}

fn early_exit(pg: ProcessGroup) {
    // Every rank's group is whole first: a rank that left while another was still connecting
    // its mesh would fail that rank's group creation, not the collective under test.
    pg.barrier().unwrap();
    if pg.rank() == pg.size() - 1 {
        drop(pg);
        std::process::exit(0);
    }
    let mut t = Tensor::ones([4], (Kind::Float, Device::Cpu));
    match pg.all_reduce(&mut t, ReduceOp::Sum) {
        Ok(()) => panic!("all_reduce succeeded without rank {}", pg.size() - 1),
        Err(e) => println!("EXPECTED ERROR: {e}"),
    }
}

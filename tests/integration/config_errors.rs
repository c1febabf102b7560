//! Snapshot tests of what a user sees for bad configurations: the exact message on stderr, exit
//! code 2, and nothing written. Each runs the real binary (`runner validate` and `runner run`).
use crate::common;

use common::{runner, text, write, TINY};

struct Case {
    name: &'static str,
    /// Appended to the TINY pipeline (as new tables: TOML forbids redefining TINY's).
    file: &'static str,
    args: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
    expected: &'static str,
}

const CASES: &[Case] = &[
    Case {
        name: "a peak no device has",
        file: "",
        args: &["--set", "run.peak_tflops=1e-30"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `run.peak_tflops` (--set run.peak_tflops=1e-30): must be between \
                   0.001 (1 GFLOP/s) and 1000000 TFLOP/s, got 1e-30: give the device's peak matrix-product rate in \
                   TFLOP/s (989 for an H100's dense bfloat16), or leave it out to measure it",
    },
    Case {
        name: "misspelled key in the file",
        file: "[validate]\nevry = 2\n",
        args: &[],
        env: &[],
        expected: "error: p.toml:21:1: unknown key `validate.evry`; did you mean `validate.every`? \
                   (valid keys in [validate]: validate.every, validate.every_steps, validate.batches, validate.on, validate.fraction, validate.rows)\n  21 | evry = 2",
    },
    Case {
        name: "a model kind that does not exist",
        file: "",
        args: &["--set", "wrap.model.kind=\"resnet\""],
        env: &[],
        expected: "error: --set wrap.model.kind=\"resnet\": `wrap.model` cannot be \"resnet\" (one of: \"mlp\", \"cnn\", \"torchscript\", \"transformer\")",
    },
    Case {
        name: "misspelled section",
        file: "[trian]\nepochs = 2\n",
        args: &[],
        env: &[],
        expected: "error: p.toml:20:2: unknown key `trian`; did you mean `train`? \
                   (valid keys in the file: run, load, shard, normalize, wrap, train, validate, trace, checkpoint, track)\n  20 | [trian]",
    },
    Case {
        name: "wrong type in the file",
        file: "[validate]\nevery = \"often\"\n",
        args: &[],
        env: &[],
        expected: "error: p.toml:21:9: `validate.every`: invalid type: string \"often\", expected usize\n  21 | every = \"often\"",
    },
    Case {
        name: "unknown choice",
        file: "[validate]\non = \"rank1\"\n",
        args: &[],
        env: &[],
        expected: "error: p.toml:21:6: `validate.on` cannot be \"rank1\"; did you mean \"rank0\"? (one of: \"rank0\", \"all\", \"split\")\n  21 | on = \"rank1\"",
    },
    Case {
        name: "duplicate key",
        file: "[validate]\nevery = 1\nevery = 2\n",
        args: &[],
        env: &[],
        expected: "error: p.toml:22:1: duplicate key\n  22 | every = 2",
    },
    Case {
        name: "misspelled --set key",
        file: "",
        args: &["--set", "train.lrr=0.1"],
        env: &[],
        expected: "error: --set train.lrr=0.1: unknown key `train.lrr`; did you mean `train.lr`? (valid keys in [train]: \
                   train.epochs, train.steps, train.batch_size, train.global_batch_size, train.optimizer, train.lr, train.momentum, train.betas, train.eps, train.weight_decay, train.weight_decay_on, train.fused, train.task, \
                   train.clip_grad_norm, train.accumulate, train.precision, train.schedule, train.early_stop)",
    },
    Case {
        name: "--set value of the wrong type",
        file: "",
        args: &["--set", "train.epochs=abc"],
        env: &[],
        expected: "error: --set train.epochs=abc: `train.epochs`: invalid type: found string \"abc\", expected usize",
    },
    Case {
        name: "--set without a value",
        file: "",
        args: &["--set", "train.epochs"],
        env: &[],
        expected: "error: --set train.epochs: expected KEY=VALUE, e.g. train.lr=0.05",
    },
    Case {
        name: "misspelled environment variable",
        file: "",
        args: &[],
        env: &[("RUNNER_TRAIN__LRR", "0.5")],
        expected: "error: environment variable RUNNER_TRAIN__LRR: unknown key `train.lrr`; did you mean `train.lr`? (valid keys in [train]: \
                   train.epochs, train.steps, train.batch_size, train.global_batch_size, train.optimizer, train.lr, train.momentum, train.betas, train.eps, train.weight_decay, train.weight_decay_on, train.fused, train.task, \
                   train.clip_grad_norm, train.accumulate, train.precision, train.schedule, train.early_stop)",
    },
    Case {
        name: "environment value of the wrong type",
        file: "",
        args: &[],
        env: &[("RUNNER_TRAIN__EPOCHS", "x")],
        expected: "error: environment variable RUNNER_TRAIN__EPOCHS: `train.epochs`: invalid type: found string \"x\", expected usize",
    },
    Case {
        name: "zero ranks",
        file: "",
        args: &["--set", "run.world_size=0"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `run.world_size` (--set run.world_size=0): must be at least 1",
    },
    Case {
        name: "batch larger than a shard",
        file: "",
        args: &["--set", "train.batch_size=400"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `train.batch_size` (--set train.batch_size=400): 400 per rank is larger than \
                   a rank's shard of 300 rows (600 rows / 2 ranks); use at most 300",
    },
    Case {
        name: "one class",
        file: "",
        args: &[],
        env: &[("RUNNER_LOAD__CLASSES", "1")],
        expected: "error: p.toml: invalid configuration:\n  `load.classes` (env RUNNER_LOAD__CLASSES): must be at least 2 for classification, got 1",
    },
    Case {
        name: "nccl on cpu",
        file: "",
        args: &["--set", "run.backend=nccl"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `run.backend` (--set run.backend=nccl): nccl moves GPU memory only \
                   (torch fails its first collective on CPU tensors: \"Tensors must be CUDA and dense\"); use \"gloo\" with \
                   device = \"cpu\", or device = \"cuda\"",
    },
    Case {
        name: "missing data file",
        file: "",
        args: &["--set", "load.source=\"csv\"", "--set", "load.path=missing.csv", "--set", "load.target=label", "--set", "load.validation_rows=1000"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `load.path` (--set load.path=missing.csv): missing.csv does not exist \
                   (paths are relative to the pipeline file)",
    },
    Case {
        name: "absent target column",
        file: "",
        args: &["--set", "load.source=\"csv\"", "--set", "load.path=labels.csv", "--set", "load.target=lable", "--set", "load.validation_rows=1000"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `load.path` (--set load.path=labels.csv): labels.csv has no column `lable`; \
                   did you mean `label`? (columns: a, b, label)",
    },
    Case {
        name: "a regression target that is not numeric",
        file: "",
        args: &["--set", "load.source=\"csv\"", "--set", "load.path=named.csv", "--set", "load.target=name", "--set", "load.validation_rows=1000", "--set", "train.task=\"regression\""],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `load.path` (--set load.path=named.csv): target `name` of named.csv holds \
                   text: train.task = \"regression\" needs numbers",
    },
    Case {
        name: "features that do not match the file, and more rows than it has",
        file: "",
        args: &["--set", "load.source=\"csv\"", "--set", "load.path=labels.csv", "--set", "load.target=label", "--set", "load.features=5", "--set", "load.validation_rows=1000", "--set", "validate.fraction=0"],
        env: &[],
        expected: "error: p.toml: 3 problems in the configuration:\n  \
                   `load.rows` (file p.toml:9): asks for 600 rows but labels.csv has 3\n  \
                   `load.features` (--set load.features=5): is 5 but labels.csv gives 2 inputs besides `label`\n  \
                   `train.batch_size` (file p.toml:19): 16 per rank is larger than a rank's shard of 2 rows (3 rows / 2 ranks); use at most 2",
    },
    Case {
        name: "missing initial weights",
        file: "",
        args: &["--set", "wrap.init=\"none.npz\""],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.init` (--set wrap.init=\"none.npz\"): none.npz does not exist \
                   (paths are relative to the pipeline file)",
    },
    Case {
        name: "initial weights of another model",
        file: "",
        args: &["--set", "wrap.init=\"w.npz\""],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.init` (--set wrap.init=\"w.npz\"): w.npz does not fit the model: \
                   `layer0.weight` is [16, 4], the model's is [16, 5]; no `layer1.bias`",
    },
    Case {
        name: "every problem at once",
        file: "",
        args: &["--set", "train.lr=-1", "--set", "train.epochs=0", "--set", "wrap.model.dropout=1.5", "--set", "run.name=\"a/b\""],
        env: &[],
        expected: "error: p.toml: 4 problems in the configuration:\n  \
                   `run.name` (--set run.name=\"a/b\"): \"a/b\" cannot name a directory: use letters, digits, '-' and '_'\n  \
                   `wrap.model.dropout` (--set wrap.model.dropout=1.5): must be in [0, 1), got 1.5\n  \
                   `train.epochs` (--set train.epochs=0): must be at least 1\n  \
                   `train.lr` (--set train.lr=-1): must be positive, got -1",
    },
    Case {
        name: "misspelled key in [wrap.pipeline]",
        file: "[wrap.pipeline]\nmicro_batch = 4\n",
        args: &[],
        env: &[],
        expected: "error: p.toml:21:1: unknown key `wrap.pipeline.micro_batch`; did you mean `wrap.pipeline.micro_batches`? \
                   (valid keys in [wrap.pipeline]: wrap.pipeline.stages, wrap.pipeline.micro_batches, wrap.pipeline.schedule, \
                   wrap.pipeline.replicas)\n  \
                   21 | micro_batch = 4",
    },
    Case {
        name: "unknown strategy from --set",
        file: "",
        args: &["--set", "wrap.strategy=\"pipe\""],
        env: &[],
        expected: "error: --set wrap.strategy=\"pipe\": `wrap.strategy` cannot be \"pipe\"; did you mean \"pipeline\"? \
                   (one of: \"ddp\", \"none\", \"pipeline\", \"fsdp\", \"auto\")",
    },
    Case {
        name: "pipeline stages out of order",
        file: "",
        args: &["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.model.hidden=[16, 16, 16]", "--set", "wrap.pipeline.stages=[[0, 1], [3], [2]]"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.pipeline.stages` (--set wrap.pipeline.stages=[[0, 1], [3], [2]]): \
                   stage 1 is [3], but the layers must come in order, each exactly once: stage 1 must start with layer 2 and \
                   list consecutive layers",
    },
    Case {
        name: "pipeline stages that do not match the world size",
        file: "",
        args: &["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.model.hidden=[16, 16, 16]", "--set", "wrap.pipeline.stages=[[0], [1], [2, 3]]"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.pipeline.stages` (--set wrap.pipeline.stages=[[0], [1], [2, 3]]): \
                   lists 3 stages but run.world_size (file p.toml:5) is 2; a pipeline has one stage per rank",
    },
    Case {
        name: "more ranks than layers",
        file: "",
        args: &["--set", "wrap.strategy=\"pipeline\"", "--set", "run.world_size=4"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `run.world_size` (--set run.world_size=4): 4 ranks, but the model has \
                   2 layers (1 hidden + the output layer); a pipeline needs at least one layer per rank: use at most 2 ranks, \
                   or more hidden layers",
    },
    Case {
        name: "what a pipeline cannot do",
        file: "",
        args: &["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.pipeline.micro_batches=17", "--set", "validate.on=\"all\""],
        env: &[],
        expected: "error: p.toml: 2 problems in the configuration:\n  \
                   `wrap.pipeline.micro_batches` (--set wrap.pipeline.micro_batches=17): 17 micro-batches of a batch of 16 rows \
                   would leave some empty; use at most 16\n  \
                   `validate.on` (--set validate.on=\"all\"): \"all\" validates every replica, but a pipeline is one model: its \
                   validation runs through every rank; use \"rank0\"",
    },
    Case {
        name: "the training recipe's impossible combinations",
        file: "",
        args: &["--set", "train.precision=\"fp16\"", "--set", "train.accumulate=100", "--set", "validate.every=0",
                "--set", "train.early_stop.metric=\"val_acc\""],
        env: &[],
        expected: "error: p.toml: 3 problems in the configuration:\n  \
                   `train.precision` (--set train.precision=\"fp16\"): \"fp16\" (with dynamic loss scaling) needs a GPU: CPUs have \
                   no fast float16 arithmetic; use \"bf16\" on CPU (autocast to bfloat16, float32 weights) or \"fp32\"\n  \
                   `validate.every` (--set validate.every=0): is 0 (no validation), but [train.early_stop] watches a validation \
                   metric: validate, or remove [train.early_stop]\n  \
                   `train.accumulate` (--set train.accumulate=100): 100 batches per optimizer step, but an epoch has only 19 \
                   batches per rank; use at most 19",
    },
    Case {
        name: "a pipeline key without the pipeline",
        file: "",
        args: &["--set", "wrap.pipeline.micro_batches=4"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.pipeline.micro_batches` (--set wrap.pipeline.micro_batches=4): \
                   is only read by wrap.strategy = \"pipeline\"",
    },
    Case {
        name: "a model over the memory a rank may use, on one rank",
        file: "",
        args: &["--set", "run.world_size=1", "--set", "wrap.strategy=\"none\"", "--set", "load.features=256", "--set", "load.classes=256", "--set", "wrap.model.hidden=[256, 256, 256]", "--set", "run.memory_per_rank_mb=153.5"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `run.memory_per_rank_mb` (--set run.memory_per_rank_mb=153.5): each rank would \
                   need 156 MiB: 2.0 MiB (parameters 1.0 MiB, gradients 1.0 MiB, optimizer 0.0 MiB) of training state and 154 \
                   MiB besides (activations, data, libtorch), under wrap.strategy = \"none\" at world size 1, more than the \
                   153.5 MiB a rank may use; wrap.strategy = \"fsdp\" fits from run.world_size = 32 (153 MiB a rank), or \
                   wrap.strategy = \"pipeline\" fits from run.world_size = 2 (153 MiB on its heaviest rank); wrap.strategy = \
                   \"auto\" picks the first strategy that fits",
    },
    Case {
        name: "the same model in a pipeline of one stage",
        file: "",
        args: &["--set", "run.world_size=1", "--set", "wrap.strategy=\"pipeline\"", "--set", "load.features=256", "--set", "load.classes=256", "--set", "wrap.model.hidden=[256, 256, 256]", "--set", "run.memory_per_rank_mb=153.5"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `run.memory_per_rank_mb` (--set run.memory_per_rank_mb=153.5): rank 0 (layers 0-3) \
                   would need 156 MiB: 2.0 MiB (parameters 1.0 MiB, gradients 1.0 MiB, optimizer 0.0 MiB) of training state \
                   and 154 MiB besides (activations, data, libtorch), under the pipeline at world size 1, more than the 153.5 \
                   MiB a rank may use; wrap.strategy = \"fsdp\" fits from run.world_size = 32 (153 MiB a rank), or the \
                   pipeline fits from run.world_size = 2 (153 MiB on its heaviest rank); wrap.strategy = \"auto\" picks the \
                   first strategy that fits",
    },
    Case {
        name: "a layer over the memory one rank may use",
        file: "",
        args: &["--set", "run.world_size=4", "--set", "wrap.strategy=\"pipeline\"", "--set", "load.features=256", "--set", "load.classes=256", "--set", "wrap.model.hidden=[256, 256, 256]", "--set", "run.memory_per_rank_mb=151.5"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `run.memory_per_rank_mb` (--set run.memory_per_rank_mb=151.5): rank 0 (layer 0) would \
                   need 152 MiB: 0.5 MiB (parameters 0.3 MiB, gradients 0.3 MiB, optimizer 0.0 MiB) of training state and 151 \
                   MiB besides (activations, data, libtorch), under the pipeline at world size 4, more than the 151.5 MiB a rank \
                   may use; no strategy fits it on up to 4096 ranks: use a smaller model, or a higher run.memory_per_rank_mb; no \
                   mesh shape of this world size fits either (the smallest, data 1 × tensor 2 × pipeline 2, needs 152 MiB)",
    },
    Case {
        name: "explicit stages that overload a rank",
        file: "",
        args: &["--set", "run.world_size=2", "--set", "wrap.strategy=\"pipeline\"", "--set", "load.features=256", "--set", "load.classes=256", "--set", "wrap.model.hidden=[256, 256, 256]", "--set", "wrap.pipeline.stages=[[0], [1, 2, 3]]", "--set", "run.memory_per_rank_mb=154"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `run.memory_per_rank_mb` (--set run.memory_per_rank_mb=154): rank 1 (layers 1-3) \
                   would need 154 MiB: 1.5 MiB (parameters 0.8 MiB, gradients 0.8 MiB, optimizer 0.0 MiB) of training state \
                   and 153 MiB besides (activations, data, libtorch), under the pipeline at world size 2, more than the 154 MiB \
                   a rank may use; leave wrap.pipeline.stages out: the split balanced by parameters fits; at this world size \
                   the mesh shape data 1 × tensor 2 under DDP (wrap.mesh.data = 1, wrap.mesh.tensor = 2: 154 MiB a rank) fits \
                   (set wrap.strategy and [wrap.mesh] so, or wrap.strategy = \"auto\" with no [wrap.mesh] chooses among them)",
    },
    Case {
        name: "copies of a pipeline that do not split the ranks",
        file: "",
        args: &["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.pipeline.replicas=3", "--set", "run.world_size=4"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.pipeline.replicas` (--set wrap.pipeline.replicas=3): 3 copies of \
                   the pipeline do not split run.world_size = 4 evenly; use a divisor of it",
    },
    Case {
        name: "stages that do not match the ranks of a copy",
        file: "",
        args: &["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.pipeline.replicas=2", "--set", "run.world_size=4", "--set", "wrap.model.hidden=[16, 16, 16]", "--set", "wrap.pipeline.stages=[[0], [1], [2, 3]]"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.pipeline.stages` (--set wrap.pipeline.stages=[[0], [1], [2, 3]]): \
                   lists 3 stages but each of the 2 copies has 2 ranks (run.world_size (--set run.world_size=4) / replicas); \
                   a pipeline has one stage per rank",
    },
    Case {
        name: "a mesh whose product is not the world size",
        file: "",
        args: &["--set", "run.world_size=4", "--set", "wrap.mesh.tensor=3"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.mesh.tensor` (--set wrap.mesh.tensor=3): data = 1 × tensor = 3 × \
                   pipeline = 1 is 3 ranks, but run.world_size = 4; tensor × pipeline must divide it: use one of 1, 2, 4",
    },
    Case {
        name: "a mesh's data dimension that does not fill the world",
        file: "[wrap.mesh]\ndata = 3\n",
        args: &["--set", "run.world_size=4"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.mesh.data` (file p.toml:21): data = 3 × tensor = 1 × pipeline = 1 is 3 \
                   ranks, but run.world_size = 4; use data = 4 (or leave it out: it is worked out)",
    },
    Case {
        name: "hidden widths the tensor ranks cannot split",
        file: "",
        args: &["--set", "wrap.mesh.tensor=2", "--set", "wrap.model.hidden=[15, 5]"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.mesh.tensor` (--set wrap.mesh.tensor=2): 2 tensor ranks cannot split \
                   wrap.model.hidden = 15 evenly; the degrees that divide it: 1, 3, 5, 15",
    },
    Case {
        name: "sequence parallelism without tensor ranks",
        file: "",
        args: &["--set", "wrap.mesh.sequence_parallel=true"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.mesh.sequence_parallel` (--set \
                   wrap.mesh.sequence_parallel=true): splits the activations between the tensor-parallel layers along \
                   the sequence over the tensor group, but wrap.mesh.tensor = 1; set wrap.mesh.tensor above 1, or \
                   remove sequence_parallel",
    },
    Case {
        name: "a pipeline dimension without a pipeline",
        file: "",
        args: &["--set", "wrap.mesh.pipeline=2"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.mesh.pipeline` (--set wrap.mesh.pipeline=2): splits the layers into \
                   stages, which only wrap.strategy = \"pipeline\" does; set it, or leave wrap.mesh.pipeline out",
    },
    Case {
        name: "stages that do not match the mesh's pipeline dimension",
        file: "",
        args: &["--set", "run.world_size=4", "--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.model.hidden=[16, 16, 16]", "--set", "wrap.mesh.data=2", "--set", "wrap.pipeline.stages=[[0], [1], [2, 3]]"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.pipeline.stages` (--set wrap.pipeline.stages=[[0], [1], [2, 3]]): \
                   lists 3 stages but the mesh's pipeline dimension is 2 ([wrap.mesh]); a pipeline has one stage per rank",
    },
    Case {
        name: "a pipeline's copies given twice",
        file: "",
        args: &["--set", "run.world_size=4", "--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.model.hidden=[16, 16]", "--set", "wrap.mesh.data=2", "--set", "wrap.pipeline.replicas=2"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `wrap.pipeline.replicas` (--set wrap.pipeline.replicas=2): says how many \
                   copies of the pipeline run, as wrap.mesh.data does; with [wrap.mesh] set, remove wrap.pipeline.replicas and \
                   give the copies as wrap.mesh.data",
    },
];

/// What a build without the `cuda` feature says to GPU configurations: the command that builds
/// the CUDA version. (The CUDA build's refusal without a GPU is in tests/integration/gpu.rs.)
#[cfg(not(feature = "cuda"))]
const CPU_BUILD_CASES: &[Case] = &[
    Case {
        name: "cuda on a build without CUDA",
        file: "",
        args: &["--set", "run.device=cuda"],
        env: &[],
        expected: "error: p.toml: invalid configuration:\n  `run.device` (--set run.device=cuda): this runner was built without \
                   CUDA; build the CUDA version (./scripts/setup.sh --cuda && LIBTORCH=$PWD/.deps/libtorch-cuda cargo build \
                   --release --features cuda --target-dir target/cuda), or use \"cpu\"",
    },
    Case {
        name: "nccl and cuda on a build without CUDA",
        file: "",
        args: &["--set", "run.device=cuda", "--set", "run.backend=nccl"],
        env: &[],
        expected: "error: p.toml: 2 problems in the configuration:\n  `run.device` (--set run.device=cuda): this runner was built without \
                   CUDA; build the CUDA version (./scripts/setup.sh --cuda && LIBTORCH=$PWD/.deps/libtorch-cuda cargo build \
                   --release --features cuda --target-dir target/cuda), or use \"cpu\"\n  \
                   `run.backend` (--set run.backend=nccl): this runner was built without CUDA, so without NCCL; build the \
                   CUDA version (./scripts/setup.sh --cuda && LIBTORCH=$PWD/.deps/libtorch-cuda cargo build --release \
                   --features cuda --target-dir target/cuda)",
    },
];

#[test]
#[cfg(not(feature = "cuda"))]
fn gpu_configurations_name_the_cuda_build() {
    for case in CPU_BUILD_CASES {
        check(case, "validate");
        check(case, "run");
    }
}

fn check(case: &Case, command: &str) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &format!("{TINY}{}", case.file));
    write(dir.path(), "labels.csv", "a,b,label\n1,2,0\n3,4,1\n5,6,2\n");
    write(dir.path(), "named.csv", "a,b,label,name\n1,2,0,x\n3,4,1,y\n5,6,2,z\n");
    // Weights of a 4-feature model, one tensor short.
    let zeros = |shape: &[i64]| tch::Tensor::zeros(shape, (tch::Kind::Float, tch::Device::Cpu));
    let weights =
        [("layer0.weight", zeros(&[16, 4])), ("layer0.bias", zeros(&[16])), ("layer1.weight", zeros(&[3, 16]))];
    tch::Tensor::write_npz(&weights, dir.path().join("w.npz")).unwrap();
    let mut cmd = runner();
    cmd.current_dir(dir.path()).args([command, "p.toml"]).args(case.args);
    for (k, v) in case.env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{}: expected exit code 2\nstdout:\n{stdout}\nstderr:\n{stderr}", case.name);
    assert_eq!(stderr.trim_end(), case.expected, "{}: the message changed", case.name);
    assert!(!dir.path().join("results").exists(), "{}: a rejected config wrote results", case.name);
}

#[test]
fn bad_configurations_are_explained_by_validate() {
    for case in CASES {
        check(case, "validate");
    }
}

#[test]
fn bad_configurations_are_refused_by_run_before_any_rank_starts() {
    for case in CASES {
        check(case, "run");
    }
}

#[test]
fn a_missing_pipeline_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = runner().current_dir(dir.path()).args(["validate", "nope.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out).1.trim_end(),
        "error: cannot read the pipeline file nope.toml: No such file or directory (os error 2)"
    );
}

/// The command line's mistakes, whichever command: exit code 2 (as a missing pipeline file or a
/// run directory without a plan), the message, and nothing written.
#[test]
fn usage_errors_of_every_command_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "p.toml", TINY);
    let o =
        runner().current_dir(p).args(["run", "p.toml", "--out", "r", "--set", "run.world_size=1"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o).1);
    std::fs::create_dir(p.join("s")).unwrap();
    write(p, "s/sweep.json", r#"{"experiment": "e.toml", "axes": [], "points": []}"#);
    let cases: &[(&[&str], &str)] = &[
        (
            &["export", "r", "--hf", "out"],
            "error: export --hf writes a language model, but this run trained a MLP 5-16-3",
        ),
        (&["eval", "r", "p.toml"], "error: runner eval measures a language model, not this run's MLP 5-16-3"),
        (
            &["predict", "r", "--prompt", "to be"],
            "error: --prompt samples a language model, but this run trained a MLP",
        ),
        (&["predict", "r", "missing.csv"], "error: cannot read missing.csv: No such file or directory"),
        (
            &["prepare", "text", "missing.txt", "--out", "out"],
            "error: cannot read missing.txt: No such file or directory",
        ),
        (&["run", "p.toml", "--out", "p.toml"], "error: p.toml is a file, not a directory: give --out a directory"),
        (&["report", "s"], "error: s has no completed point to report on (0 points: run `runner sweep e.toml` first)"),
    ];
    for (args, message) in cases {
        let o = runner().current_dir(p).args(*args).output().unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: expected\n{message}\nin\n{err}");
        assert!(!p.join("out").exists(), "{args:?} wrote out");
    }
}

//! Every integration test, in one binary: each module is one area (its page in
//! docs/development.md), and they share `common`. One binary links once, where a binary per file
//! linked the runner, libtorch's bindings and polars some 45 times (most of the suite's build time,
//! and gigabytes of disk). `cargo test --test integration AREA::` runs one area.
mod common;

mod architecture;
mod bench;
mod big_data;
mod checkpoint;
mod config_errors;
mod dist;
mod docs;
mod docs_output;
mod engines;
mod eval;
mod extends;
mod fsdp;
mod fsdp2_twin;
mod fsdp_memory;
mod gpu;
mod gpu_check;
mod hf;
mod hf_files;
mod hostile;
mod hostile_files;
mod hostile_sharded;
mod hostile_turn;
mod lm_recipe;
mod lora;
mod mesh;
mod mlflow;
mod models;
mod multinode;
mod newcomer;
mod numerics;
mod pipeline;
mod plan;
mod real_data;
mod recipe;
mod recover;
mod reshard;
mod resnet;
mod run;
mod rundir;
mod search;
mod slurm;
mod slurm_hosts;
mod steps;
mod supervision;
mod sweep;
mod tensor_parallel;
mod thread_replicas;
mod tokenizer;
mod track;
mod transformer;
mod validate_split;

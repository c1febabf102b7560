//! `runner`: distributed data-parallel training experiments described by TOML files, run with
//! libtorch (`tch`) and PyTorch's collective engine (c10d).
//!
//! Data flows one way: [`config`] → [`plan`] → [`launch`] → ranks ([`stages`], over [`data`],
//! [`model`] and [`strategy`]) → [`trace`]; a [`sweep`] runs a grid of plans, or a [`search`] of
//! them, and [`report`] turns their traces into tables and plots.
#[macro_use]
pub mod say;
pub mod bench;
pub mod checked;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod device;
pub mod dist;
pub mod eval;
pub mod export;
pub mod input;
pub mod launch;
pub mod limits;
pub mod model;
pub mod numerics;
pub mod plan;
pub mod predict;
pub mod prepare;
pub mod preprocessing;
pub mod preview;
pub mod report;
pub mod rng;
pub mod rundir;
pub mod sample;
pub mod search;
pub mod signals;
pub mod stages;
pub mod strategy;
pub mod sweep;
pub mod tensorfile;
pub mod testhook;
pub mod tokenizer;
pub mod trace;

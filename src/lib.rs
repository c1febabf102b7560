//! `runner`: distributed data-parallel training experiments described by TOML files, run with
//! libtorch (`tch`) and PyTorch's collective engine (c10d).
//!
//! Data flows one way: config → [`config::Plan`] → [`launch`] → ranks ([`stages`]) → [`trace`];
//! a [`sweep`] runs a grid of plans and [`report`] turns their traces into tables and plots.
pub mod bench;
pub mod cli;
pub mod config;
pub mod device;
pub mod dist;
pub mod launch;
pub mod model;
pub mod report;
pub mod rng;
pub mod stages;
pub mod sweep;
pub mod trace;

//! `runner`: distributed data-parallel training experiments described by TOML files, run with
//! libtorch (`tch`) and PyTorch's collective engine (c10d).
//!
//! Data flows one way: config → [`config::Plan`] → [`launch`] → ranks ([`stages`]) → [`trace`].
pub mod cli;
pub mod config;
pub mod dist;
pub mod launch;
pub mod model;
pub mod rng;
pub mod stages;
pub mod trace;

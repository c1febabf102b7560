//! Launching: `runner run` either becomes one rank (when the torchrun variables are set) or
//! spawns and supervises `world_size` rank processes itself.
pub mod env;
pub mod rank;
pub mod spawn;
pub mod watchdog;

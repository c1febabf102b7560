//! Launching: `runner run` either becomes one rank (when the torchrun variables are set, or
//! under srun with several tasks per node) or spawns and supervises `world_size` rank processes
//! itself.
pub mod agree;
pub mod elastic;
pub mod engines;
pub mod env;
pub mod nodes;
pub mod rank;
pub mod restart;
pub mod slurm;
pub mod spawn;
pub mod watchdog;

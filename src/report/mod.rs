//! Reports of a sweep directory, rebuilt from its traces alone (nothing runs): the table
//! (`table.md`, `table.csv`, `summary.parquet`) and the plots (`loss.png`, `val_accuracy.png`,
//! `throughput.png`). [`aggregate`] reads the traces, [`stats`] holds the arithmetic, [`table`]
//! and [`plot`] render. A search's directory gets its own report ([`search`]: every trial,
//! [`search_table`], [`search_plot`] and the best trial's pipeline file).
//!
//! ```text
//! runner report results/world_size
//! ```
pub mod aggregate;
pub mod measured;
pub mod plot;
pub mod search;
pub mod search_plot;
pub mod search_table;
pub mod stats;
pub mod table;

use std::path::Path;

use crate::rundir::atomic_write;
use crate::rundir::index::Index;
use crate::trace::write_parquet;

/// Rebuilds every table and plot in `dir`; returns the markdown table.
pub fn write(dir: &Path) -> anyhow::Result<String> {
    let index = Index::read(dir)?;
    if let Some(search) = &index.search {
        return search::write(dir, &index, search);
    }
    let loaded = aggregate::load(dir, &index)?;
    if loaded.points.is_empty() {
        let why = format!(
            "{} has no completed point to report on ({} points: run `runner sweep {}` first)",
            dir.display(),
            index.points.len(),
            index.experiment
        );
        return Err(crate::config::ConfigError::new(why).into());
    }
    let rows = aggregate::rows(&loaded.points);
    let md = table::markdown(&index, &loaded, &rows);
    let mut summary = table::frame(&rows)?;
    write_parquet(&dir.join("summary.parquet"), &mut summary)?;
    atomic_write(&dir.join("table.csv"), &table::csv(&mut summary)?)?;
    atomic_write(&dir.join("table.md"), md.as_bytes())?;
    let plots = plot::write_all(dir, &rows)?;
    Ok(format!("{md}\nWritten in {}: table.md, table.csv, summary.parquet, {}", dir.display(), plots.join(", ")))
}

//! Each rank's peak resident memory, measured from outside and the same way for both sides: while
//! a run's launcher (the runner's own, or torchrun) lives, its descendants whose environment holds
//! `RANK=r` are its ranks (the highest such process: one a rank started inherits its RANK), and
//! their `VmHWM` (the kernel's high-water mark of the resident set) is read every [`EVERY`]. The
//! mark only rises, so a sample loses nothing but a rise in the last [`EVERY`] of a rank's life.
use std::collections::BTreeMap;
use std::process::{Child, ExitStatus};
use std::time::Duration;

/// How often the ranks' marks are read.
pub const EVERY: Duration = Duration::from_millis(50);

/// Waits for `launcher` to exit, reading its ranks' peak resident memory meanwhile: the exit
/// status and each rank's peak in bytes (rank 0 first; a rank never seen is left out).
pub fn wait_measuring(launcher: &mut Child, ranks: usize) -> std::io::Result<(ExitStatus, Vec<u64>)> {
    let mut pids: BTreeMap<u32, usize> = BTreeMap::new();
    let mut peaks: BTreeMap<usize, u64> = BTreeMap::new();
    loop {
        // Until every rank is known, look for them among the launcher's descendants.
        if pids.values().collect::<std::collections::BTreeSet<_>>().len() < ranks {
            let mut seen: BTreeMap<u32, Option<usize>> = BTreeMap::new();
            for (pid, parent) in descendants(launcher.id()) {
                let rank = rank_of(pid);
                let inherited = rank.is_some() && seen.get(&parent) == Some(&rank);
                seen.insert(pid, rank);
                if let (Some(rank), false) = (rank, inherited) {
                    pids.insert(pid, rank);
                }
            }
        }
        for (pid, rank) in &pids {
            if let Some(hwm) = high_water_mark(*pid) {
                let peak = peaks.entry(*rank).or_default();
                *peak = (*peak).max(hwm);
            }
        }
        if let Some(status) = launcher.try_wait()? {
            return Ok((status, peaks.into_values().collect()));
        }
        std::thread::sleep(EVERY);
    }
}

/// Every process below `root` (children, their children, ...) with its parent, parents first,
/// from /proc.
fn descendants(root: u32) -> Vec<(u32, u32)> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    let all: Vec<(u32, u32)> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, parent(pid)?)))
        .collect();
    let mut found = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(pid, parent) in all.iter().filter(|(_, parent)| *parent == p) {
            found.push((pid, parent));
            frontier.push(pid);
        }
    }
    found
}

/// The parent of `pid`: the 4th field of /proc/PID/stat, after the parenthesised command name.
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// The `RANK` in the environment `pid` started with, if any.
fn rank_of(pid: u32) -> Option<usize> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0).find_map(|v| std::str::from_utf8(v.strip_prefix(b"RANK=")?).ok()?.parse().ok())
}

/// `VmHWM` of /proc/PID/status, in bytes; `None` once the process is gone (or a zombie).
fn high_water_mark(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two "ranks" under a shell, one of which holds 64 MiB: each is found by its RANK, and the
    /// larger peak is kept though that rank has ended by the time the shell exits.
    #[test]
    fn the_peaks_of_a_launchers_ranks_are_found_by_their_rank() {
        let script = "RANK=0 sh -c 'sleep 0.5' & \
                      RANK=1 sh -c 'x=$(head -c 67108864 /dev/zero | tr \"\\\\0\" a); sleep 0.5' & wait";
        let mut shell = std::process::Command::new("sh").args(["-c", script]).spawn().unwrap();
        let (status, peaks) = wait_measuring(&mut shell, 2).unwrap();
        assert!(status.success());
        assert_eq!(peaks.len(), 2, "{peaks:?}");
        assert!(peaks[1] > peaks[0] + (60 << 20), "rank 1 holds 64 MiB more: {peaks:?}");
    }
}

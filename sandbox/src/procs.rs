//! What `/proc` says about a run's processes: which processes belong to it, how much
//! memory they hold and how many processes and threads they are, and which processes a
//! uid still has.
//!
//! A run's processes are the descendants of the process the provider started, found by
//! parent pid, plus (without isolation) the members of its process group. Inside a PID
//! namespace an orphan is adopted by the namespace's init, which is itself a descendant,
//! so nothing of an isolated run leaves the tree; without isolation a double-forked
//! daemon reparents to the host's init and leaves it (one reason runs are isolated).

use std::collections::{HashMap, HashSet};

/// One process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy)]
struct Stat {
    ppid: i32,
    pgrp: i32,
}

fn stat(pid: i32) -> Option<Stat> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    let rest = &s[s.rfind(')')? + 1..];
    let mut f = rest.split_whitespace().skip(1);
    Some(Stat { ppid: f.next()?.parse().ok()?, pgrp: f.next()?.parse().ok()? })
}

fn pids() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries.flatten().filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok())).collect()
}

/// The descendants of `root` (and `root`), plus every member of process group `pgrp`
/// and their descendants.
pub fn members(root: i32, pgrp: Option<i32>) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    let mut seeds = vec![root];
    for pid in pids() {
        let Some(st) = stat(pid) else { continue };
        children.entry(st.ppid).or_default().push(pid);
        if pgrp == Some(st.pgrp) {
            seeds.push(pid);
        }
    }
    let mut seen: HashSet<i32> = HashSet::new();
    let mut stack = seeds;
    let mut out = Vec::new();
    while let Some(p) = stack.pop() {
        if !seen.insert(p) {
            continue;
        }
        out.push(p);
        stack.extend(children.get(&p).into_iter().flatten().copied());
    }
    out
}

/// What one sample of a run saw.
#[derive(Debug, Default, Clone)]
pub struct Usage {
    /// Sum of `VmRSS` over the run's processes.
    pub rss_kib: u64,
    /// The largest single `VmHWM` (a process's own high-water mark, which catches peaks
    /// between samples).
    pub hwm_kib: u64,
    /// Processes and threads of the run: what RLIMIT_NPROC counts.
    pub threads: u64,
    /// Every process seen, for the kill.
    pub pids: Vec<i32>,
}

fn status_field(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
}

/// Memory and threads of `pids`, not counting the processes in `sandbox` (the sandbox's
/// own: they are not the task's and are not charged to it).
pub fn usage(pids: Vec<i32>, sandbox: &[i32]) -> Usage {
    let mut u = Usage::default();
    for &pid in &pids {
        if sandbox.contains(&pid) {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { continue };
        u.rss_kib += status_field(&status, "VmRSS:").unwrap_or(0);
        u.hwm_kib = u.hwm_kib.max(status_field(&status, "VmHWM:").unwrap_or(0));
        u.threads += status_field(&status, "Threads:").unwrap_or(1);
    }
    u.pids = pids;
    u
}

/// A process's real uid and whether it is a zombie (exited, waiting for its parent).
fn owner(pid: i32) -> Option<(u32, bool)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()?;
    let zombie = status.lines().find_map(|l| l.strip_prefix("State:")).is_some_and(|s| s.trim_start().starts_with('Z'));
    Some((uid, zombie))
}

/// Live (not zombie) processes whose real uid is `uid`.
pub fn of_uid(uid: u32) -> Vec<i32> {
    pids().into_iter().filter(|p| owner(*p).is_some_and(|(u, zombie)| u == uid && !zombie)).collect()
}

/// SIGKILL to each of `pids`.
pub fn kill_all(pids: &[i32]) {
    for p in pids {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*p), nix::sys::signal::Signal::SIGKILL);
    }
}

/// Whether process `pid` exists (a zombie counts: it holds its pid and its slot).
pub fn exists(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_seen_with_its_threads_and_uid() {
        let me = std::process::id() as i32;
        let m = members(me, None);
        assert!(m.contains(&me));
        let u = usage(m, &[]);
        assert!(u.rss_kib > 0 && u.threads >= 1, "{u:?}");
        assert!(usage(vec![me], &[me]).threads == 0, "the sandbox's own processes are not counted");
        let uid = nix::unistd::getuid().as_raw();
        assert!(of_uid(uid).contains(&me));
        assert!(exists(me));
    }
}

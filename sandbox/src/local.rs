//! The built-in `local` provider: runs the command on this machine, in a fresh directory,
//! under the tier's limits, and measures what it used.
//!
//! How each limit is enforced (no unsafe code, so nothing runs in the child between fork
//! and exec; limits come from wrappers and from the supervising loop here):
//! - **Wall clock**: this loop kills the whole process group (`killpg`, SIGKILL) at the
//!   tier's timeout → `timed_out: true, killed_for: "timeout"`.
//! - **Memory**: this loop samples `/proc` every [`SAMPLE_EVERY`] and sums `VmRSS` over the
//!   run's process group and descendants; above the tier's `memory_mb` it kills them all →
//!   `killed_for: "memory"`. Sampling can overshoot by what is allocated between two
//!   samples. RLIMIT_AS is deliberately not used: address space is not memory, and runtimes
//!   that reserve large arenas would fail spuriously.
//! - **CPU, file size, open files, core dumps**: util-linux `prlimit` sets RLIMIT_CPU
//!   (`cpus × timeout_seconds`, SIGXCPU → `"cpu"`), RLIMIT_FSIZE (`disk_mb` per file,
//!   SIGXFSZ → `"disk"`), RLIMIT_NOFILE and RLIMIT_CORE before exec'ing the command.
//! - **Worker death**: `setpriv --pdeathsig TERM` makes the kernel signal the run when the
//!   worker thread that spawned it dies (e.g. SIGKILL), and coreutils `timeout` turns that
//!   signal into one for the whole group (then SIGKILL 2 s later). It is also a backstop
//!   for the wall clock. The spawn happens on a runtime worker thread, never on a blocking
//!   pool thread (those exit when idle, which would fire the signal).
//!
//! A wrapper that is not installed is skipped, with a warning at start-up, and the
//! outcome's `limits` says what was enforced. cgroups are not used: they need a writable
//! cgroup v2 hierarchy, which most hosts do not delegate to a service.
//!
//! `peak_rss_kib` is the largest of: the sum of `VmRSS` over the group seen in one sample,
//! and the largest single `VmHWM` seen (a process's own high-water mark, which catches
//! peaks between samples for processes still alive at the next sample).
//!
//! The environment is cleared: the command sees only `PATH` (a fixed default), `HOME` and
//! `TMPDIR` (inside the run directory), `LANG`, `AIRLOCK_TASK_ID`, `AIRLOCK_TIER`,
//! `AIRLOCK_RUN`, `AIRLOCK_CONTEXT_DIR`, `AIRLOCK_IDEMPOTENCY_KEY` (idempotent tasks),
//! then the spec's variables and secrets. The run directory is removed afterwards, also
//! when the run is cancelled or the future dropped; what a killed worker left behind is
//! removed by the next worker started on the host.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

use super::provider::{BoxFuture, ContextFile, KilledFor, Provider, ProviderError, RunOutcome, RunSpec};

/// How often memory is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// The `PATH` a command gets unless its spec sets one.
pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Seconds `timeout` waits past the tier's timeout before acting as the backstop.
const BACKSTOP_SECONDS: u64 = 2;

/// The wrappers found on this host.
#[derive(Debug, Clone, Default)]
struct Wrappers {
    setpriv: Option<PathBuf>,
    timeout: Option<PathBuf>,
    prlimit: Option<PathBuf>,
}

/// Runs tasks on this machine.
#[derive(Debug, Clone)]
pub struct LocalProvider {
    /// Run directories are made under it: `<sandbox.work_dir>/<this process>/`, so the
    /// directories a killed worker left behind can be told apart and removed.
    root: PathBuf,
    wrappers: Arc<Wrappers>,
}

/// This process's directory name under the work directory: its pid and start time (so a
/// reused pid is not taken for a live owner).
fn process_dir_name(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22, `starttime`, counted after the parenthesised command name.
    let start = stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().nth(19))?;
    Some(format!("w{pid}-{start}"))
}

/// Removes the directories of processes that no longer exist (workers that were killed
/// before they could clean up their runs).
fn sweep_dead(work_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(work_dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix('w').and_then(|r| r.split_once('-')).and_then(|(p, _)| p.parse().ok()) else {
            continue;
        };
        if process_dir_name(pid).as_deref() != Some(name.as_str()) {
            make_writable(&e.path());
            match std::fs::remove_dir_all(e.path()) {
                Ok(()) => tracing::info!(dir = %e.path().display(), "removed the run directories of a dead worker"),
                Err(err) => {
                    tracing::warn!(dir = %e.path().display(), error = %err, "could not remove a dead worker's runs")
                }
            }
        }
    }
}

fn find_program(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/bin", "/usr/local/bin", "/usr/sbin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

impl LocalProvider {
    /// A provider making run directories under `work_dir`, with the wrappers this host has.
    /// Removes what workers that died on this host left there.
    pub fn new(work_dir: impl Into<PathBuf>) -> Self {
        let work_dir = work_dir.into();
        sweep_dead(&work_dir);
        let own = process_dir_name(std::process::id()).unwrap_or_else(|| format!("w{}-0", std::process::id()));
        let wrappers = Wrappers {
            setpriv: find_program("setpriv"),
            timeout: find_program("timeout"),
            prlimit: find_program("prlimit"),
        };
        let p = Self { root: work_dir.join(own), wrappers: Arc::new(wrappers) };
        let missing: Vec<&str> = [
            ("setpriv", p.wrappers.setpriv.is_none()),
            ("timeout", p.wrappers.timeout.is_none()),
            ("prlimit", p.wrappers.prlimit.is_none()),
        ]
        .into_iter()
        .filter_map(|(n, m)| m.then_some(n))
        .collect();
        if !missing.is_empty() {
            tracing::warn!(
                missing = %missing.join(","),
                enforced = %p.limits().join(","),
                "sandbox wrappers not installed: runs get only the limits listed"
            );
        }
        p
    }

    /// The limits runs of this provider get.
    pub fn limits(&self) -> Vec<String> {
        let mut l = vec!["wall_clock".to_string(), "memory".to_string()];
        if self.wrappers.prlimit.is_some() {
            l.extend(["rlimit_cpu", "rlimit_fsize", "rlimit_nofile"].map(String::from));
        }
        if self.wrappers.setpriv.is_some() {
            l.push("parent_death".into());
        }
        l
    }

    fn argv(&self, spec: &RunSpec) -> Vec<String> {
        let w = &self.wrappers;
        let tier = &spec.tier;
        let mut argv: Vec<String> = Vec::new();
        if let Some(p) = &w.setpriv {
            // With `timeout` below, TERM reaches the whole group; without it, only KILL is sure.
            let sig = if w.timeout.is_some() { "TERM" } else { "KILL" };
            argv.extend([p.display().to_string(), "--pdeathsig".into(), sig.into(), "--".into()]);
        }
        if let Some(p) = &w.timeout {
            argv.extend([
                p.display().to_string(),
                format!("--kill-after={BACKSTOP_SECONDS}"),
                "--signal=KILL".into(),
                format!("{}s", tier.timeout_seconds + BACKSTOP_SECONDS),
            ]);
        }
        if let Some(p) = &w.prlimit {
            let cpu = (tier.cpus * tier.timeout_seconds as f64).ceil().max(1.0) as u64;
            argv.extend([
                p.display().to_string(),
                // Soft below hard, so the command gets SIGXCPU (recognisable) first.
                format!("--cpu={cpu}:{}", cpu + 1),
                format!("--fsize={}", tier.disk_mb.saturating_mul(1024 * 1024)),
                "--nofile=1024".into(),
                "--core=0".into(),
                "--".into(),
            ]);
        }
        argv.extend(spec.command.iter().cloned());
        argv
    }

    async fn execute(self, spec: RunSpec, cancel: CancellationToken) -> Result<RunOutcome, ProviderError> {
        let dir = RunDir::create(&self.root, &spec).map_err(|e| ProviderError::Setup(e.to_string()))?;
        let env = environment(&spec, &dir);
        let argv = self.argv(&spec);
        let limits = self.limits();

        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .envs(&env)
            .current_dir(dir.work())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let started = Instant::now();
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if argv[0] == spec.command[0] => {
                // No wrapper: the command itself could not start. Report it as a shell would.
                return Ok(RunOutcome {
                    exit_code: Some(127),
                    signal: None,
                    duration_ms: 0,
                    peak_rss_kib: 0,
                    output_bytes: 0,
                    timed_out: false,
                    killed_for: None,
                    stdout: String::new(),
                    stderr: format!("{}: {e}", spec.command[0]),
                    limits,
                });
            }
            Err(e) => return Err(ProviderError::Setup(format!("spawning {}: {e}", argv[0]))),
        };
        let Some(pid) = child.id().map(|p| p as i32) else {
            return Err(ProviderError::Setup("the child exited before it had a pid".into()));
        };
        // From here every exit path kills the group (on drop too).
        let group = Group(pid);
        let max = spec.max_output_bytes;
        let out = child.stdout.take().map(|s| tokio::spawn(capture(s, max)));
        let err = child.stderr.take().map(|s| tokio::spawn(capture(s, max)));

        let deadline = tokio::time::Instant::now() + Duration::from_secs(spec.tier.timeout_seconds);
        let limit_kib = spec.tier.memory_kib();
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut peak = 0u64;
        let mut stopped_for: Option<KilledFor> = None;
        let status = loop {
            tokio::select! {
                status = child.wait() => break status,
                _ = tokio::time::sleep_until(deadline), if stopped_for.is_none() => {
                    stopped_for = Some(KilledFor::Timeout);
                    group.kill(&usage(pid).pids);
                }
                _ = tick.tick() => {
                    let u = usage(pid);
                    peak = peak.max(u.rss_kib).max(u.hwm_kib);
                    if u.rss_kib > limit_kib && stopped_for.is_none() {
                        stopped_for = Some(KilledFor::Memory);
                        group.kill(&u.pids);
                    }
                }
                _ = cancel.cancelled() => {
                    group.kill(&usage(pid).pids);
                    return Err(ProviderError::Cancelled);
                }
            }
        };
        let duration_ms = started.elapsed().as_millis() as u64;
        // Background processes do not outlive the task. The group id stays reserved while
        // any member lives, so this reaches only the run's own leftovers.
        group.kill(&[]);
        let status = status.map_err(|e| ProviderError::Setup(format!("waiting for the run: {e}")))?;
        let (stdout, out_bytes) = collect(out).await;
        let (stderr, err_bytes) = collect(err).await;
        let signal = status.signal();
        let killed_for = stopped_for.or(match signal.and_then(|s| Signal::try_from(s).ok()) {
            Some(Signal::SIGXCPU) => Some(KilledFor::Cpu),
            Some(Signal::SIGXFSZ) => Some(KilledFor::Disk),
            _ => None,
        });
        Ok(RunOutcome {
            exit_code: status.code(),
            signal,
            duration_ms,
            peak_rss_kib: peak,
            output_bytes: out_bytes + err_bytes,
            timed_out: killed_for == Some(KilledFor::Timeout),
            killed_for,
            stdout,
            stderr,
            limits,
        })
    }
}

impl Provider for LocalProvider {
    fn name(&self) -> &'static str {
        "local"
    }

    fn run(&self, spec: RunSpec, cancel: CancellationToken) -> BoxFuture<'static, Result<RunOutcome, ProviderError>> {
        Box::pin(self.clone().execute(spec, cancel))
    }
}

fn environment(spec: &RunSpec, dir: &RunDir) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
    env.insert("HOME".into(), dir.work().display().to_string());
    env.insert("TMPDIR".into(), dir.tmp().display().to_string());
    env.insert("LANG".into(), "C.UTF-8".into());
    env.insert("AIRLOCK_TASK_ID".into(), spec.task_id.to_string());
    env.insert("AIRLOCK_TIER".into(), spec.tier.name.clone());
    env.insert("AIRLOCK_RUN".into(), spec.run.to_string());
    env.insert("AIRLOCK_CONTEXT_DIR".into(), dir.context().display().to_string());
    if let Some(k) = &spec.idempotency_key {
        env.insert("AIRLOCK_IDEMPOTENCY_KEY".into(), k.clone());
    }
    for (k, v) in &spec.env {
        env.insert(k.clone(), v.clone());
    }
    for (k, v) in &spec.secrets {
        env.insert(k.clone(), v.expose().to_string());
    }
    env
}

/// The run's process group; killed when dropped, so a cancelled or dropped run leaves
/// nothing behind.
struct Group(i32);

impl Group {
    /// SIGKILL to the group and to `others` (descendants seen outside it).
    fn kill(&self, others: &[i32]) {
        let _ = killpg(Pid::from_raw(self.0), Signal::SIGKILL);
        for p in others.iter().filter(|p| **p != self.0) {
            let _ = kill(Pid::from_raw(*p), Signal::SIGKILL);
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill(&[]);
    }
}

/// What one sample saw.
#[derive(Debug, Default)]
struct Usage {
    /// Sum of VmRSS over the group and the descendants.
    rss_kib: u64,
    /// The largest single VmHWM.
    hwm_kib: u64,
    pids: Vec<i32>,
}

/// The process group led by `leader`, plus any descendant of it that left the group.
fn usage(leader: i32) -> Usage {
    let mut parent: HashMap<i32, i32> = HashMap::new();
    let mut members: HashSet<i32> = HashSet::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Usage::default() };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { continue };
        let mut f = rest.split_whitespace().skip(1);
        let (Some(ppid), Some(pgrp)) =
            (f.next().and_then(|v| v.parse::<i32>().ok()), f.next().and_then(|v| v.parse::<i32>().ok()))
        else {
            continue;
        };
        parent.insert(pid, ppid);
        if pgrp == leader {
            members.insert(pid);
        }
    }
    // Descendants that left the group (setsid, setpgid) are still ours.
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (pid, ppid) in &parent {
        children.entry(*ppid).or_default().push(*pid);
    }
    let mut seen = HashSet::from([leader]);
    let mut stack = vec![leader];
    while let Some(p) = stack.pop() {
        for c in children.get(&p).into_iter().flatten() {
            if seen.insert(*c) {
                members.insert(*c);
                stack.push(*c);
            }
        }
    }
    members.insert(leader);
    let mut u = Usage::default();
    for pid in members {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { continue };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        };
        u.rss_kib += field("VmRSS:").unwrap_or(0);
        u.hwm_kib = u.hwm_kib.max(field("VmHWM:").unwrap_or(0));
        u.pids.push(pid);
    }
    u
}

/// Reads a stream to its end, keeping the first `max` bytes and counting all of them.
async fn capture(mut s: impl tokio::io::AsyncRead + Unpin, max: usize) -> (Vec<u8>, u64) {
    let mut head = Vec::new();
    let mut total = 0u64;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                total += n as u64;
                let room = max.saturating_sub(head.len());
                head.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    (head, total)
}

/// The captured head and byte count; gives up after a short wait when a process that
/// escaped the group still holds the pipe.
async fn collect(h: Option<tokio::task::JoinHandle<(Vec<u8>, u64)>>) -> (String, u64) {
    let Some(h) = h else { return (String::new(), 0) };
    let abort = h.abort_handle();
    match tokio::time::timeout(Duration::from_secs(2), h).await {
        Ok(Ok((head, n))) => (String::from_utf8_lossy(&head).into_owned(), n),
        _ => {
            abort.abort();
            (String::new(), 0)
        }
    }
}

/// A fresh run directory (`work/`, `tmp/`, read-only `context/`), removed when dropped.
struct RunDir(PathBuf);

impl RunDir {
    fn create(root: &Path, spec: &RunSpec) -> std::io::Result<Self> {
        std::fs::create_dir_all(root)?;
        let dir =
            root.join(format!("{}-{}-{}", spec.task_id, spec.run, &uuid::Uuid::new_v4().simple().to_string()[..8]));
        // `create_dir` (not `_all`): the directory must not exist yet.
        std::fs::create_dir(&dir)?;
        let d = RunDir(dir);
        std::fs::set_permissions(&d.0, std::fs::Permissions::from_mode(0o700))?;
        std::fs::create_dir(d.work())?;
        std::fs::create_dir(d.tmp())?;
        std::fs::create_dir(d.context())?;
        write_context(&d.context(), &spec.context)?;
        Ok(d)
    }
    fn work(&self) -> PathBuf {
        self.0.join("work")
    }
    fn tmp(&self) -> PathBuf {
        self.0.join("tmp")
    }
    fn context(&self) -> PathBuf {
        self.0.join("context")
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        make_writable(&self.0);
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), error = %e, "could not remove a run directory");
        }
    }
}

/// Writes the context files, then makes them and their directories read-only.
fn write_context(root: &Path, files: &[ContextFile]) -> std::io::Result<()> {
    let invalid = |p: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("context path `{p}`"));
    let mut dirs = vec![root.to_path_buf()];
    for f in files {
        let parts: Vec<&str> = f.path.split('/').collect();
        if parts.iter().any(|p| p.is_empty() || *p == "." || *p == "..") {
            return Err(invalid(&f.path));
        }
        let path = parts.iter().fold(root.to_path_buf(), |acc, p| acc.join(p));
        let parent = path.parent().ok_or_else(|| invalid(&f.path))?;
        std::fs::create_dir_all(parent)?;
        let mut d = parent.to_path_buf();
        while d.starts_with(root) && d != root {
            dirs.push(d.clone());
            if !d.pop() {
                break;
            }
        }
        std::fs::write(&path, &f.bytes)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444))?;
    }
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    dirs.dedup();
    for d in dirs {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o555))?;
    }
    Ok(())
}

/// Gives the owner write access to every directory below `dir`, so it can be removed.
fn make_writable(dir: &Path) {
    let Ok(meta) = std::fs::symlink_metadata(dir) else { return };
    if !meta.is_dir() {
        return;
    }
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            make_writable(&e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_core::config::sandbox::Tier;

    fn spec(command: &[&str], memory_mb: u64, timeout_seconds: u64) -> RunSpec {
        RunSpec {
            task_id: uuid::Uuid::new_v4(),
            run: 1,
            command: command.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::from([("GREETING".to_string(), "hello".to_string())]),
            secrets: vec![("API_TOKEN".into(), airlock_core::secret::Secret::new("s3cret"))],
            context: vec![ContextFile { path: "agent-1/notes.md".into(), bytes: b"remember".to_vec() }],
            tier: Tier { name: "t".into(), cpus: 1.0, memory_mb, disk_mb: 16, timeout_seconds, cost_per_minute: 0.0 },
            idempotency_key: None,
            max_output_bytes: 4096,
        }
    }

    fn provider() -> (LocalProvider, PathBuf) {
        let root = std::env::temp_dir().join(format!("airlock-local-{}", uuid::Uuid::new_v4()));
        (LocalProvider::new(&root), root)
    }

    #[tokio::test]
    async fn runs_with_only_the_spec_environment_and_cleans_up() {
        let (p, root) = provider();
        let s = spec(
            &[
                "sh",
                "-c",
                "echo \"$GREETING $API_TOKEN $AIRLOCK_TIER\"; cat \"$AIRLOCK_CONTEXT_DIR/agent-1/notes.md\"; \
                 echo; env | cut -d= -f1 | sort | tr '\\n' ' '; echo; \
                 (echo x > \"$AIRLOCK_CONTEXT_DIR/agent-1/notes.md\") 2>/dev/null; pwd",
            ],
            64,
            10,
        );
        let o = p.run(s, CancellationToken::new()).await.unwrap();
        assert_eq!(o.exit_code, Some(0), "{o:?}");
        let lines: Vec<&str> = o.stdout.lines().collect();
        assert_eq!(lines[0], "hello s3cret t");
        assert_eq!(lines[1], "remember");
        for inherited in ["CARGO", "RUST_BACKTRACE", "DATABASE_URL", "USER"] {
            assert!(!lines[2].split(' ').any(|v| v == inherited), "{inherited} leaked: {}", lines[2]);
        }
        assert!(lines[3].starts_with(p.root.to_str().unwrap()), "{}", lines[3]);
        assert_eq!(o.output_bytes as usize, o.stdout.len() + o.stderr.len());
        assert_eq!(std::fs::read_dir(&p.root).unwrap().count(), 0, "the run directory is removed");
        let _ = std::fs::remove_dir_all(root);
    }

    #[tokio::test]
    async fn timeout_kills_the_group() {
        let (p, root) = provider();
        let o = p.run(spec(&["sh", "-c", "sleep 30 & sleep 30"], 64, 1), CancellationToken::new()).await.unwrap();
        assert!(o.timed_out);
        assert_eq!(o.killed_for, Some(KilledFor::Timeout));
        assert!((1000..5000).contains(&o.duration_ms), "{}", o.duration_ms);
        let _ = std::fs::remove_dir_all(root);
    }

    #[tokio::test]
    async fn memory_over_the_tier_is_killed() {
        let (p, root) = provider();
        let o = p
            .run(spec(&["sh", "-c", "head -c 400000000 /dev/zero | tail"], 32, 20), CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(o.killed_for, Some(KilledFor::Memory), "{o:?}");
        assert!(!o.timed_out);
        assert!(o.peak_rss_kib > 32 * 1024, "{}", o.peak_rss_kib);
        let _ = std::fs::remove_dir_all(root);
    }

    #[tokio::test]
    async fn missing_program_and_exit_codes() {
        let (p, root) = provider();
        let o = p.run(spec(&["no-such-program-airlock"], 64, 5), CancellationToken::new()).await.unwrap();
        assert_eq!(o.exit_code, Some(127));
        let o = p.run(spec(&["sh", "-c", "exit 3"], 64, 5), CancellationToken::new()).await.unwrap();
        assert_eq!(o.exit_code, Some(3));
        assert_eq!(o.end(), crate::state::RunEnd::Failed);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_dead_workers_directories_are_swept() {
        let work = std::env::temp_dir().join(format!("airlock-sweep-{}", uuid::Uuid::new_v4()));
        let dead = work.join("w999999999-1").join("run").join("context");
        std::fs::create_dir_all(&dead).unwrap();
        std::fs::set_permissions(&dead, std::fs::Permissions::from_mode(0o555)).unwrap();
        let live = work.join(process_dir_name(std::process::id()).unwrap()).join("run");
        std::fs::create_dir_all(&live).unwrap();
        let other = work.join("unrelated");
        std::fs::create_dir_all(&other).unwrap();
        let _ = LocalProvider::new(&work);
        assert!(!work.join("w999999999-1").exists(), "the dead worker's runs are removed");
        assert!(live.exists() && other.exists(), "a live worker's runs and other files stay");
        let _ = std::fs::remove_dir_all(work);
    }

    #[tokio::test]
    async fn cancel_kills_and_removes() {
        let (p, root) = provider();
        let cancel = CancellationToken::new();
        let c = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            c.cancel();
        });
        let started = Instant::now();
        let r = p.run(spec(&["sleep", "30"], 64, 60), cancel).await;
        assert!(matches!(r, Err(ProviderError::Cancelled)));
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(std::fs::read_dir(&p.root).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(root);
    }
}

//! The built-in `local` provider: runs the command on this machine, in a fresh directory,
//! under the tier's limits, and measures what it used.
//!
//! Two ways, by `sandbox.isolation`:
//! - **`bubblewrap`** (the default): every run isolated in namespaces of its own, as a
//!   uid of its own; see [`super::bubblewrap`] for what a run sees and how it ends.
//! - **`none`** (development only, `sandbox.allow_unisolated = true`): the command runs
//!   as the worker's user, with its files, processes and network, under the limits below.
//!   The worker warns at start and on every outcome; the outcome's `limits` starts with
//!   `unisolated`.
//!
//! Limits common to both, enforced by the supervising loop here ([`supervise`]):
//! - **Wall clock**: at the tier's timeout the run is killed → `timed_out: true,
//!   killed_for: "timeout"`.
//! - **Memory**: every [`SAMPLE_EVERY`] the loop sums `VmRSS` over the run's processes;
//!   above the tier's `memory_mb` it kills the run → `killed_for: "memory"`. Sampling can
//!   overshoot by what is allocated between two samples. RLIMIT_AS is deliberately not
//!   used: address space is not memory, and runtimes that reserve large arenas would fail.
//! - **Processes**: more than the tier's `max_processes` processes and threads in one
//!   sample kills the run → `killed_for: "processes"` (isolated runs also get RLIMIT_NPROC
//!   on their own uid just above it, so the kernel refuses forks a sample could miss).
//! - **CPU, file size, open files, core dumps**: util-linux `prlimit` sets RLIMIT_CPU
//!   (`cpus × timeout_seconds` per process, SIGXCPU → `"cpu"`), RLIMIT_FSIZE (`disk_mb`
//!   per file, SIGXFSZ → `"disk"`), RLIMIT_NOFILE and RLIMIT_CORE before the command starts.
//!
//! Without isolation, the run is a process group: `setpriv --pdeathsig` and coreutils
//! `timeout` make it die with a worker that is killed, and the end of a run kills the
//! group and the descendants still in the process tree. A double-forked daemon that left
//! both escapes it: only isolation holds it. A missing wrapper is skipped with a warning.
//!
//! `peak_rss_kib` is the largest of: the sum of `VmRSS` seen in one sample, and the
//! largest single `VmHWM` seen.
//!
//! The environment is cleared: the command sees only `PATH` (a fixed default), `HOME`
//! and `TMPDIR` (its run directory's), `LANG`, `AIRLOCK_TASK_ID`, `AIRLOCK_TIER`,
//! `AIRLOCK_RUN`, `AIRLOCK_CONTEXT_DIR`, `AIRLOCK_IDEMPOTENCY_KEY` (idempotent tasks),
//! then the spec's variables and secrets. The run directory is removed afterwards, also
//! when the run is cancelled or the future dropped; what a killed worker left behind is
//! removed by the next worker started on the host.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

use super::bubblewrap::{Bubblewrap, IsolationError};
use super::network::Protected;
use super::procs::{self, Usage};
use super::provider::{BoxFuture, ContextFile, KilledFor, Provider, ProviderError, RunOutcome, RunSpec};
use airlock_core::config::sandbox::{Isolation, SandboxConfig, Tier};

/// How often memory and processes are sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// The `PATH` a command gets (an agent cannot set it).
pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Seconds `timeout` waits past the tier's timeout before acting as the backstop.
const BACKSTOP_SECONDS: u64 = 2;

/// The wrappers found on this host (unisolated runs).
#[derive(Debug, Clone, Default)]
struct Wrappers {
    setpriv: Option<PathBuf>,
    timeout: Option<PathBuf>,
    prlimit: Option<PathBuf>,
}

#[derive(Debug)]
enum Mode {
    Isolated(Bubblewrap),
    Unisolated(Wrappers),
}

/// Runs tasks on this machine.
#[derive(Debug, Clone)]
pub struct LocalProvider {
    /// Run directories are made under it: `<sandbox.work_dir>/<this process>/`, so the
    /// directories a killed worker left behind can be told apart and removed.
    root: PathBuf,
    mode: Arc<Mode>,
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

/// A program in the system's own directories (never a `PATH` lookup).
fn find_program(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/bin", "/usr/sbin", "/sbin"].iter().map(|d| Path::new(d).join(name)).find(|p| p.is_file())
}

/// The limits an unisolated run gets with these wrappers.
fn unisolated_limits(w: &Wrappers) -> Vec<String> {
    let mut l = vec!["unisolated".to_string(), "wall_clock".into(), "memory".into(), "processes".into()];
    if w.prlimit.is_some() {
        l.extend(["rlimit_cpu", "rlimit_fsize", "rlimit_nofile"].map(String::from));
    }
    if w.setpriv.is_some() {
        l.push("parent_death".into());
    }
    l
}

/// This process's directory under `work_dir`, after removing what dead workers left.
fn own_root(work_dir: &Path) -> PathBuf {
    sweep_dead(work_dir);
    let own = process_dir_name(std::process::id()).unwrap_or_else(|| format!("w{}-0", std::process::id()));
    work_dir.join(own)
}

impl LocalProvider {
    /// The provider `sandbox.isolation` asks for. Isolated, it first checks that this
    /// machine can isolate runs (and refuses, naming the cause, when it cannot); tiers with
    /// a network are checked in the background against `protected` (see
    /// [`super::network`]). Unisolated, it warns.
    pub fn from_config(cfg: &SandboxConfig, protected: Vec<Protected>) -> Result<Self, IsolationError> {
        match cfg.isolation {
            Isolation::Bubblewrap => Self::isolated(cfg, protected),
            Isolation::None => {
                tracing::warn!(
                    "sandbox.isolation = \"none\": sandboxed tasks run as this worker's own user, with its files, \
                     processes, network and environment; development only"
                );
                Ok(Self::unisolated(&cfg.work_dir))
            }
        }
    }

    /// Isolated runs (bubblewrap), checked on this machine first.
    pub fn isolated(cfg: &SandboxConfig, protected: Vec<Protected>) -> Result<Self, IsolationError> {
        let root = own_root(&cfg.work_dir);
        prepare_root(&root).map_err(|e| IsolationError(format!("making {}: {e}", root.display())))?;
        let b = Bubblewrap::new(cfg, &root, protected).map_err(|e| {
            IsolationError(format!(
                "sandbox.isolation = \"bubblewrap\", but this machine cannot isolate runs: {e}. Fix that, or \
                 (development only) set sandbox.isolation = \"none\" with sandbox.allow_unisolated = true"
            ))
        })?;
        let p = Self { root, mode: Arc::new(Mode::Isolated(b)) };
        if cfg.tiers.iter().any(|t| t.network) {
            // Check at start, so the log says at once whether tiers with a network are
            // served; runs on such a tier wait for the verdict.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let mode = p.mode.clone();
                rt.spawn(async move {
                    if let Mode::Isolated(b) = mode.as_ref() {
                        let _ = b.network_verdict().await;
                    }
                });
            }
        }
        Ok(p)
    }

    /// Unisolated runs, with the wrappers this host has.
    pub fn unisolated(work_dir: impl Into<PathBuf>) -> Self {
        let root = own_root(&work_dir.into());
        let wrappers = Wrappers {
            setpriv: find_program("setpriv"),
            timeout: find_program("timeout"),
            prlimit: find_program("prlimit"),
        };
        let missing: Vec<&str> = [
            ("setpriv", wrappers.setpriv.is_none()),
            ("timeout", wrappers.timeout.is_none()),
            ("prlimit", wrappers.prlimit.is_none()),
        ]
        .into_iter()
        .filter_map(|(n, m)| m.then_some(n))
        .collect();
        if !missing.is_empty() {
            tracing::warn!(
                missing = %missing.join(","),
                enforced = %unisolated_limits(&wrappers).join(","),
                "sandbox wrappers not installed: runs get only the limits listed"
            );
        }
        Self { root, mode: Arc::new(Mode::Unisolated(wrappers)) }
    }

    /// How this provider's runs are isolated.
    pub fn isolation(&self) -> Isolation {
        match self.mode.as_ref() {
            Mode::Isolated(_) => Isolation::Bubblewrap,
            Mode::Unisolated(_) => Isolation::None,
        }
    }

    /// The limits runs of `tier` get.
    pub fn limits(&self, tier: &Tier) -> Vec<String> {
        match self.mode.as_ref() {
            Mode::Isolated(b) => b.limits(tier),
            Mode::Unisolated(w) => unisolated_limits(w),
        }
    }

    /// Whether tiers with a network may run on this worker, and if not why.
    pub async fn network_verdict(&self) -> Result<(), String> {
        match self.mode.as_ref() {
            Mode::Isolated(b) => b.network_verdict().await,
            Mode::Unisolated(_) => Err("runs are not isolated (sandbox.isolation = \"none\")".into()),
        }
    }

    fn argv(w: &Wrappers, spec: &RunSpec) -> Vec<String> {
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
        match self.mode.as_ref() {
            Mode::Isolated(b) => b.run(&self.root, &spec, &cancel).await,
            Mode::Unisolated(w) => self.execute_unisolated(w, spec, cancel).await,
        }
    }

    async fn execute_unisolated(
        &self,
        w: &Wrappers,
        spec: RunSpec,
        cancel: CancellationToken,
    ) -> Result<RunOutcome, ProviderError> {
        prepare_root(&self.root).map_err(|e| ProviderError::Setup(e.to_string()))?;
        let dir = RunDir::create(&self.root, &spec, None).map_err(|e| ProviderError::Setup(e.to_string()))?;
        let paths = dir.paths();
        let env = environment(&spec, &paths.as_paths());
        let argv = Self::argv(w, &spec);
        let limits = self.limits(&spec.tier);

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
        let sup = supervise(&mut child, &group, &spec.tier, started, &cancel, None).await?;
        // Background processes do not outlive the task as far as they can be found: the
        // group id stays reserved while any member lives, so this reaches only the run's own.
        group.kill(&[]);
        let (stdout, out_bytes) = collect(out).await;
        let (stderr, err_bytes) = collect(err).await;
        let signal = sup.status.signal();
        let killed_for = sup.stopped_for.or(match signal.and_then(|s| Signal::try_from(s).ok()) {
            Some(Signal::SIGXCPU) => Some(KilledFor::Cpu),
            Some(Signal::SIGXFSZ) => Some(KilledFor::Disk),
            _ => None,
        });
        Ok(RunOutcome {
            exit_code: sup.status.code(),
            signal,
            duration_ms: sup.duration_ms,
            peak_rss_kib: sup.peak_kib,
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

/// Where a command finds its directories.
#[derive(Debug, Clone, Copy)]
pub struct Paths<'a> {
    pub home: &'a str,
    pub tmp: &'a str,
    pub context: &'a str,
}

/// [`Paths`] owned (a run directory's on the host).
pub(crate) struct OwnedPaths {
    home: String,
    tmp: String,
    context: String,
}

impl OwnedPaths {
    fn as_paths(&self) -> Paths<'_> {
        Paths { home: &self.home, tmp: &self.tmp, context: &self.context }
    }
}

/// The command's whole environment.
pub(crate) fn environment(spec: &RunSpec, paths: &Paths<'_>) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for (k, v) in &spec.env {
        env.insert(k.clone(), v.clone());
    }
    for (k, v) in &spec.secrets {
        env.insert(k.clone(), v.expose().to_string());
    }
    // The platform's own, last: a spec cannot override them.
    env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
    env.insert("HOME".into(), paths.home.to_string());
    env.insert("TMPDIR".into(), paths.tmp.to_string());
    env.insert("LANG".into(), "C.UTF-8".into());
    env.insert("AIRLOCK_TASK_ID".into(), spec.task_id.to_string());
    env.insert("AIRLOCK_TIER".into(), spec.tier.name.clone());
    env.insert("AIRLOCK_RUN".into(), spec.run.to_string());
    env.insert("AIRLOCK_CONTEXT_DIR".into(), paths.context.to_string());
    if let Some(k) = &spec.idempotency_key {
        env.insert("AIRLOCK_IDEMPOTENCY_KEY".into(), k.clone());
    }
    env
}

/// A run's processes, as the supervising loop sees and stops them.
pub(crate) trait RunTree {
    /// One sample of the run's processes.
    fn sample(&self) -> Usage;
    /// Stops the whole run; `seen` are the processes of the last sample.
    fn kill(&self, seen: &[i32]);
}

/// How a supervised run ended.
pub(crate) struct Supervision {
    pub status: ExitStatus,
    /// The limit this loop stopped the run for, if it did.
    pub stopped_for: Option<KilledFor>,
    pub peak_kib: u64,
    pub duration_ms: u64,
}

/// Waits for `child` while enforcing the wall clock, memory and processes of `tier`.
/// On cancellation the run is stopped and waited for (a few seconds at most) before
/// [`ProviderError::Cancelled`] is returned.
pub(crate) async fn supervise(
    child: &mut tokio::process::Child,
    tree: &(dyn RunTree + Sync),
    tier: &Tier,
    started: Instant,
    cancel: &CancellationToken,
    mut hold: Option<&mut Hold>,
) -> Result<Supervision, ProviderError> {
    let deadline = tokio::time::Instant::from_std(started) + Duration::from_secs(tier.timeout_seconds);
    let limit_kib = tier.memory_kib();
    let max_threads = u64::from(tier.max_processes);
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut peak = 0u64;
    let mut stopped_for: Option<KilledFor> = None;
    let status = loop {
        let mut command_ended = false;
        tokio::select! {
            status = child.wait() => break status,
            _ = tokio::time::sleep_until(deadline), if stopped_for.is_none() => {
                stopped_for = Some(KilledFor::Timeout);
                tree.kill(&tree.sample().pids);
            }
            _ = tick.tick() => {
                let u = tree.sample();
                peak = peak.max(u.rss_kib).max(u.hwm_kib);
                if stopped_for.is_none() {
                    if u.rss_kib > limit_kib {
                        stopped_for = Some(KilledFor::Memory);
                    } else if u.threads > max_threads {
                        stopped_for = Some(KilledFor::Processes);
                    }
                    if stopped_for.is_some() {
                        tree.kill(&u.pids);
                    }
                }
            }
            ended = async {
                match hold.as_deref_mut() {
                    Some(h) if h.waiting => h.ended().await,
                    _ => std::future::pending().await,
                }
            } => command_ended = ended,
            _ = cancel.cancelled() => {
                tree.kill(&tree.sample().pids);
                let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
                return Err(ProviderError::Cancelled);
            }
        }
        if command_ended {
            // The command ended: one more sample while what it left is still there.
            let u = tree.sample();
            peak = peak.max(u.rss_kib).max(u.hwm_kib);
            if stopped_for.is_none() && u.threads > max_threads {
                stopped_for = Some(KilledFor::Processes);
                tree.kill(&u.pids);
            } else if let Some(h) = hold.as_deref_mut() {
                h.release();
            }
        }
    };
    let duration_ms = started.elapsed().as_millis() as u64;
    let status = status.map_err(|e| ProviderError::Setup(format!("waiting for the run: {e}")))?;
    Ok(Supervision { status, stopped_for, peak_kib: peak, duration_ms })
}

/// The worker's end of an isolated run's hold (see [`super::bubblewrap`]): told when the
/// command ended, and answering when the run may end.
pub(crate) struct Hold {
    stream: tokio::net::UnixStream,
    /// Until the command's end was reported (or the hold went away).
    waiting: bool,
}

impl Hold {
    pub(crate) fn new(s: std::os::unix::net::UnixStream) -> std::io::Result<Self> {
        s.set_nonblocking(true)?;
        Ok(Hold { stream: tokio::net::UnixStream::from_std(s)?, waiting: true })
    }

    /// Waits for `done`: true when the command ended, false when the hold went away.
    async fn ended(&mut self) -> bool {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 16];
        let mut got = Vec::new();
        let done = loop {
            match self.stream.read(&mut buf).await {
                Ok(0) | Err(_) => break false,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    if got.contains(&b'\n') {
                        break got.starts_with(b"done");
                    }
                }
            }
        };
        self.waiting = false;
        done
    }

    /// Lets the run end.
    fn release(&mut self) {
        let _ = self.stream.try_write(b"go\n");
    }
}

/// An unisolated run's process group; killed when dropped, so a cancelled or dropped run
/// leaves nothing behind that the group and tree still hold.
struct Group(i32);

impl RunTree for Group {
    fn sample(&self) -> Usage {
        procs::usage(procs::members(self.0, Some(self.0)), &[])
    }

    /// SIGKILL to the group and to `others` (descendants seen outside it).
    fn kill(&self, others: &[i32]) {
        let _ = killpg(Pid::from_raw(self.0), Signal::SIGKILL);
        procs::kill_all(&others.iter().copied().filter(|p| *p != self.0).collect::<Vec<_>>());
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        RunTree::kill(self, &[]);
    }
}

/// Reads a stream to its end, keeping the first `max` bytes and counting all of them.
pub(crate) async fn capture(mut s: impl tokio::io::AsyncRead + Unpin, max: usize) -> (Vec<u8>, u64) {
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
/// escaped the run still holds the pipe (only possible without isolation).
pub(crate) async fn collect(h: Option<tokio::task::JoinHandle<(Vec<u8>, u64)>>) -> (String, u64) {
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

/// This process's directory for runs: traversable but not listable by others (an
/// isolated run's uid must reach its own run directory through it to bind it).
fn prepare_root(root: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(root)?;
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711))
}

/// A fresh run directory (`work/`, `tmp/`, read-only `context/`, and for isolated runs
/// `etc/`), removed when dropped. For an isolated run the directory, `work/` and `tmp/`
/// belong to the run's uid (mode 0700: no other run's uid can enter); `context/` and
/// `etc/` stay the worker's, read-only.
pub(crate) struct RunDir(PathBuf);

impl RunDir {
    pub(crate) fn create(root: &Path, spec: &RunSpec, owner: Option<u32>) -> std::io::Result<Self> {
        prepare_root(root)?;
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
        if let Some(uid) = owner {
            for p in [d.0.clone(), d.work(), d.tmp()] {
                std::os::unix::fs::chown(&p, Some(uid), Some(uid))?;
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700))?;
            }
        }
        Ok(d)
    }

    /// Writes the run's own `/etc` files (read-only).
    pub(crate) fn write_etc(&self, uid: u32, network: bool) -> std::io::Result<()> {
        let etc = self.etc();
        std::fs::create_dir(&etc)?;
        for (name, body) in super::bubblewrap::etc_files(uid, network) {
            let p = etc.join(name);
            std::fs::write(&p, body)?;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o444))?;
        }
        std::fs::set_permissions(&etc, std::fs::Permissions::from_mode(0o555))
    }

    pub(crate) fn work(&self) -> PathBuf {
        self.0.join("work")
    }
    pub(crate) fn tmp(&self) -> PathBuf {
        self.0.join("tmp")
    }
    pub(crate) fn context(&self) -> PathBuf {
        self.0.join("context")
    }
    pub(crate) fn etc(&self) -> PathBuf {
        self.0.join("etc")
    }

    fn paths(&self) -> OwnedPaths {
        OwnedPaths {
            home: self.work().display().to_string(),
            tmp: self.tmp().display().to_string(),
            context: self.context().display().to_string(),
        }
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
            tier: Tier {
                name: "t".into(),
                cpus: 1.0,
                memory_mb,
                disk_mb: 16,
                timeout_seconds,
                cost_per_minute: 0.0,
                network: false,
                max_processes: 64,
            },
            idempotency_key: None,
            max_output_bytes: 4096,
        }
    }

    /// Both kinds of provider, each with a work directory of its own (removed on drop).
    /// The isolated one needs bubblewrap installed (`scripts/test` installs it).
    fn providers() -> Vec<(LocalProvider, Work)> {
        let unisolated = Work::new();
        let isolated = Work::new();
        let mut cfg = SandboxConfig::default();
        cfg.work_dir = isolated.0.clone();
        let p = LocalProvider::isolated(&cfg, Vec::new()).expect("this machine isolates runs (bubblewrap installed?)");
        vec![(LocalProvider::unisolated(&unisolated.0), unisolated), (p, isolated)]
    }

    struct Work(PathBuf);

    impl Work {
        fn new() -> Self {
            Work(std::env::temp_dir().join(format!("airlock-local-{}", uuid::Uuid::new_v4())))
        }
    }

    impl Drop for Work {
        fn drop(&mut self) {
            make_writable(&self.0);
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[tokio::test]
    async fn runs_with_only_the_spec_environment_and_cleans_up() {
        for (p, _work) in providers() {
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
            assert_eq!(o.exit_code, Some(0), "{:?}: {o:?}", p.isolation());
            let lines: Vec<&str> = o.stdout.lines().collect();
            assert_eq!(lines[0], "hello s3cret t");
            assert_eq!(lines[1], "remember");
            for inherited in ["CARGO", "RUST_BACKTRACE", "DATABASE_URL", "USER"] {
                assert!(!lines[2].split(' ').any(|v| v == inherited), "{inherited} leaked: {}", lines[2]);
            }
            match p.isolation() {
                Isolation::None => assert!(lines[3].starts_with(p.root.to_str().unwrap()), "{}", lines[3]),
                Isolation::Bubblewrap => assert_eq!(lines[3], "/task"),
            }
            assert_eq!(o.output_bytes as usize, o.stdout.len() + o.stderr.len());
            assert_eq!(std::fs::read_dir(&p.root).unwrap().count(), 0, "the run directory is removed");
        }
    }

    #[tokio::test]
    async fn timeout_kills_the_run() {
        for (p, _work) in providers() {
            let o =
                p.run(spec(&["sh", "-c", "sleep 30.1 & sleep 30.1"], 64, 1), CancellationToken::new()).await.unwrap();
            assert!(o.timed_out, "{o:?}");
            assert_eq!(o.killed_for, Some(KilledFor::Timeout));
            assert!((1000..5000).contains(&o.duration_ms), "{}", o.duration_ms);
        }
    }

    #[tokio::test]
    async fn memory_over_the_tier_is_killed() {
        for (p, _work) in providers() {
            let o = p
                .run(spec(&["sh", "-c", "head -c 400000000 /dev/zero | tail"], 32, 20), CancellationToken::new())
                .await
                .unwrap();
            assert_eq!(o.killed_for, Some(KilledFor::Memory), "{o:?}");
            assert!(!o.timed_out);
            assert!(o.peak_rss_kib > 32 * 1024, "{}", o.peak_rss_kib);
            assert_eq!((o.exit_code, o.signal), (None, Some(9)));
        }
    }

    #[tokio::test]
    async fn processes_over_the_tier_are_killed() {
        for (p, _work) in providers() {
            let mut s = spec(&["sh", "-c", "for i in $(seq 100); do sleep 30.2 & done; wait"], 1024, 20);
            s.tier.max_processes = 8;
            let o = p.run(s, CancellationToken::new()).await.unwrap();
            assert_eq!(o.killed_for, Some(KilledFor::Processes), "{:?}: {o:?}", p.isolation());
            assert!(o.duration_ms < 10_000, "{o:?}");
        }
    }

    #[tokio::test]
    async fn missing_program_and_exit_codes() {
        for (p, _work) in providers() {
            let o = p.run(spec(&["no-such-program-airlock"], 64, 5), CancellationToken::new()).await.unwrap();
            assert_eq!(o.exit_code, Some(127), "{o:?}");
            let o = p.run(spec(&["sh", "-c", "exit 3"], 64, 5), CancellationToken::new()).await.unwrap();
            assert_eq!(o.exit_code, Some(3));
            assert_eq!(o.end(), crate::state::RunEnd::Failed);
            let o = p.run(spec(&["sh", "-c", "kill -TERM $$"], 64, 5), CancellationToken::new()).await.unwrap();
            assert_eq!((o.exit_code, o.signal, o.killed_for), (None, Some(15), None), "{o:?}");
        }
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
        let _ = LocalProvider::unisolated(&work);
        assert!(!work.join("w999999999-1").exists(), "the dead worker's runs are removed");
        assert!(live.exists() && other.exists(), "a live worker's runs and other files stay");
        let _ = std::fs::remove_dir_all(work);
    }

    #[tokio::test]
    async fn cancel_kills_and_removes() {
        for (p, _work) in providers() {
            let cancel = CancellationToken::new();
            let c = cancel.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                c.cancel();
            });
            let started = Instant::now();
            let r = p.run(spec(&["sleep", "30.3"], 64, 60), cancel).await;
            assert!(matches!(r, Err(ProviderError::Cancelled)), "{r:?}");
            assert!(started.elapsed() < Duration::from_secs(5));
            assert_eq!(std::fs::read_dir(&p.root).unwrap().count(), 0);
        }
    }

    #[tokio::test]
    async fn an_isolated_command_holds_only_its_standard_descriptors() {
        // Whatever this test process inherited from its parent, the command gets stdin,
        // stdout and stderr only (3 is the directory `ls` itself opens to list them).
        let (p, _work) = providers().pop().unwrap();
        let o = p.run(spec(&["ls", "/proc/self/fd"], 64, 5), CancellationToken::new()).await.unwrap();
        assert_eq!(o.stdout, "0\n1\n2\n3\n", "{o:?}");
    }

    #[tokio::test]
    async fn an_isolated_command_holds_no_capability_and_cannot_make_namespaces() {
        let (p, _work) = providers().pop().unwrap();
        let script = "grep -E '^(CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status | tr -s '\\t' ' '; \
                      unshare -U true 2>/dev/null || echo no-userns; unshare -n true 2>/dev/null || echo no-netns";
        let o = p.run(spec(&["sh", "-c", script], 64, 5), CancellationToken::new()).await.unwrap();
        assert_eq!(
            o.stdout,
            "CapPrm: 0000000000000000\nCapEff: 0000000000000000\nCapBnd: 0000000000000000\n\
             CapAmb: 0000000000000000\nNoNewPrivs: 1\nno-userns\nno-netns\n",
            "{o:?}"
        );
    }

    #[tokio::test]
    async fn a_loader_variable_is_refused_before_anything_runs() {
        let (p, _work) = providers().pop().unwrap();
        let mut s = spec(&["true"], 64, 5);
        s.env.insert("LD_PRELOAD".into(), "/tmp/evil.so".into());
        assert!(matches!(p.run(s, CancellationToken::new()).await, Err(ProviderError::Refused(_))));
    }
}

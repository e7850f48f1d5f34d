//! Isolated runs: each task in its own user, PID, mount, IPC, UTS and network namespaces
//! through bubblewrap, as a host uid of its own, under the tier's limits.
//!
//! How one run is started (every program by absolute path, each with an empty
//! environment, so nothing of the worker's or the agent's environment steers them):
//!
//! ```text
//! worker ── fork, setgroups([]), setgid(U), setuid(U) ──► prlimit --nproc --cpu --fsize --nofile --core
//!   └─► [unshare --user --map-root-user --net]     (tiers with a network only)
//!        └─► bwrap (outside the sandbox: waits) ──► bwrap, PID 1 of the sandbox ──► the command
//! ```
//!
//! - **Uid**: `U` is claimed from `sandbox.uid .. + sandbox.uid_count` for this run alone
//!   ([`super::uids`]); inside the sandbox the command is uid and gid `U` as well. It is
//!   never 0 and never the worker's. The worker must be able to switch to it (root, or
//!   `CAP_SETUID` and `CAP_SETGID`); bwrap itself runs unprivileged.
//! - **Environment**: bwrap starts with none (PID 1 inside is bwrap, and `/proc/1/environ`
//!   shows what it was started with); the command's variables (the spec's, its secrets,
//!   `PATH`, `HOME`, …) travel to bwrap through a pipe (`--args`), never on a command line
//!   that `/proc/<pid>/cmdline` would show to the host.
//! - **Files**: a tmpfs root made read-only once built; `/usr` and the `/bin`, `/lib*`,
//!   `/sbin` links read-only; a short list of `/etc` entries (loader cache, alternatives,
//!   certificates, time zone, …) read-only, with a `passwd`, `group` and `hosts` of the
//!   run's own; `sandbox.read_only_paths` read-only; the run directory's `work` at `/task`
//!   (the working directory and `HOME`) and `tmp` at `/tmp`, both writable and removed
//!   after the run; the context read-only at `/context`; a fresh `/proc` of the run's PID
//!   namespace; a minimal `/dev` (null, zero, full, random, urandom, tty, a 64 MiB
//!   `/dev/shm`), read-only otherwise. No `/home`, `/root`, `/var` (but a `/var/tmp` link
//!   to `/tmp`), `/run`, `/sys` or the worker's directories.
//! - **Nested user namespaces** are disabled inside (`--disable-userns`).
//! - **Lifetime**: `--die-with-parent` ties bwrap to the worker thread that started it and
//!   the sandbox's PID 1 to bwrap; `--new-session` detaches the command from any terminal.
//!   The end of a run — its command exiting, a limit, a cancellation — kills the sandbox's
//!   PID 1, and the kernel then kills every process of the PID namespace, double-forked
//!   `setsid` daemons included; the run ends only once bwrap outside has seen PID 1 gone,
//!   which is after the namespace is empty. Any process still owned by `U` after that is
//!   killed (there should be none; it is logged).
//! - **Limits**: wall clock and memory by the supervising loop (memory is the sum of
//!   `VmRSS` of the run's processes, sampled); processes and threads by the loop too (more
//!   than `max_processes` stops the run) with RLIMIT_NPROC on `U` a few above as the
//!   kernel's backstop (so a fork bomb cannot outrun a sample); CPU time, largest file,
//!   open files and core dumps by `prlimit`.
//!
//! A worker checks at start that all of this works on its machine, by running a real
//! sandbox that checks its own uid, its environment and its files ([`Bubblewrap::new`]),
//! and refuses to start when it does not.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use super::local::{self, Paths, RunDir, RunTree, Supervision};
use super::network::{self, Protected};
use super::procs;
use super::provider::{KilledFor, ProviderError, RunOutcome, RunSpec};
use super::uids::UidPool;
use airlock_core::config::sandbox::{SandboxConfig, Tier, is_loader_variable};
use airlock_core::sync::lock;

/// Where a run sees its directories.
pub const INSIDE: Paths = Paths { home: "/task", tmp: "/tmp", context: "/context" };

/// Programs run around bwrap; util-linux, present on every Debian system.
const PRLIMIT: &str = "/usr/bin/prlimit";
const UNSHARE: &str = "/usr/bin/unshare";

/// Processes of the sandbox itself on the run's uid: bwrap outside, PID 1 inside, the
/// hold (below) and `slirp4netns` for a tier with a network.
const SANDBOX_PROCESSES: u32 = 4;
/// How far past `max_processes` the kernel lets a run go before it refuses forks (at
/// least this many, at most `max_processes` more): room for the supervising loop to see
/// the run over its limit — also a run whose forking process gave up and exited when its
/// forks were refused, since what it started is still there when its command ends.
const NPROC_ROOM: u32 = 16;

/// The command runs under a hold: a shell that closes every descriptor but the standard
/// three and its socket (a descriptor the worker inherited without close-on-exec would
/// otherwise reach the command), runs the command (`env --`, so a program, never a
/// builtin), says `done` on the socket when it ends, waits for the worker's answer, then
/// exits with the command's status. The worker samples the run once more in between, so
/// processes left over at the end count against the run's limit, and a run cannot end
/// between two samples unseen. `{fd}` is the socket's descriptor, closed for the command.
const HOLD: &str = r#"for f in /proc/self/fd/*; do n=${f##*/}; case $n in 0|1|2|{fd}) ;; *) eval "exec $n>&-" ;; esac; done
/usr/bin/env -- "$@" {fd}>&-; s=$?; echo done >&{fd}; read -r _ <&{fd}; exit $s"#;

/// Size of a run's `/dev/shm` (memory that `VmRSS` does not show, so it is kept small).
const SHM_BYTES: u64 = 64 * 1024 * 1024;

/// How long bwrap may take to set a sandbox up (and `slirp4netns` to attach a network).
const SETUP: Duration = Duration::from_secs(10);

/// `/etc` entries a run reads when the host has them: what the loader, the C library,
/// TLS and common tools need. Nothing with host secrets or accounts: `passwd`, `group`
/// and `hosts` are the run's own.
const ETC: &[&str] = &[
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "ssl",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "protocols",
    "services",
    "mime.types",
    "magic",
    "magic.mime",
    "bash.bashrc",
    "profile",
    "inputrc",
    "debian_version",
    "os-release",
    "perl",
    "python3",
    "python3.11",
    "python3.12",
    "python3.13",
];

/// Top-level system paths: bound read-only when directories, re-created when links
/// (Debian's merged `/usr` makes `/bin` a link to `usr/bin`).
const SYSTEM: &[&str] = &["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"];

/// Spawns happen one at a time while descriptors meant for one child are inheritable, so
/// no other child of this process inherits them.
static SPAWN: Mutex<()> = Mutex::new(());

/// Why this machine cannot isolate runs.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct IsolationError(pub String);

/// The isolated launcher.
pub struct Bubblewrap {
    bwrap: PathBuf,
    slirp4netns: PathBuf,
    uids: UidPool,
    read_only: Vec<PathBuf>,
    /// Where the network check makes its run directory.
    root: PathBuf,
    protected: Vec<Protected>,
    /// Whether tiers with a network may run here; checked once, at start.
    network: OnceCell<Result<(), String>>,
}

impl std::fmt::Debug for Bubblewrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bubblewrap").field("bwrap", &self.bwrap).field("uids", &self.uids).finish_non_exhaustive()
    }
}

impl Bubblewrap {
    /// Checks that this machine can isolate runs as configured, by running one: bubblewrap
    /// installed, user namespaces on, the uids free to take and switch to, the sandbox's
    /// uid, environment and files as promised. `root` is where run directories are made.
    pub fn new(cfg: &SandboxConfig, root: &Path, protected: Vec<Protected>) -> Result<Self, IsolationError> {
        let b = Bubblewrap {
            bwrap: cfg.bwrap_path.clone(),
            slirp4netns: cfg.slirp4netns_path.clone(),
            uids: UidPool::new(cfg.uid, cfg.uid_count),
            read_only: cfg.read_only_paths.clone(),
            root: root.to_path_buf(),
            protected,
            network: OnceCell::new(),
        };
        b.preflight()?;
        b.self_check()?;
        Ok(b)
    }

    /// What can be told without running anything.
    fn preflight(&self) -> Result<(), IsolationError> {
        let fail = |m: String| Err(IsolationError(m));
        match std::fs::metadata(&self.bwrap) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
            Ok(_) => return fail(format!("{} is not an executable file (sandbox.bwrap_path)", self.bwrap.display())),
            Err(e) => {
                return fail(format!(
                    "bubblewrap is not installed at {} ({e}; sandbox.bwrap_path; Debian's `bubblewrap` package)",
                    self.bwrap.display()
                ));
            }
        }
        if !Path::new(PRLIMIT).is_file() {
            return fail(format!("{PRLIMIT} (util-linux) is missing: runs could not be given their limits"));
        }
        for (file, what) in [
            ("/proc/sys/user/max_user_namespaces", "user.max_user_namespaces"),
            ("/proc/sys/kernel/unprivileged_userns_clone", "kernel.unprivileged_userns_clone"),
        ] {
            if std::fs::read_to_string(file).is_ok_and(|v| v.trim() == "0") {
                return fail(format!("user namespaces are off on this machine ({what} = 0)"));
            }
        }
        let me = nix::unistd::geteuid().as_raw();
        if self.uids.contains(me) || self.uids.contains(nix::unistd::getuid().as_raw()) {
            return fail(format!(
                "the worker's own uid {me} is in the range runs get (sandbox.uid {} .. {})",
                self.uids.first(),
                self.uids.last()
            ));
        }
        for p in &self.read_only {
            if !p.exists() {
                return fail(format!("sandbox.read_only_paths: {} does not exist", p.display()));
            }
        }
        Ok(())
    }

    /// Runs a real sandbox that checks its own uid, environment and files.
    fn self_check(&self) -> Result<(), IsolationError> {
        let fail = |m: String| Err(IsolationError(m));
        let claim = self.uids.try_claim().ok_or_else(|| {
            IsolationError(format!(
                "every uid of sandbox.uid .. + sandbox.uid_count ({}) is taken by other workers on this host",
                self.uids.len()
            ))
        })?;
        let spec = check_spec(
            vec![
                "/bin/sh".into(),
                "-c".into(),
                r#"[ "$(id -u)" = "$1" ] && [ "$(id -g)" = "$1" ] && [ -w /task ] && [ -w /tmp ] \
                   && [ ! -e /root ] && [ ! -s /proc/1/environ ] && [ "$(cat /proc/1/cmdline | tr '\0' ' ')" != "" ] \
                   && ! (: > /etc/airlock-probe) 2>/dev/null && echo isolated"#
                    .into(),
                "check".into(),
                claim.uid.to_string(),
            ],
            false,
        );
        let dir = RunDir::create(&self.root, &spec, Some(claim.uid))
            .map_err(|e| IsolationError(format!("making a run directory under {}: {e}", self.root.display())))?;
        let prepared = self.prepare(&spec, &dir, claim.uid).map_err(|e| IsolationError(e.to_string()))?;
        let (mut child, pipes) = prepared.spawn_std().map_err(|e| {
            IsolationError(format!(
                "starting bubblewrap as uid {}: {e} (the worker must be root, or hold CAP_SETUID and CAP_SETGID)",
                claim.uid
            ))
        })?;
        let Pipes { data, args, info, block, mut hold } = pipes;
        let mut args = std::fs::File::from(args);
        let writer = std::thread::spawn(move || args.write_all(&data));
        // The hold says when the command ended; let it end.
        let holder = std::thread::spawn(move || {
            let _ = hold.set_read_timeout(Some(SETUP));
            let mut b = [0u8; 16];
            if hold.read(&mut b).is_ok_and(|n| n > 0) {
                let _ = hold.write_all(b"go\n");
            }
        });
        let started = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if started.elapsed() < SETUP => std::thread::sleep(Duration::from_millis(5)),
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return fail(format!("the sandbox self-check did not end within {} s", SETUP.as_secs()));
                }
                Err(e) => return fail(format!("waiting for the sandbox self-check: {e}")),
            }
        };
        let _ = writer.join();
        let _ = holder.join();
        let mut out = String::new();
        let mut err = String::new();
        if let Some(mut s) = child.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        if let Some(mut s) = child.stderr.take() {
            let _ = s.read_to_string(&mut err);
        }
        drop((info, block));
        if status.success() && out.trim() == "isolated" {
            return Ok(());
        }
        fail(format!(
            "a sandbox could not be started or is not isolated as promised ({status}): {}",
            if err.trim().is_empty() { out.trim() } else { err.trim() }
        ))
    }

    /// The limits a run of `tier` gets.
    pub fn limits(&self, tier: &Tier) -> Vec<String> {
        let mut l: Vec<String> = [
            "isolation_bubblewrap",
            "own_uid",
            "pid_namespace",
            if tier.network { "network_slirp4netns" } else { "no_network" },
            "wall_clock",
            "memory",
            "processes",
            "rlimit_nproc",
            "rlimit_cpu",
            "rlimit_fsize",
            "rlimit_nofile",
            "parent_death",
        ]
        .map(String::from)
        .to_vec();
        l.dedup();
        l
    }

    /// Whether tiers with a network may run here (checked once; the first caller waits
    /// for the check, later ones get its verdict).
    pub async fn network_verdict(&self) -> Result<(), String> {
        self.network
            .get_or_init(|| async {
                let v = self.check_network().await;
                match &v {
                    Ok(()) => tracing::info!(
                        protected = self.protected.len(),
                        "sandbox tiers with a network are served: no protected endpoint answered from inside one"
                    ),
                    Err(reason) => tracing::error!(
                        reason = %reason,
                        "sandbox tiers with a network are refused on this worker; their tasks fail"
                    ),
                }
                v
            })
            .await
            .clone()
    }

    async fn check_network(&self) -> Result<(), String> {
        for (path, what) in [
            (self.slirp4netns.as_path(), "slirp4netns (sandbox.slirp4netns_path; Debian's `slirp4netns` package)"),
            (Path::new(UNSHARE), "unshare (util-linux)"),
        ] {
            if !path.is_file() {
                return Err(format!("{what} is not installed at {}", path.display()));
            }
        }
        let targets = network::targets(&self.protected).await?;
        let mut command = vec!["/bin/bash".to_string(), "-c".into(), network::probe_script(), "check".into()];
        command.extend(targets.iter().map(|t| t.addr.to_string()));
        let spec = check_spec(command, true);
        let o = self
            .launch(&self.root, &spec, &CancellationToken::new())
            .await
            .map_err(|e| format!("a sandbox with a network could not be started: {e}"))?;
        network::verdict(&targets, o.exit_code, &o.stdout, &o.stderr)
    }

    /// Runs `spec` isolated.
    pub async fn run(
        &self,
        root: &Path,
        spec: &RunSpec,
        cancel: &CancellationToken,
    ) -> Result<RunOutcome, ProviderError> {
        if spec.tier.network {
            self.network_verdict().await.map_err(|reason| {
                ProviderError::Refused(format!(
                    "tier `{}` has a network, which this worker cannot make safe: {reason}",
                    spec.tier.name
                ))
            })?;
        }
        self.launch(root, spec, cancel).await
    }

    /// The wrappers' arguments and bwrap's options for one run.
    fn prepare(&self, spec: &RunSpec, dir: &RunDir, uid: u32) -> Result<Prepared, ProviderError> {
        let setup = |e: nix::Error| ProviderError::Setup(format!("making a pipe: {e}"));
        let net = spec.tier.network;
        dir.write_etc(uid, net).map_err(|e| ProviderError::Setup(format!("writing the run's /etc: {e}")))?;
        let (args_r, args_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(setup)?;
        let (info_r, info_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(setup)?;
        let block = if net { Some(nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(setup)?) } else { None };
        let tier = &spec.tier;
        let cpu = (tier.cpus * tier.timeout_seconds as f64).ceil().max(1.0) as u64;
        let room = tier.max_processes.clamp(NPROC_ROOM, u32::MAX / 4);
        let nproc = tier.max_processes.saturating_add(room).saturating_add(SANDBOX_PROCESSES);
        let mut argv: Vec<OsString> = vec![
            PRLIMIT.into(),
            format!("--nproc={nproc}").into(),
            // Soft below hard, so the command gets SIGXCPU (recognisable) first.
            format!("--cpu={cpu}:{}", cpu + 1).into(),
            format!("--fsize={}", tier.disk_mb.saturating_mul(1024 * 1024)).into(),
            "--nofile=1024".into(),
            "--core=0".into(),
            "--".into(),
        ];
        if net {
            // A user and network namespace of its own first, with root mapped to `uid`, so
            // that slirp4netns (as `uid`) can join it and configure it; bwrap inside keeps
            // this network and makes every other namespace under it.
            argv.extend(["/usr/bin/unshare", "--user", "--map-root-user", "--net", "--"].map(OsString::from));
        }
        argv.push(self.bwrap.clone().into());
        argv.extend(["--args".into(), args_r.as_raw_fd().to_string().into()]);
        argv.extend(["--info-fd".into(), info_w.as_raw_fd().to_string().into()]);
        if let Some((r, _)) = &block {
            argv.extend(["--block-fd".into(), r.as_raw_fd().to_string().into()]);
        }
        let (hold, hold_theirs) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| ProviderError::Setup(format!("making the hold's socket: {e}")))?;
        let hold_theirs = OwnedFd::from(hold_theirs);
        let script = HOLD.replace("{fd}", &hold_theirs.as_raw_fd().to_string());
        argv.extend(["--".into(), "/usr/bin/bash".into(), "-c".into(), script.into(), "task".into()]);
        argv.extend(spec.command.iter().map(OsString::from));
        let env = local::environment(spec, &INSIDE);
        let data = self.options(spec, dir, uid, &env);
        let mut inherit = vec![args_r, info_w, hold_theirs];
        let mut block_w = None;
        if let Some((r, w)) = block {
            inherit.push(r);
            block_w = Some(w);
        }
        Ok(Prepared { argv, uid, inherit, pipes: Pipes { data, args: args_w, info: info_r, block: block_w, hold } })
    }

    /// bwrap's options, NUL-separated (they carry the run's variables, secrets included).
    fn options(&self, spec: &RunSpec, dir: &RunDir, uid: u32, env: &BTreeMap<String, String>) -> Vec<u8> {
        let mut o: Vec<String> = Vec::new();
        let mut add = |args: &[&str]| o.extend(args.iter().map(|s| s.to_string()));
        add(&["--unshare-all"]);
        if spec.tier.network {
            // bwrap runs as root of the network's own user namespace here: it drops every
            // capability from the command's bounding set too.
            add(&["--share-net", "--cap-drop", "ALL"]);
        }
        let id = uid.to_string();
        add(&["--unshare-user", "--disable-userns", "--uid", &id, "--gid", &id, "--hostname", "sandbox"]);
        add(&["--die-with-parent", "--new-session", "--clearenv"]);
        for (k, v) in env {
            add(&["--setenv", k, v]);
        }
        for p in SYSTEM {
            match std::fs::symlink_metadata(p) {
                Ok(m) if m.file_type().is_symlink() => {
                    if let Ok(target) = std::fs::read_link(p) {
                        add(&["--symlink", &target.to_string_lossy(), p]);
                    }
                }
                Ok(m) if m.is_dir() => add(&["--ro-bind", p, p]),
                _ => {}
            }
        }
        for e in ETC {
            let p = format!("/etc/{e}");
            add(&["--ro-bind-try", &p, &p]);
        }
        let etc = dir.etc();
        let mut own = vec!["passwd", "group", "hosts", "hostname"];
        if spec.tier.network {
            own.push("resolv.conf");
        }
        for f in own {
            add(&["--ro-bind", &etc.join(f).to_string_lossy(), &format!("/etc/{f}")]);
        }
        for p in &self.read_only {
            let p = p.to_string_lossy();
            add(&["--ro-bind", &p, &p]);
        }
        add(&["--proc", "/proc", "--dev", "/dev", "--size", &SHM_BYTES.to_string(), "--tmpfs", "/dev/shm"]);
        add(&["--remount-ro", "/dev"]);
        add(&["--bind", &dir.work().to_string_lossy(), INSIDE.home]);
        add(&["--bind", &dir.tmp().to_string_lossy(), INSIDE.tmp]);
        add(&["--ro-bind", &dir.context().to_string_lossy(), INSIDE.context]);
        add(&["--dir", "/var", "--symlink", "../tmp", "/var/tmp"]);
        add(&["--remount-ro", "/", "--chdir", INSIDE.home]);
        let mut data = Vec::new();
        for a in o {
            data.extend_from_slice(a.as_bytes());
            data.push(0);
        }
        data
    }

    /// One isolated run, start to end.
    async fn launch(
        &self,
        root: &Path,
        spec: &RunSpec,
        cancel: &CancellationToken,
    ) -> Result<RunOutcome, ProviderError> {
        if let Some(k) = spec.env.keys().chain(spec.secrets.iter().map(|(k, _)| k)).find(|k| is_loader_variable(k)) {
            return Err(ProviderError::Refused(format!(
                "`{k}` steers how programs are loaded or found; a task cannot set it"
            )));
        }
        let claim = self.uids.claim(cancel).await.ok_or(ProviderError::Cancelled)?;
        let uid = claim.uid;
        // A uid's processes are gone before its claim is released, except after a run
        // whose future was dropped (its namespace is then still going down) or a worker
        // killed mid-run on this host: wait for them, and kill what does not go.
        clear_uid(uid).await;
        let dir = RunDir::create(root, spec, Some(uid)).map_err(|e| ProviderError::Setup(e.to_string()))?;
        let limits = self.limits(&spec.tier);
        let prepared = self.prepare(spec, &dir, uid)?;
        let started = Instant::now();
        let (child, pipes) = prepared
            .spawn_tokio()
            .map_err(|e| ProviderError::Setup(format!("starting bubblewrap as uid {uid}: {e}")))?;
        let mut run = Running { child, outer: 0, inner: None, slirp: None };
        run.outer = run.child.id().map(|p| p as i32).unwrap_or(0);
        let max = spec.max_output_bytes;
        let out = run.child.stdout.take().map(|s| tokio::spawn(local::capture(s, max)));
        let err = run.child.stderr.take().map(|s| tokio::spawn(local::capture(s, max)));
        let Pipes { data, args, info, block, hold } = pipes;
        let mut hold = local::Hold::new(hold).map_err(|e| ProviderError::Setup(format!("the hold's socket: {e}")))?;
        let mut args = std::fs::File::from(args);
        let writer = tokio::task::spawn_blocking(move || args.write_all(&data));
        let info = read_info(info).await;
        let _ = writer.await;
        run.inner = info;
        if run.inner.is_none() {
            // bwrap did not get as far as making the sandbox: its message says why.
            run.stop().await;
            run.finish(uid).await;
            let (stderr, _) = local::collect(err).await;
            return Err(ProviderError::Setup(format!("bubblewrap did not start the sandbox: {}", stderr.trim())));
        }
        if let Some(block) = block {
            match attach_network(&self.slirp4netns, uid, run.outer).await {
                Ok(slirp) => run.slirp = Some(slirp),
                Err(e) => {
                    run.stop().await;
                    run.finish(uid).await;
                    return Err(ProviderError::Setup(e));
                }
            }
            // The sandbox waits on this before it runs the command.
            let mut b = std::fs::File::from(block);
            let _ = b.write_all(b"1");
        }
        let tree = SandboxTree { outer: run.outer, inner: run.inner };
        let sup = local::supervise(&mut run.child, &tree, &spec.tier, started, cancel, Some(&mut hold)).await;
        let sup = match sup {
            Ok(s) => s,
            Err(e) => {
                run.stop().await;
                run.finish(uid).await;
                return Err(e);
            }
        };
        run.finish(uid).await;
        drop(claim);
        let (stdout, out_bytes) = local::collect(out).await;
        let (stderr, err_bytes) = local::collect(err).await;
        Ok(outcome(sup, stdout, stderr, out_bytes + err_bytes, limits))
    }
}

/// A spec for the worker's own checks.
fn check_spec(command: Vec<String>, network: bool) -> RunSpec {
    RunSpec {
        task_id: uuid::Uuid::nil(),
        run: 0,
        command,
        env: BTreeMap::new(),
        secrets: Vec::new(),
        context: Vec::new(),
        tier: Tier {
            name: "check".into(),
            cpus: 1.0,
            memory_mb: 256,
            disk_mb: 16,
            timeout_seconds: network::CONNECT_SECONDS + 10,
            cost_per_minute: 0.0,
            network,
            max_processes: 64,
        },
        idempotency_key: None,
        max_output_bytes: 64 * 1024,
    }
}

/// The outcome of an isolated run from bwrap's exit status.
///
/// bwrap passes the command's status on as a shell does: a command killed by signal N
/// reads as exit status 128 + N, which is reported as that signal (so a command that
/// itself exits with 129…192 reads as killed by a signal). A run this provider stopped
/// reads as SIGKILL. A command that cannot be executed reads as 127, as in a shell.
fn outcome(sup: Supervision, stdout: String, stderr: String, output_bytes: u64, limits: Vec<String>) -> RunOutcome {
    let status = sup.status;
    let (exit_code, signal) = if sup.stopped_for.is_some() {
        (None, Some(libc_sigkill()))
    } else {
        match (status.code(), status.signal()) {
            (Some(c), _) if (129..=192).contains(&c) => (None, Some(c - 128)),
            (c, s) => (c, s),
        }
    };
    let killed_for = sup.stopped_for.or(match signal.and_then(|s| nix::sys::signal::Signal::try_from(s).ok()) {
        Some(nix::sys::signal::Signal::SIGXCPU) => Some(KilledFor::Cpu),
        Some(nix::sys::signal::Signal::SIGXFSZ) => Some(KilledFor::Disk),
        _ => None,
    });
    RunOutcome {
        exit_code,
        signal,
        duration_ms: sup.duration_ms,
        peak_rss_kib: sup.peak_kib,
        output_bytes,
        timed_out: killed_for == Some(KilledFor::Timeout),
        killed_for,
        stdout,
        stderr,
        limits,
    }
}

fn libc_sigkill() -> i32 {
    nix::sys::signal::Signal::SIGKILL as i32
}

/// The sandbox's PID 1 (as the host sees it) from bwrap's `--info-fd` JSON; `None` when
/// bwrap closed it without one (it failed before making the sandbox) or took too long.
async fn read_info(info: OwnedFd) -> Option<i32> {
    let read = tokio::task::spawn_blocking(move || {
        let mut s = String::new();
        std::fs::File::from(info).read_to_string(&mut s).ok().map(|_| s)
    });
    let text = tokio::time::timeout(SETUP, read).await.ok()?.ok()??;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("child-pid").and_then(|p| p.as_i64()).map(|p| p as i32)
}

/// Starts `slirp4netns` as `uid` on the network namespace of bwrap (`outer`), and waits
/// until the network is up.
async fn attach_network(slirp4netns: &Path, uid: u32, outer: i32) -> Result<tokio::process::Child, String> {
    let (ready_r, ready_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| e.to_string())?;
    let mut cmd = std::process::Command::new(slirp4netns);
    cmd.args([
        "--configure".to_string(),
        "--mtu=65520".into(),
        "--disable-host-loopback".into(),
        "--enable-sandbox".into(),
        "--enable-seccomp".into(),
        format!("--ready-fd={}", ready_w.as_raw_fd()),
        format!("--userns-path=/proc/{outer}/ns/user"),
        outer.to_string(),
        "tap0".into(),
    ])
    .env_clear()
    .uid(uid)
    .gid(uid)
    .current_dir("/")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    let mut child = spawn_inheriting(&[&ready_w], || cmd.spawn()).map_err(|e| format!("starting slirp4netns: {e}"))?;
    drop(ready_w);
    let ready = tokio::task::spawn_blocking(move || {
        let mut b = [0u8; 1];
        std::fs::File::from(ready_r).read(&mut b).map(|n| n == 1 && b[0] == b'1')
    });
    match tokio::time::timeout(SETUP, ready).await {
        Ok(Ok(Ok(true))) => Ok(child),
        _ => {
            let _ = child.start_kill();
            let mut msg = String::new();
            if let Some(mut e) = child.stderr.take() {
                use tokio::io::AsyncReadExt;
                let _ = tokio::time::timeout(Duration::from_secs(2), e.read_to_string(&mut msg)).await;
            }
            let _ = child.wait().await;
            let msg: Vec<&str> = msg.lines().filter(|l| !l.contains("seccomp is experimental")).collect();
            Err(format!("slirp4netns could not attach a network: {}", msg.join("; ")))
        }
    }
}

/// Makes `fds` inheritable for the one spawn `spawn` does, under [`SPAWN`].
fn spawn_inheriting<T>(fds: &[&OwnedFd], spawn: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    let _one_at_a_time = lock(&SPAWN);
    let set = |flags: FdFlag| -> std::io::Result<()> {
        for fd in fds {
            fcntl(fd.as_fd(), FcntlArg::F_SETFD(flags)).map_err(std::io::Error::from)?;
        }
        Ok(())
    };
    set(FdFlag::empty())?;
    let r = spawn();
    set(FdFlag::FD_CLOEXEC)?;
    r
}

/// A run ready to start.
struct Prepared {
    argv: Vec<OsString>,
    uid: u32,
    /// The child's ends of the pipes.
    inherit: Vec<OwnedFd>,
    pipes: Pipes,
}

/// This side of a run's pipes.
struct Pipes {
    /// bwrap's options, written to `args`.
    data: Vec<u8>,
    args: OwnedFd,
    info: OwnedFd,
    /// Written once the network is up (tiers with a network).
    block: Option<OwnedFd>,
    /// The worker's end of the hold's socket.
    hold: std::os::unix::net::UnixStream,
}

impl Prepared {
    fn command(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(&self.argv[0]);
        cmd.args(&self.argv[1..])
            .env_clear()
            .uid(self.uid)
            .gid(self.uid)
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    fn spawn_std(self) -> std::io::Result<(std::process::Child, Pipes)> {
        let mut cmd = self.command();
        let fds: Vec<&OwnedFd> = self.inherit.iter().collect();
        let child = spawn_inheriting(&fds, || cmd.spawn())?;
        Ok((child, self.pipes))
    }

    fn spawn_tokio(self) -> std::io::Result<(tokio::process::Child, Pipes)> {
        let mut cmd = tokio::process::Command::from(self.command());
        cmd.kill_on_drop(true);
        let fds: Vec<&OwnedFd> = self.inherit.iter().collect();
        let child = spawn_inheriting(&fds, || cmd.spawn())?;
        Ok((child, self.pipes))
    }
}

/// The processes of a run in progress; killed when dropped.
struct Running {
    child: tokio::process::Child,
    /// bwrap outside the sandbox (the child).
    outer: i32,
    /// The sandbox's PID 1.
    inner: Option<i32>,
    slirp: Option<tokio::process::Child>,
}

impl Running {
    /// Kills the sandbox and waits until bwrap outside has ended (so the PID namespace is
    /// gone), at most a few seconds.
    async fn stop(&mut self) {
        SandboxTree { outer: self.outer, inner: self.inner }.kill(&[]);
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await.is_err() {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
        self.stop_network().await;
    }

    async fn stop_network(&mut self) {
        if let Some(mut s) = self.slirp.take() {
            let _ = s.start_kill();
            let _ = s.wait().await;
        }
    }

    /// After bwrap outside ended: the sandbox's PID 1 is killed (when the command exits,
    /// bwrap outside exits at once and PID 1 follows it an instant later), the network's
    /// process goes, and the run ends once no process of its uid is left.
    async fn finish(&mut self, uid: u32) {
        SandboxTree { outer: self.outer, inner: self.inner }.kill(&[]);
        self.stop_network().await;
        clear_uid(uid).await;
    }
}

/// Waits until `uid` has no live process. Processes of a sandbox's PID namespace go within
/// moments of its PID 1; one still there after two seconds is logged and killed.
async fn clear_uid(uid: u32) {
    let started = Instant::now();
    let mut warned = false;
    loop {
        let left = procs::of_uid(uid);
        if left.is_empty() {
            return;
        }
        if started.elapsed() > Duration::from_secs(2) {
            if !warned {
                tracing::error!(uid, pids = ?left, "processes of a sandbox uid outlived their run; killing them");
                warned = true;
            }
            procs::kill_all(&left);
            if started.elapsed() > Duration::from_secs(5) {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // A cancelled or dropped run: the sandbox's PID 1 takes its namespace down; bwrap
        // outside and slirp4netns are killed by their handles (`kill_on_drop`).
        SandboxTree { outer: self.outer, inner: self.inner }.kill(&[]);
    }
}

/// An isolated run's processes as the supervising loop sees them.
struct SandboxTree {
    outer: i32,
    inner: Option<i32>,
}

impl RunTree for SandboxTree {
    fn sample(&self) -> procs::Usage {
        let sandbox: Vec<i32> = std::iter::once(self.outer).chain(self.inner).collect();
        let mut u = procs::usage(procs::members(self.outer, None), &sandbox);
        // The hold is the sandbox's, not the task's.
        u.threads = u.threads.saturating_sub(1);
        u
    }

    /// SIGKILL to the sandbox's PID 1: the kernel kills the rest of the namespace, and
    /// bwrap outside exits once it is empty. Without PID 1 (not started yet), bwrap
    /// outside, whose death takes PID 1 down (`--die-with-parent`).
    fn kill(&self, _seen: &[i32]) {
        let target = self.inner.unwrap_or(self.outer);
        if target > 0 {
            procs::kill_all(&[target]);
        }
    }
}

/// The run's own `/etc` files.
pub(crate) fn etc_files(uid: u32, network: bool) -> Vec<(&'static str, String)> {
    let mut f = vec![
        (
            "passwd",
            format!(
                "task:x:{uid}:{uid}:airlock task:{home}:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
                home = INSIDE.home
            ),
        ),
        ("group", format!("task:x:{uid}:\nnogroup:x:65534:\n")),
        ("hosts", "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost\n".to_string()),
        ("hostname", "sandbox\n".to_string()),
    ];
    if network {
        f.push(("resolv.conf", format!("nameserver {}\n", network::DNS)));
    }
    f
}

/// Arc'd so the network check can run in the background at start.
pub type Shared = Arc<Bubblewrap>;

//! Isolation, tried as a hostile task would, against real bubblewrap: a task dumps every
//! environment it can find, connects to the worker's services, leaves a double-forked
//! daemon behind, forks past its limit, writes where it must not and reads another task's
//! files; a worker that cannot isolate refuses to start; a tier with a network reaches out
//! but never the worker's services, and one whose network cannot be made safe is refused.
//!
//! Each command is bounded by its tier's timeout and every wait by [`WAIT`]. Needs the
//! binaries (`cargo build --workspace --bins`), bubblewrap and slirp4netns installed and
//! `/dev/net/tun` usable by the sandbox uids (all of which `scripts/test` provides).
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{WAIT, assert_invariants, create, processes_with, view, wait_state};
use airlock_core::config::sandbox::{DEFAULT_UID, Isolation};
use airlock_sandbox::state::TaskState;
use airlock_tests::app::{self, TestApp};
use airlock_tests::harness::{self, KillOnDrop};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

fn work_dir() -> String {
    std::env::temp_dir().join(format!("airlock-sandbox-test-{}", Uuid::new_v4())).display().to_string()
}

/// A test app whose agent may use `light`, a tier `tiny` (16 processes) and, when `extra`
/// defines it, a tier `net`; with a work directory of its own.
async fn start(pool: PgPool, extra: &[(&str, &str)]) -> (TestApp, String) {
    let dir = work_dir();
    let mut env: Vec<(&str, &str)> = vec![
        ("AIRLOCK__SANDBOX__WORK_DIR", dir.as_str()),
        ("AIRLOCK__SANDBOX__TIERS__TINY__CPUS", "1"),
        ("AIRLOCK__SANDBOX__TIERS__TINY__MEMORY_MB", "1024"),
        ("AIRLOCK__SANDBOX__TIERS__TINY__TIMEOUT_SECONDS", "30"),
        ("AIRLOCK__SANDBOX__TIERS__TINY__COST_PER_MINUTE", "0"),
        ("AIRLOCK__SANDBOX__TIERS__TINY__MAX_PROCESSES", "16"),
        ("AIRLOCK__SANDBOX__AGENTS__AGENT-1__ALLOWED_TIERS", "light,tiny"),
    ];
    if extra.iter().any(|(k, _)| k.starts_with("AIRLOCK__SANDBOX__TIERS__NET__")) {
        env.push(("AIRLOCK__SANDBOX__AGENTS__AGENT-1__ALLOWED_TIERS", "light,tiny,net"));
        env.remove(env.len() - 2);
    }
    env.extend_from_slice(extra);
    let app = TestApp::start(pool, &env).await;
    (app, dir)
}

/// A task of the agent on `tier`, run as it is (agent mode).
async fn task(app: &TestApp, tier: &str, command: Value) -> Uuid {
    create(app, json!({"command": command, "mode": "agent", "requested_tier": tier})).await
}

fn bash(script: &str) -> Value {
    json!(["bash", "-c", script])
}

/// The run directories under a work directory (one directory per worker process, each
/// holding its runs in progress).
fn run_dirs(work_dir: &str) -> Vec<PathBuf> {
    std::fs::read_dir(work_dir)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|worker| std::fs::read_dir(worker.path()).into_iter().flatten().flatten())
        .map(|run| run.path())
        .collect()
}

/// Waits until the run of `task` has a file `name` in its working directory; returns the
/// run directory (as the host sees it).
async fn wait_run_file(work_dir: &str, task: Uuid, name: &str) -> PathBuf {
    harness::wait_for(&format!("task {task} to write {name}"), WAIT, || {
        let found = run_dirs(work_dir).into_iter().find(|d| {
            d.file_name().unwrap().to_string_lossy().starts_with(&task.to_string())
                && d.join("work").join(name).exists()
        });
        async move { found }
    })
    .await
}

fn output(v: &Value) -> String {
    format!("{}{}", v["output"]["stdout"].as_str().unwrap_or(""), v["output"]["stderr"].as_str().unwrap_or(""))
}

/// A worker process with this app's configuration plus `extra`, its stderr collected.
struct WorkerProcess {
    child: KillOnDrop,
    stderr: Arc<Mutex<String>>,
}

impl WorkerProcess {
    fn spawn(app: &TestApp, extra: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(harness::bin_path("airlock-worker"));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", "warn")
            .envs(app.env_pairs())
            .envs(extra.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().unwrap();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        WorkerProcess { child: KillOnDrop(child), stderr }
    }

    /// Waits for the worker to exit (it must, within `WAIT`); its status and stderr.
    fn refused(mut self) -> (std::process::ExitStatus, String) {
        let status = harness::wait_exit(&mut self.child.0, WAIT);
        // The reader thread drains what is left once the pipe closes.
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(2) && self.stderr.lock().unwrap().is_empty() {
            std::thread::sleep(Duration::from_millis(10));
        }
        let text = self.stderr.lock().unwrap().clone();
        (status, text)
    }

    fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_task_finds_none_of_the_workers_environment_and_runs_as_a_uid_of_its_own(pool: PgPool) {
    let (app, dir) = start(pool, &[]).await;
    // A real worker process, holding the database URL, the webhook signing secret and two
    // more secrets of the kind a sender holds.
    let canary = format!("canary-{}", Uuid::new_v4());
    let smtp_password = format!("smtp-password-{}", Uuid::new_v4());
    let extra = [("AIRLOCK_TEST_CANARY", canary.as_str()), ("AIRLOCK_TEST_SMTP_PASSWORD", smtp_password.as_str())];
    let worker = WorkerProcess::spawn(&app, &extra);
    let mut worker_env: Vec<(String, String)> = app.env.clone();
    worker_env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));

    let id = task(
        &app,
        "light",
        bash(
            r#"echo "uid $(id -u) gid $(id -g)"
for f in /proc/1/environ /proc/$PPID/environ /proc/$$/environ /proc/[0-9]*/environ /proc/self/environ; do
  echo "== $f"; tr '\0' '\n' < "$f" 2>&1
done
echo "== env"; env
echo "== cmdlines"; for f in /proc/[0-9]*/cmdline; do tr '\0' ' ' < "$f"; echo; done
echo "== files"; cat /proc/1/environ /etc/environment /root/.bash_history 2>&1; ls -a / /proc"#,
        ),
    )
    .await;
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    let out = v["output"]["stdout"].as_str().unwrap().to_string();
    assert!(out.contains("== /proc/1/environ") && out.contains("== env") && out.contains("== cmdlines"), "{out}");
    let pid1 = out.split("== /proc/1/environ\n").nth(1).unwrap();
    assert!(pid1.starts_with("== "), "the sandbox's PID 1 was started with no environment at all: {pid1:.200}");

    for (k, v) in &worker_env {
        if k != "PATH" {
            assert!(!out.contains(&format!("{k}=")), "the worker's variable {k} reached the task:\n{out}");
        }
        if v.len() >= 12 {
            assert!(!out.contains(v.as_str()), "the value of the worker's {k} reached the task");
        }
    }
    for secret in [app::WEBHOOK_SECRET, &canary, &smtp_password, &app.db_url] {
        assert!(!out.contains(secret), "a secret of the worker reached the task");
    }
    let ids = out.lines().next().unwrap();
    let uid: u32 = ids.split_whitespace().nth(1).unwrap().parse().unwrap();
    let worker_uid = nix::unistd::getuid().as_raw();
    assert!(uid != 0 && uid != worker_uid, "{ids}");
    assert!((DEFAULT_UID..DEFAULT_UID + 64).contains(&uid), "a uid of the configured range: {ids}");
    assert_eq!(ids, format!("uid {uid} gid {uid}"));
    assert_eq!(v["outcome"]["limits"][0], "isolation_bubblewrap", "{}", v["outcome"]);
    assert!(!worker.log().contains("ERROR"), "{}", worker.log());
    drop(worker);
    assert_invariants(&app.pool).await;
    crate::support::assert_no_run_dirs(&dir);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_task_cannot_connect_to_the_database_the_apis_or_the_relay(pool: PgPool) {
    let (app, dir) = start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-connect");
    let port = |url: &str| url.rsplit(':').next().unwrap().trim_end_matches('/').parse::<u16>().unwrap();
    let db_port = app.db_url.split('@').nth(1).unwrap().split('/').next().unwrap().rsplit(':').next().unwrap();
    let services = [
        ("database", db_port.parse::<u16>().unwrap()),
        ("agent API", port(&app.api)),
        ("admin API", port(&app.admin)),
        ("SMTP relay", app.smtp.port()),
    ];
    // Each is there: the host reaches every one.
    for (what, p) in services {
        assert!(std::net::TcpStream::connect(("127.0.0.1", p)).is_ok(), "{what} answers on the host");
    }
    // From inside, each is tried on the loopback, on every address of the host, and where
    // a network stack would put the host's loopback, with bash and with python3.
    let mut hosts = vec!["127.0.0.1".to_string(), "10.0.2.2".into()];
    hosts.extend(airlock_sandbox::network::host_addresses().iter().map(|a| a.to_string()));
    let targets: Vec<String> =
        services.iter().flat_map(|(_, p)| hosts.iter().map(move |h| format!("{h}:{p}"))).collect();
    let script = r#"for t in "$@"; do
  if timeout 3 bash -c 'exec 3<>"/dev/tcp/${0%:*}/${0##*:}"' "$t" 2>/dev/null; then echo "bash open $t"; else echo "bash closed $t"; fi
done
python3 - "$@" <<'PY'
import socket, sys
for t in sys.argv[1:]:
    h, p = t.rsplit(":", 1)
    try:
        socket.create_connection((h, int(p)), timeout=3).close(); print("python open", t)
    except OSError:
        print("python closed", t)
# The method sees an open port when there is one: a listener of the task's own.
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
socket.create_connection(s.getsockname(), timeout=3).close(); print("control open")
PY"#;
    let mut command = vec![json!("bash"), json!("-c"), json!(script), json!("probe")];
    command.extend(targets.iter().map(|t| json!(t)));
    let id = task(&app, "light", Value::Array(command)).await;
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    let out = v["output"]["stdout"].as_str().unwrap();
    assert!(out.contains("control open"), "{}", output(&v));
    for t in &targets {
        for tool in ["bash", "python"] {
            assert!(out.lines().any(|l| l == format!("{tool} closed {t}")), "{tool} reached {t}:\n{out}");
        }
    }
    assert_eq!(out.lines().count(), 2 * targets.len() + 1, "{out}");
    assert_eq!(v["outcome"]["limits"][3], "no_network", "{}", v["outcome"]);
    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    crate::support::assert_no_run_dirs(&dir);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_double_forked_setsid_daemon_is_gone_when_its_task_ends(pool: PgPool) {
    let (app, dir) = start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-daemon");
    let marker = format!("airlock-daemon-{}", Uuid::new_v4());
    // The daemon leaves the task's session and process group twice over and appends to a
    // file it holds open; the task waits until it has written and the test has seen it,
    // then ends at once.
    let id = task(
        &app,
        "light",
        json!(["sh", "-c", r#"( setsid sh -c 'exec 3>>/task/grow; while :; do echo tick >&3; sleep 0.02; done' "$0" & ) ; while [ ! -s /task/grow ]; do sleep 0.01; done; : > ready; while [ ! -e go ]; do sleep 0.01; done; echo started"#, marker]),
    )
    .await;
    let run = wait_run_file(&dir, id, "ready").await;
    // Hold the file the way the daemon does, to see whether anything still writes to it.
    let held = std::fs::File::open(run.join("work").join("grow")).unwrap();
    assert!(!processes_with(&marker).is_empty(), "the daemon runs");
    std::fs::write(run.join("work").join("go"), "").unwrap();
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    assert_eq!(v["output"]["stdout"], "started\n");
    // The run ended only once its PID namespace was gone: nothing of it is left.
    assert!(processes_with(&marker).is_empty(), "the daemon outlived its task: {:?}", processes_with(&marker));
    let size = held.metadata().unwrap().len();
    assert!(size > 0);
    let observed = Instant::now();
    while observed.elapsed() < Duration::from_millis(500) {
        assert_eq!(held.metadata().unwrap().len(), size, "the daemon's file is still growing");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!run.exists(), "the run directory is removed");
    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_task_forking_past_its_limit_is_stopped_and_tasks_beside_it_fork_up_to_theirs(pool: PgPool) {
    let (app, dir) = start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-forks");
    let nap = format!("30.{}", Uuid::new_v4().as_u128() % 1_000_000_000);

    // Far past `tiny`'s 16: stopped, recorded, not retried.
    let bomb =
        task(&app, "tiny", json!(["sh", "-c", format!("for i in $(seq 200); do sleep {nap} & done; wait")])).await;
    let v = wait_state(&app, bomb, TaskState::Failed).await;
    assert_eq!(
        (v["outcome"]["killed_for"].as_str(), v["outcome"]["timed_out"].as_bool()),
        (Some("processes"), Some(false)),
        "{v}"
    );
    assert_eq!(v["run_count"], 1);
    assert!(processes_with(&format!("sleep\0{nap}")).is_empty(), "the run's processes are gone");

    // The same worker then runs tasks normally: two at once, each holding 15 processes
    // besides its shell (16, its limit) at the same moment. Each has a uid of its own, so
    // neither counts against the other (one uid for both would pass the kernel's limit).
    // (bash waits on a FIFO, so nothing but its 15 sleeps runs beside it while it holds.)
    let hold = format!(
        "id -u; mkfifo f; exec 3<>f; for i in $(seq 15); do sleep {nap} & done; : > ready; \
         until [ -e go ]; do read -r -t 0.05 -u 3 _; done; echo held"
    );
    let a = task(&app, "tiny", json!(["bash", "-c", hold])).await;
    let b = task(&app, "tiny", json!(["bash", "-c", hold])).await;
    let run_a = wait_run_file(&dir, a, "ready").await;
    let run_b = wait_run_file(&dir, b, "ready").await;
    // (A process forked by `&` shows as `sleep` once it has executed it.)
    harness::wait_for("both tasks to hold their 15 processes at once", WAIT, || {
        let n = processes_with(&format!("sleep\0{nap}")).len();
        async move { (n == 30).then_some(()) }
    })
    .await;
    for run in [&run_a, &run_b] {
        std::fs::write(run.join("work").join("go"), "").unwrap();
    }
    let va = wait_state(&app, a, TaskState::Succeeded).await;
    let vb = wait_state(&app, b, TaskState::Succeeded).await;
    let uid = |v: &Value| v["output"]["stdout"].as_str().unwrap().lines().next().unwrap().to_string();
    assert_ne!(uid(&va), uid(&vb), "two runs at once never share a uid");
    for v in [&va, &vb] {
        assert!(v["output"]["stdout"].as_str().unwrap().ends_with("held\n"), "{v}");
        assert_eq!(v["outcome"]["killed_for"], Value::Null);
    }
    let next = task(&app, "tiny", json!(["echo", "next"])).await;
    assert_eq!(wait_state(&app, next, TaskState::Succeeded).await["output"]["stdout"], "next\n");
    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    assert!(processes_with(&format!("sleep\0{nap}")).is_empty());
    crate::support::assert_no_run_dirs(&dir);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn writes_leave_nothing_on_the_host_and_a_task_cannot_read_another_tasks_files(pool: PgPool) {
    let keyring = std::env::temp_dir().join(format!("airlock-keyring-{}", Uuid::new_v4()));
    std::fs::write(&keyring, "API_TOKEN=keyring-secret-value\n").unwrap();
    let keyring_path = keyring.display().to_string();
    let (app, dir) = start(pool, &[("AIRLOCK__CAPSULES__KEYRING_FILE", keyring_path.as_str())]).await;
    let (stop, worker) = app.start_worker("w-files");
    let name = format!("airlock-leak-{}", Uuid::new_v4());
    let cwd = std::env::current_dir().unwrap().display().to_string();
    let ca = app.ca_file.display().to_string();
    let host_dirs = ["/tmp".to_string(), "/root".into(), "/var/tmp".into(), dir.clone(), cwd.clone()];

    // A writes where it may not, and keeps a secret of its own in its run directory.
    let mut script =
        String::from("for d in \"$@\"; do if echo x > \"$d/$0\" 2>/dev/null; then echo \"wrote $d\"; fi; done\n");
    script.push_str("echo a-secret > /task/secret; echo a-secret > /tmp/secret; : > ready\n");
    script.push_str("while [ ! -e go ]; do sleep 0.05; done\n");
    let mut command = vec![json!("bash"), json!("-c"), json!(script), json!(name)];
    command.extend(host_dirs.iter().map(|d| json!(d)));
    let a = task(&app, "light", Value::Array(command)).await;
    let run_a = wait_run_file(&dir, a, "ready").await;

    // B looks for A's files and the worker's, by every path it might know.
    let a_work = run_a.join("work").display().to_string();
    let b_script = r#"for p in "$@" /proc/[0-9]*/root/task/secret /proc/[0-9]*/cwd/secret; do
  cat "$p" 2>/dev/null && echo "read $p"
done
ls -d /proc/[0-9]* | wc -l | sed 's/^/processes /'
echo checked"#;
    let b = task(
        &app,
        "light",
        json!([
            "bash",
            "-c",
            b_script,
            "b",
            format!("{a_work}/secret"),
            format!("{}/tmp/secret", run_a.display()),
            ca,
            keyring_path
        ]),
    )
    .await;
    let vb = wait_state(&app, b, TaskState::Succeeded).await;
    let out_b = vb["output"]["stdout"].as_str().unwrap();
    assert!(out_b.ends_with("checked\n"), "{}", output(&vb));
    assert!(
        !out_b.contains("read ") && !out_b.contains("a-secret") && !out_b.contains("keyring-secret-value"),
        "{out_b}"
    );
    assert!(!out_b.contains("BEGIN CERTIFICATE"), "{out_b}");
    // B's /proc holds B's processes only (its PID 1, the hold, bash, ls, wc, sed).
    let n: usize = out_b.lines().find_map(|l| l.strip_prefix("processes ")).unwrap().trim().parse().unwrap();
    assert!(n <= 6, "{out_b}");

    std::fs::write(run_a.join("work").join("go"), "").unwrap();
    let va = wait_state(&app, a, TaskState::Succeeded).await;
    let out_a = va["output"]["stdout"].as_str().unwrap();
    assert_eq!(out_a, "wrote /tmp\nwrote /var/tmp\n", "only its own /tmp (and /var/tmp, a link to it) is writable");
    for d in &host_dirs {
        assert!(!Path::new(d).join(&name).exists(), "{d}/{name} is on the host");
    }
    assert!(!run_a.exists(), "A's run directory, its /tmp with it, is removed");
    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    crate::support::assert_no_run_dirs(&dir);
    let _ = std::fs::remove_file(keyring);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_worker_that_cannot_isolate_refuses_to_start_and_unisolated_runs_need_consent(pool: PgPool) {
    let (app, dir) = start(pool, &[]).await;
    // No bubblewrap where the configuration says.
    let (status, err) = WorkerProcess::spawn(&app, &[("AIRLOCK__SANDBOX__BWRAP_PATH", "/nonexistent/bwrap")]).refused();
    assert!(!status.success());
    assert!(
        err.contains("sandbox.bwrap_path") && err.contains("/nonexistent/bwrap") && err.contains("bubblewrap"),
        "{err}"
    );

    // A bubblewrap that fails (as on a machine with user namespaces off).
    let fake = std::env::temp_dir().join(format!("airlock-fake-bwrap-{}", Uuid::new_v4()));
    std::fs::write(&fake, "#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n").unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let fake_path = fake.display().to_string();
    let (status, err) = WorkerProcess::spawn(&app, &[("AIRLOCK__SANDBOX__BWRAP_PATH", &fake_path)]).refused();
    assert!(!status.success());
    assert!(err.contains("cannot isolate") && err.contains("No permissions to create new namespace"), "{err}");

    // `none` without consent is refused by the configuration itself, naming the keys.
    let (status, err) = WorkerProcess::spawn(&app, &[("AIRLOCK__SANDBOX__ISOLATION", "none")]).refused();
    assert!(!status.success());
    assert!(err.contains("sandbox.isolation") && err.contains("sandbox.allow_unisolated"), "{err}");

    // A worker that does not claim sandbox jobs does not need isolation.
    let other = WorkerProcess::spawn(
        &app,
        &[("AIRLOCK__SANDBOX__BWRAP_PATH", "/nonexistent/bwrap"), ("AIRLOCK__WORKER__QUEUES", "default,send")],
    );

    // With consent, `none` runs, and says so at start and on the outcome.
    let unisolated = WorkerProcess::spawn(
        &app,
        &[("AIRLOCK__SANDBOX__ISOLATION", "none"), ("AIRLOCK__SANDBOX__ALLOW_UNISOLATED", "true")],
    );
    let id = task(&app, "light", json!(["sh", "-c", "id -u"])).await;
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    assert_eq!(v["output"]["stdout"], format!("{}\n", nix::unistd::getuid().as_raw()), "the worker's own user");
    assert_eq!(v["outcome"]["limits"][0], "unisolated", "{}", v["outcome"]);
    harness::wait_for("the unisolated run's warning", WAIT, || {
        let log = unisolated.log();
        async move { log.contains("was not isolated").then_some(()) }
    })
    .await;
    let log = unisolated.log();
    assert!(log.contains("sandbox.isolation = \"none\"") && log.contains("development only"), "{log}");
    let mut other = other;
    assert!(other.child.0.try_wait().unwrap().is_none(), "the worker without sandbox jobs runs: {}", other.log());
    drop(unisolated);
    let _ = view(&app, id).await;
    let _ = std::fs::remove_file(fake);
    let _ = std::fs::remove_dir_all(dir);
    assert_eq!(app.config.sandbox.isolation, Isolation::Bubblewrap, "the default");
}

/// Whether the sandbox uids can open `/dev/net/tun` (what slirp4netns needs).
fn assert_tun_usable() {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata("/dev/net/tun").map(|m| m.permissions().mode() & 0o777);
    assert!(
        matches!(mode, Ok(m) if m & 0o006 == 0o006),
        "tiers with a network need /dev/net/tun usable by the sandbox uids (mode 0666, Debian's default; \
         scripts/test sets it): {mode:?}"
    );
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_tier_with_a_network_reaches_out_but_never_the_workers_services(pool: PgPool) {
    assert_tun_usable();
    // A service beside the worker on the host's own address stands for "the world".
    let host = *airlock_sandbox::network::host_addresses().first().expect("a non-loopback address on this host");
    let world = std::net::TcpListener::bind((host, 0)).unwrap();
    let world_addr = world.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in world.incoming().flatten() {
            drop(s);
        }
    });
    let (app, dir) = start(
        pool,
        &[
            ("AIRLOCK__SANDBOX__TIERS__NET__CPUS", "1"),
            ("AIRLOCK__SANDBOX__TIERS__NET__MEMORY_MB", "512"),
            ("AIRLOCK__SANDBOX__TIERS__NET__TIMEOUT_SECONDS", "60"),
            ("AIRLOCK__SANDBOX__TIERS__NET__COST_PER_MINUTE", "0"),
            ("AIRLOCK__SANDBOX__TIERS__NET__NETWORK", "true"),
        ],
    )
    .await;
    let (stop, worker) = app.start_worker("w-net");
    let db_port =
        app.db_url.split('@').nth(1).unwrap().split('/').next().unwrap().rsplit(':').next().unwrap().to_string();
    let smtp_port = app.smtp.port().to_string();
    let mut targets = vec![world_addr.clone()];
    for p in [&db_port, &smtp_port] {
        targets.extend(["127.0.0.1", "10.0.2.2", &host.to_string()].map(|h| format!("{h}:{p}")));
    }
    let script = r#"for t in "$@"; do
  if timeout 3 bash -c 'exec 3<>"/dev/tcp/${0%:*}/${0##*:}"' "$t" 2>/dev/null; then echo "open $t"; else echo "closed $t"; fi
done
grep nameserver /etc/resolv.conf
grep -E '^(CapEff|CapBnd):' /proc/self/status | tr -s '\t' ' '
unshare -U true 2>/dev/null || echo no-userns"#;
    let mut command = vec![json!("bash"), json!("-c"), json!(script), json!("probe")];
    command.extend(targets.iter().map(|t| json!(t)));
    let id = task(&app, "net", Value::Array(command)).await;
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    let out = v["output"]["stdout"].as_str().unwrap();
    assert!(out.lines().any(|l| l == format!("open {world_addr}")), "the network reaches out:\n{}", output(&v));
    for t in &targets[1..] {
        assert!(out.lines().any(|l| l == format!("closed {t}")), "reached {t}:\n{out}");
    }
    assert!(out.contains("nameserver 10.0.2.3"), "{out}");
    assert!(out.ends_with("CapEff: 0000000000000000\nCapBnd: 0000000000000000\nno-userns\n"), "{out}");
    assert_eq!(v["outcome"]["limits"][3], "network_slirp4netns", "{}", v["outcome"]);
    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    crate::support::assert_no_run_dirs(&dir);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_network_the_worker_cannot_make_safe_is_refused_and_its_tasks_fail_clearly(pool: PgPool) {
    assert_tun_usable();
    // A protected service that a sandbox with a network can reach: the host's own address.
    let host = *airlock_sandbox::network::host_addresses().first().expect("a non-loopback address on this host");
    let exposed = std::net::TcpListener::bind((host, 0)).unwrap();
    let exposed_addr = exposed.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in exposed.incoming().flatten() {
            drop(s);
        }
    });
    let net_tier = [
        ("AIRLOCK__SANDBOX__TIERS__NET__CPUS", "1"),
        ("AIRLOCK__SANDBOX__TIERS__NET__MEMORY_MB", "512"),
        ("AIRLOCK__SANDBOX__TIERS__NET__TIMEOUT_SECONDS", "60"),
        ("AIRLOCK__SANDBOX__TIERS__NET__COST_PER_MINUTE", "0"),
        ("AIRLOCK__SANDBOX__TIERS__NET__NETWORK", "true"),
    ];
    let mut env = net_tier.to_vec();
    env.push(("AIRLOCK__SANDBOX__PROTECTED_ENDPOINTS", exposed_addr.as_str()));
    let (app, dir) = start(pool, &env).await;
    let worker = WorkerProcess::spawn(&app, &[]);
    harness::wait_for("the worker to say tiers with a network are refused", WAIT, || {
        let log = worker.log();
        async move { log.contains("tiers with a network are refused").then_some(()) }
    })
    .await;
    assert!(worker.log().contains(&exposed_addr), "the log names what was reached: {}", worker.log());
    let id = task(&app, "net", json!(["true"])).await;
    let v = wait_state(&app, id, TaskState::Failed).await;
    let error = v["error"].as_str().unwrap();
    assert!(error.contains("tier `net` has a network") && error.contains(&exposed_addr), "{v}");
    assert_eq!((v["outcome"].clone(), v["run_count"].as_i64()), (Value::Null, Some(1)), "it never ran: {v}");
    // Tiers without a network run as before.
    let ok = task(&app, "light", json!(["echo", "fine"])).await;
    assert_eq!(wait_state(&app, ok, TaskState::Succeeded).await["output"]["stdout"], "fine\n");
    drop(worker);

    // Without slirp4netns, the same refusal, naming what is missing.
    let worker = WorkerProcess::spawn(&app, &[("AIRLOCK__SANDBOX__SLIRP4NETNS_PATH", "/nonexistent/slirp4netns")]);
    let id = task(&app, "net", json!(["true"])).await;
    let v = wait_state(&app, id, TaskState::Failed).await;
    assert!(v["error"].as_str().unwrap().contains("slirp4netns"), "{v}");
    drop(worker);
    assert_invariants(&app.pool).await;
    let _ = std::fs::remove_dir_all(dir);
}

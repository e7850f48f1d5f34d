//! Helpers shared by the suites: the database URL of a test's own database, the path of a
//! built binary, spawning real processes, bounded waiting, and the plans of a prepared
//! statement.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};

/// The URL of the database behind `pool` (a `#[sqlx::test]` database), built from
/// `DATABASE_URL` with the database name replaced.
pub fn database_url(pool: &PgPool) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL must be set for the suites");
    let name = pool.connect_options().get_database().expect("test pool has a database").to_string();
    let (prefix, rest) = base.split_at(base.find("://").map(|i| i + 3).expect("DATABASE_URL is a URL"));
    let (authority, query) = match rest.find('/') {
        Some(i) => {
            let after = &rest[i + 1..];
            (&rest[..i], after.find('?').map(|q| &after[q..]).unwrap_or(""))
        }
        None => (rest, ""),
    };
    format!("{prefix}{authority}/{name}{query}")
}

/// The path of a workspace binary, built by `cargo build --workspace --bins` (which
/// `scripts/test` runs first). Panics, loudly, when it is missing.
pub fn bin_path(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("target"));
    let path = target.join("debug").join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins, as scripts/test does)",
        path.display()
    );
    path
}

/// The Python interpreter of the test tools' virtual environment (`tests/python/
/// requirements.txt`: the `mcp` SDK, `standardwebhooks`, `openapi-spec-validator`):
/// `AIRLOCK_TEST_PYTHON` as `scripts/test` exports it, else the environment
/// `scripts/lib/python.sh` prepares (installing it from PyPI when missing). Panics, loudly,
/// when neither gives an interpreter: a suite that needs these clients never skips.
pub fn python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            if let Some(path) = std::env::var_os("AIRLOCK_TEST_PYTHON") {
                return PathBuf::from(path);
            }
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let out = Command::new("bash")
                .arg("-c")
                .arg(". scripts/lib/python.sh && airlock_python_venv && printf %s \"$AIRLOCK_TEST_PYTHON\"")
                .current_dir(&root)
                .stderr(Stdio::inherit())
                .output()
                .expect("running scripts/lib/python.sh");
            assert!(out.status.success(), "scripts/lib/python.sh could not prepare the test tools' environment");
            PathBuf::from(String::from_utf8(out.stdout).expect("an interpreter path"))
        })
        .clone()
}

/// Runs `script` with the test tools' interpreter ([`python`]), `stdin` written to it;
/// its standard output and exit status.
pub fn run_python(script: &str, stdin: &[u8]) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new(python())
        .arg("-c")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run the test tools' python");
    child.stdin.take().expect("a piped stdin").write_all(stdin).expect("write the script's input");
    child.wait_with_output().expect("the script's output")
}

/// Spawns a real `airlock-*` binary with the given database and extra environment.
/// Standard output is piped; logs go to stderr (shown with `--nocapture`).
pub fn spawn(binary: &str, args: &[&str], db_url: &str, env: &[(&str, &str)]) -> Child {
    let mut cmd = Command::new(bin_path(binary));
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DATABASE_URL", db_url)
        .env("RUST_LOG", std::env::var("TEST_LOG").unwrap_or_else(|_| "warn".into()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(if std::env::var_os("TEST_LOG").is_some() { Stdio::inherit() } else { Stdio::null() });
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap_or_else(|e| panic!("spawning {binary}: {e}"))
}

/// Sends `signal` to a child process.
pub fn signal(child: &Child, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).expect("signal the child");
}

/// Waits for a child to exit, up to `timeout`; kills it and panics if it does not.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait for child") {
            return status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            panic!("process {} did not exit within {timeout:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A loopback port nothing listens on right now, for a process to bind.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port").local_addr().expect("local addr").port()
}

/// Polls `check` every 20 ms until it returns `Some`, or panics after `timeout` with `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    match poll_until(timeout, check).await {
        Some(v) => v,
        None => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// Polls `check` every 20 ms until it returns `Some`; `None` once `timeout` has passed.
pub async fn poll_until<T, F, Fut>(timeout: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if start.elapsed() >= timeout {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A child process that is SIGKILLed when dropped, so a failing test leaves nothing behind.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Installs the test log subscriber once (quiet unless `TEST_LOG` is set).
pub fn init_logs() {
    if let Ok(filter) = std::env::var("TEST_LOG") {
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
    }
    airlock_core::telemetry::install_crypto_provider();
}

/// A lease of the same job at the epoch after `lease`'s, which nobody has held: what a
/// holder that lost its job (or never had it) would present.
pub async fn lease_never_held(pool: &PgPool, lease: airlock_queue::Lease) -> airlock_queue::Lease {
    let job = airlock_queue::get(pool, lease.id()).await.expect("the job exists");
    airlock_queue::Job { attempt: lease.attempt() + 1, ..job }.lease()
}

/// splitmix64: a tiny seedable generator, so a seed replays the same random choices.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi.saturating_sub(lo) + 1)
    }
}

/// The plans of the statement prepared on `conn` as `name`, run as `EXECUTE name(args)`:
/// in a fresh plan for its values and in the generic plan a process keeps, as
/// `(plan_cache_mode, plan)`. `plan_cache_mode` is reset afterwards.
pub async fn plans(conn: &mut PgConnection, name: &str, args: &str) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    for mode in ["force_custom_plan", "force_generic_plan"] {
        sqlx::query(sqlx::AssertSqlSafe(format!("SET plan_cache_mode = {mode}")))
            .execute(&mut *conn)
            .await
            .expect("plan_cache_mode");
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN EXECUTE {name}({args})")))
            .fetch_all(&mut *conn)
            .await
            .expect("EXPLAIN EXECUTE");
        out.push((mode, plan.join("\n")));
    }
    sqlx::query("RESET plan_cache_mode").execute(&mut *conn).await.expect("RESET plan_cache_mode");
    out
}

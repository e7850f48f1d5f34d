//! The browser suites' runner: a scenario of `tests/browser/page.mjs` run by Node with
//! playwright-core driving Debian's Chromium headless, against services a suite started.
//! Both come from `scripts/lib/browser.sh` (`scripts/test` prepares them; a suite run on
//! its own prepares them the same way). A missing browser fails the suite loudly; it never
//! skips.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// The browser the suites drive: `AIRLOCK_TEST_CHROMIUM` as `scripts/test` exports it, else
/// what `scripts/lib/browser.sh` installs (Chromium from apt, playwright-core from npm at
/// the pinned version).
pub fn chromium() -> PathBuf {
    static CHROMIUM: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    CHROMIUM
        .get_or_init(|| {
            if let Some(path) = std::env::var_os("AIRLOCK_TEST_CHROMIUM") {
                return PathBuf::from(path);
            }
            let out = Command::new("bash")
                .arg("-c")
                .arg(". scripts/lib/browser.sh && airlock_browser_deps && printf %s \"$AIRLOCK_TEST_CHROMIUM\"")
                .current_dir(root())
                .stderr(Stdio::inherit())
                .output()
                .expect("running scripts/lib/browser.sh");
            assert!(out.status.success(), "scripts/lib/browser.sh could not prepare Chromium and playwright-core");
            PathBuf::from(String::from_utf8(out.stdout).expect("a browser path"))
        })
        .clone()
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs one scenario of `tests/browser/page.mjs` with `env` (plus the browser's path);
/// panics with the script's output when it fails or takes over `timeout`. Returns the
/// JSON object the script printed last.
pub async fn run_page_scenario(scenario: &str, env: &[(&str, String)], timeout: Duration) -> Value {
    let chromium = chromium();
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg("tests/browser/page.mjs")
        .arg(scenario)
        .current_dir(root())
        .env("AIRLOCK_CHROMIUM", &chromium)
        .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().expect("spawning node (scripts/lib/browser.sh installs it)");
    let out = match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Ok(out) => out.expect("waiting for node"),
        Err(_) => panic!("browser scenario {scenario} did not finish within {timeout:?}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "browser scenario {scenario} failed ({}):\n{stdout}\n{stderr}", out.status);
    let last = stdout.lines().rev().find(|l| l.starts_with('{')).unwrap_or("{}");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("scenario {scenario} printed no result ({e}):\n{stdout}"))
}

//! Tokens from the command line: an optional expiry after which the token is refused, and
//! the time of its last use, both shown by `token list`; a bad expiry creates nothing.

use airlock_tests::app::TestApp;
use airlock_tests::harness;
use reqwest::StatusCode;
use sqlx::PgPool;

fn admin(url: &str, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(harness::bin_path("airlock-admin"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DATABASE_URL", url)
        .env("USER", "ops")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `token list` row of `name`, split on whitespace.
fn listed(url: &str, name: &str) -> Vec<String> {
    let (ok, out, err) = admin(url, &["token", "list"]);
    assert!(ok, "{err}");
    let header: Vec<&str> = out.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["name", "role", "agent", "created", "expires", "last_used", "revoked"]);
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("{name} not listed:\n{out}"))
        .split_whitespace()
        .map(String::from)
        .collect()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_expiring_token_is_refused_after_its_expiry_and_its_last_use_is_listed(pool: PgPool) {
    let app = TestApp::start(pool.clone(), &[]).await;
    let count =
        || async { sqlx::query_scalar::<_, i64>("SELECT count(*) FROM principals").fetch_one(&pool).await.unwrap() };
    let before = count().await;
    for bad in ["0s", "12", "5x", "h", "-3d", "99999999999999w", "3651d"] {
        let arg = format!("--expires-in={bad}");
        let (ok, out, err) = admin(&app.db_url, &["token", "create", "--role", "reviewer", "--name", "r-bad", &arg]);
        assert!(!ok && out.is_empty(), "--expires-in {bad} was accepted: {out}");
        assert!(err.contains("expires") || err.contains("expiry"), "--expires-in {bad}: {err}");
    }
    assert_eq!(count().await, before, "a refused expiry creates nothing");

    let (ok, token, err) =
        admin(&app.db_url, &["token", "create", "--role", "reviewer", "--name", "r-expiring", "--expires-in", "2h"]);
    assert!(ok, "{err}");
    let token = token.trim().to_string();
    let (ok, _, err) = admin(&app.db_url, &["token", "create", "--role", "reviewer", "--name", "r-lasting"]);
    assert!(ok, "{err}");

    let row = listed(&app.db_url, "r-expiring");
    let (created, expires, last_used) = (&row[3], &row[4], &row[5]);
    let created = chrono::DateTime::parse_from_rfc3339(created).unwrap();
    let expires = chrono::DateTime::parse_from_rfc3339(expires).unwrap();
    assert!((expires - created).num_seconds().abs_diff(7200) <= 2, "{created} → {expires}");
    assert_eq!(last_used, "-", "never used yet");
    let lasting = listed(&app.db_url, "r-lasting");
    assert_eq!((lasting[4].as_str(), lasting[5].as_str()), ("-", "-"));

    let get = |token: String| {
        let (http, url) = (app.http.clone(), format!("{}/admin/v1/deliveries", app.admin));
        async move { http.get(url).bearer_auth(token).send().await.unwrap().status() }
    };
    assert_eq!(get(token.clone()).await, StatusCode::OK);
    let row = listed(&app.db_url, "r-expiring");
    assert!(chrono::DateTime::parse_from_rfc3339(&row[5]).is_ok(), "last use listed: {row:?}");

    // Its expiry passes: refused from then on, as a revoked token is.
    sqlx::query("UPDATE principals SET expires_at = created_at + interval '1 millisecond' WHERE name = 'r-expiring'")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(get(token).await, StatusCode::UNAUTHORIZED);
    let audit: Vec<(String, String)> = sqlx::query_as(
        "SELECT action, coalesce(data->>'expires_in_seconds', '') FROM audit_log WHERE target_id = 'r-expiring'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(audit, [("token.create".to_string(), "7200".to_string())]);
}

//! Slow and greedy clients against the listeners (`http.*`): they are closed, capped and
//! answered 408, while everyone else is served; the node protocol refuses an unsigned call
//! before reading its body.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use airlock_http::ServeLimits;
use airlock_tests::app::TestApp;
use axum::Router;
use axum::routing::get;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// A bound on how long the server may take to do what it must; never a measurement.
const BOUND: Duration = Duration::from_secs(30);

/// Reads until the server closes the connection (EOF or reset), at most `cap` bytes.
async fn read_until_closed(stream: &mut (impl AsyncRead + Unpin), cap: usize) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    tokio::time::timeout(BOUND, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    assert!(got.len() <= cap, "the server kept the connection open past {cap} bytes");
                }
            }
        }
    })
    .await
    .expect("the server closed the connection");
    got
}

fn status_line(answer: &[u8]) -> String {
    String::from_utf8_lossy(answer).lines().next().unwrap_or_default().to_string()
}

async fn serve_router(router: Router, limits: ServeLimits) -> (String, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    tokio::spawn(airlock_http::serve(listener, router, limits, stop.clone()));
    (addr, stop)
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn hundreds_of_slow_clients_are_closed_while_normal_requests_are_answered(pool: PgPool) {
    let app = TestApp::start(
        pool.clone(),
        &[
            ("AIRLOCK__HTTP__HEADER_READ_TIMEOUT_SECONDS", "1"),
            ("AIRLOCK__HTTP__REQUEST_TIMEOUT_SECONDS", "2"),
            ("AIRLOCK__HTTP__IDLE_TIMEOUT_SECONDS", "3"),
        ],
    )
    .await;
    let addr = app.api.trim_start_matches("http://").to_string();
    let slow = hold_slow_connections(&addr).await;
    // A client that declares a body and trickles it, one byte at a time.
    let (mut trickle_read, mut trickle) = TcpStream::connect(&addr).await.unwrap().into_split();
    let head = format!(
        "POST /v1/deliveries HTTP/1.1\r\nHost: airlock\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n{{",
        app.agent
    );
    trickle.write_all(head.as_bytes()).await.unwrap();
    // Its answer is read as it comes, while it trickles.
    let trickle_answer = tokio::spawn(async move { read_until_closed(&mut trickle_read, 64 * 1024).await });
    let trickling = tokio::spawn(async move {
        for _ in 0..200 {
            if trickle.write_all(b" ").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });

    // Meanwhile the service answers everyone else: health, and a real submission.
    let health = app.http.get(format!("{}/healthz", app.api)).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    let run = app.create_run(0).await;
    let id = app.submit(TestApp::email(&run, "normal-1", "Answered while others stall")).await;

    all_closed_by_the_server(slow).await;
    // The trickling body is cut at the request timeout with a 408, and writes nothing.
    let answer = trickle_answer.await.unwrap();
    trickling.abort();
    assert!(status_line(&answer).contains(" 408"), "trickled body answered {:?}", status_line(&answer));
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries").fetch_one(&pool).await.unwrap();
    assert_eq!(deliveries, 1, "only the normal submission {id} is written");

    // And the service still answers afterwards.
    let health = app.http.get(format!("{}/healthz", app.api)).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
}

/// 300 clients that send half a request head and then nothing (slowloris), and one that
/// connects and sends nothing at all.
async fn hold_slow_connections(addr: &str) -> Vec<TcpStream> {
    let mut slow = Vec::new();
    for i in 0..300 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        if i > 0 {
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: airlock\r\nX-Slow: ").await.unwrap();
        }
        slow.push(s);
    }
    slow
}

/// Every slow client is closed by the server, none answered with anything but a close (or
/// a 408).
async fn all_closed_by_the_server(slow: Vec<TcpStream>) {
    let mut closes = tokio::task::JoinSet::new();
    for mut s in slow {
        closes.spawn(async move { read_until_closed(&mut s, 4096).await });
    }
    for (i, answer) in closes.join_all().await.into_iter().enumerate() {
        let line = status_line(&answer);
        assert!(answer.is_empty() || line.contains(" 408"), "slow client {i} got {line:?}");
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn every_listener_closes_slow_clients_while_it_answers_others(pool: PgPool) {
    let app = TestApp::start(pool, &[("AIRLOCK__HTTP__HEADER_READ_TIMEOUT_SECONDS", "1")]).await;
    // A real worker process serving its metrics and the node protocol, with the same limits.
    let (metrics, node) = (
        format!("127.0.0.1:{}", airlock_tests::harness::free_port()),
        format!("127.0.0.1:{}", airlock_tests::harness::free_port()),
    );
    let dir = std::env::temp_dir().join(format!("airlock-slow-{}", uuid::Uuid::new_v4().simple()));
    let (data_dir, store_dir) = (dir.join("node").display().to_string(), dir.join("store").display().to_string());
    let mut env = app.env_pairs();
    env.extend([
        ("AIRLOCK__WORKER__METRICS_LISTEN", metrics.as_str()),
        ("AIRLOCK__WORKER__NODE_ID", "node_slow"),
        ("AIRLOCK__WORKER__NODE_LISTEN", node.as_str()),
        ("AIRLOCK__WORKER__DATA_DIR", data_dir.as_str()),
        ("AIRLOCK__CAPSULES__STORE_DIR", store_dir.as_str()),
        ("AIRLOCK_FLEET_SECRET", "slow-clients-fleet-secret"),
    ]);
    let _worker =
        airlock_tests::harness::KillOnDrop(airlock_tests::harness::spawn("airlock-worker", &[], &app.db_url, &env));
    let http = app.http.clone();
    let healthy = |base: String| {
        let http = http.clone();
        async move {
            airlock_tests::harness::wait_for("the listener to answer", BOUND, || {
                let (http, url) = (http.clone(), format!("{base}/healthz"));
                async move { http.get(url).send().await.ok().map(|r| r.status()) }
            })
            .await
        }
    };
    let listeners = [
        ("admin", app.admin.trim_start_matches("http://").to_string()),
        ("worker metrics", metrics.clone()),
        ("node protocol", node.clone()),
    ];
    for (name, addr) in &listeners {
        assert_eq!(healthy(format!("http://{addr}")).await, StatusCode::OK, "{name} is up");
    }
    for (name, addr) in listeners {
        let slow = hold_slow_connections(&addr).await;
        // Answered while 300 connections stall it.
        assert_eq!(healthy(format!("http://{addr}")).await, StatusCode::OK, "{name} answers while held");
        all_closed_by_the_server(slow).await;
        assert_eq!(healthy(format!("http://{addr}")).await, StatusCode::OK, "{name} answers afterwards");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_listener_serves_at_most_max_connections_at_once() {
    const LIMIT: usize = 4;
    airlock_core::telemetry::install_crypto_provider();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    // Handlers wait for one another in groups of LIMIT: a listener serving more at once
    // shows a higher peak; one serving fewer never completes a group.
    let group = Arc::new(tokio::sync::Barrier::new(LIMIT));
    let router = {
        let (in_flight, most, group) = (in_flight.clone(), most.clone(), group.clone());
        Router::new().route(
            "/hold",
            get(move || {
                let (in_flight, most, group) = (in_flight.clone(), most.clone(), group.clone());
                async move {
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    group.wait().await;
                    // Leave the group before answering, so the next group starts clean.
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    "held"
                }
            }),
        )
    };
    let limits = ServeLimits { max_connections: LIMIT, ..ServeLimits::default() };
    let (addr, stop) = serve_router(router, limits).await;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..4 * LIMIT {
        let url = format!("http://{addr}/hold");
        calls.spawn(async move {
            // One client each, so each call is its own connection.
            let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
            client.get(url).send().await.unwrap().status()
        });
    }
    let answered = tokio::time::timeout(BOUND, calls.join_all()).await.expect("every call answered");
    assert_eq!(answered.len(), 4 * LIMIT);
    for status in answered {
        assert_eq!(status, StatusCode::OK);
    }
    assert_eq!(most.load(Ordering::SeqCst), LIMIT, "connections served at once");
    stop.cancel();
}

/// Signals when the body it belongs to is dropped: the server let the connection go.
struct OnDrop(Option<tokio::sync::oneshot::Sender<()>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

#[tokio::test]
async fn a_client_that_stops_reading_is_closed_after_the_idle_timeout() {
    let (dropped_tx, dropped) = tokio::sync::oneshot::channel();
    let dropped_tx = Arc::new(std::sync::Mutex::new(Some(dropped_tx)));
    // An endless answer: only the client's reading (or the server closing) ends it.
    let router = Router::new().route(
        "/endless",
        get(move || {
            let guard = OnDrop(dropped_tx.lock().unwrap().take());
            async move {
                let chunks = futures_util::stream::repeat_with(move || {
                    let _keep = &guard;
                    Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'x'; 64 * 1024]))
                });
                axum::body::Body::from_stream(chunks)
            }
        }),
    );
    let limits = ServeLimits {
        idle_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        ..ServeLimits::default()
    };
    let (addr, stop) = serve_router(router, limits).await;
    let mut client = TcpStream::connect(&addr).await.unwrap();
    client.write_all(b"GET /endless HTTP/1.1\r\nHost: airlock\r\n\r\n").await.unwrap();
    // The client reads nothing: the buffers fill, the server's writes stall, and after the
    // idle timeout the server drops the connection (and with it the answer's body).
    tokio::time::timeout(BOUND, dropped).await.expect("the stalled connection is closed").unwrap();
    // What the kernel had buffered is all there is; then the connection ends.
    let got = read_until_closed(&mut client, 256 * 1024 * 1024).await;
    assert!(status_line(&got).starts_with("HTTP/1.1 200"), "{:?}", status_line(&got));
    stop.cancel();
}

#[tokio::test]
async fn the_node_protocol_checks_signature_headers_before_reading_a_body() {
    let fleet = airlock_tests::capsule::Fleet::start(&["node-a"]).await;
    let addr = fleet.node("node-a").url.trim_start_matches("http://").to_string();
    let call = |head: String| {
        let addr = addr.clone();
        async move {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            s.write_all(head.as_bytes()).await.unwrap();
            // No body is ever sent: the node must answer from the head alone.
            let answer = read_until_closed(&mut s, 64 * 1024).await;
            let text = String::from_utf8_lossy(&answer).to_string();
            let body = text.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
            (status_line(&answer), body)
        }
    };
    let now = chrono::Utc::now().timestamp();
    let bad_sig = format!("v1={}", "00".repeat(32));
    let head = |path: &str, method: &str, length: u64, signed: Option<(i64, &str)>| {
        let mut h =
            format!("{method} {path} HTTP/1.1\r\nHost: node\r\nConnection: close\r\nContent-Length: {length}\r\n");
        if let Some((ts, sig)) = signed {
            h.push_str(&format!("airlock-node-timestamp: {ts}\r\nairlock-node-signature: {sig}\r\n"));
        }
        h + "\r\n"
    };
    let code = |body: &str| -> String {
        serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(String::from))
            .unwrap_or_default()
    };

    // Unsigned, declaring 100 MiB it never sends: refused at once.
    let (line, body) = call(head("/node/v1/agents/agent-1/blobs/abc", "PUT", 100 << 20, None)).await;
    assert!(line.contains(" 401"), "{line}");
    assert_eq!(code(&body), "UNAUTHENTICATED");
    // A stale timestamp: refused before the body.
    let (line, _) = call(head("/node/v1/agents/agent-1/journal", "POST", 1 << 20, Some((now - 3600, &bad_sig)))).await;
    assert!(line.contains(" 401"), "{line}");
    // A signature of the wrong length cannot match whatever the body: refused before it.
    let (line, _) = call(head("/node/v1/agents/agent-1/journal", "POST", 10, Some((now, "v1=abcd")))).await;
    assert!(line.contains(" 401"), "{line}");
    // Fresh, well-formed headers but a body over the small limit of a non-content call.
    let (line, body) = call(head("/node/v1/agents/agent-1/journal", "POST", 10 << 20, Some((now, &bad_sig)))).await;
    assert!(line.contains(" 413"), "{line}");
    assert_eq!(code(&body), "PAYLOAD_TOO_LARGE");
    // Over the content limit even for a blob.
    let (line, _) = call(head("/node/v1/agents/agent-1/blobs/abc", "PUT", 1 << 30, Some((now, &bad_sig)))).await;
    assert!(line.contains(" 413"), "{line}");

    // A small body with a wrong signature is read, checked and refused.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(format!("{}{{}}", head("/node/v1/agents/agent-1/freeze", "POST", 2, Some((now, &bad_sig)))).as_bytes())
        .await
        .unwrap();
    let answer = read_until_closed(&mut s, 64 * 1024).await;
    assert!(status_line(&answer).contains(" 401"), "{}", status_line(&answer));
    // Health needs no signature.
    let (line, _) = call("GET /healthz HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n".into()).await;
    assert!(line.contains(" 200"), "{line}");
}

//! A local SMTP sink for development (`scripts/dev`): STARTTLS with a throwaway CA, every
//! accepted message written to a folder as `<n>.eml`. Not for production.
//!
//! Usage: `airlock-dev-smtp PORT DIR [--discard] [--reply-ms N]` — writes `DIR/ca.pem`
//! (point `smtp.ca_file` at it) and `DIR/mail/*.eml`; with `--discard`, accepts messages
//! without writing or logging them (the benchmark's sink, whose file per message would
//! otherwise take CPU from the system it measures); with `--reply-ms N`, answers each
//! message's end after N ms, as a relay that stores it first does.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use airlock_tests::smtp::{SmtpOptions, SmtpServer, TestCa};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().unwrap_or_else(|| "2525".into()).parse()?;
    let dir = PathBuf::from(args.next().unwrap_or_else(|| ".dev/smtp".into()));
    let (mut discard, mut reply_ms) = (false, 0);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--discard" => discard = true,
            "--reply-ms" => reply_ms = args.next().unwrap_or_default().parse()?,
            other => {
                anyhow::bail!("unknown argument {other:?}; usage: airlock-dev-smtp PORT DIR [--discard] [--reply-ms N]")
            }
        }
    }
    std::fs::create_dir_all(dir.join("mail"))?;
    let ca = Arc::new(TestCa::new()?);
    let ca_file = ca.write_ca_file(&dir)?;
    let options = SmtpOptions { data_end_delay: Duration::from_millis(reply_ms), ..SmtpOptions::starttls(ca) };
    let server = SmtpServer::start_on(SocketAddr::from(([127, 0, 0, 1], port)), options).await?;
    let kept = if discard { "discarded".to_string() } else { format!("in {}", dir.join("mail").display()) };
    eprintln!("dev SMTP sink on {} (STARTTLS, CA {}), mail {kept}", server.addr(), ca_file.display());
    if discard {
        std::future::pending::<()>().await;
    }
    let mut written = 0;
    loop {
        let new = server.wait_after(written, written + 1, Duration::from_secs(3600)).await;
        for m in &new {
            written += 1;
            let path = dir.join("mail").join(format!("{written:05}.eml"));
            std::fs::write(&path, &m.data)?;
            eprintln!("received {} for {:?} -> {}", m.message_id.as_deref().unwrap_or("?"), m.rcpt_to, path.display());
        }
    }
}

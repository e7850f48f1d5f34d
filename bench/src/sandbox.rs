//! What isolation costs a sandboxed task: a no-op task's start-to-end time through the
//! `local` provider without isolation and with bubblewrap, measured side by side.
//!
//! Start to end is the provider's whole run of `true`: the run directory made and
//! removed, the uid claimed, the sandbox built, the command run, the sandbox's PID
//! namespace gone. It is not the queue's pickup latency (measured by `latency`). The two
//! kinds alternate run by run, so a drift of the machine's speed reaches both alike.

use std::path::Path;
use std::time::Instant;

use airlock_core::config::sandbox::SandboxConfig;
use airlock_sandbox::local::LocalProvider;
use airlock_sandbox::provider::{Provider, RunSpec};
use tokio_util::sync::CancellationToken;

/// Start-to-end times of one kind of run, in milliseconds, sorted.
pub struct Times(pub Vec<f64>);

impl Times {
    pub fn p(&self, q: f64) -> f64 {
        crate::percentile(&self.0, q)
    }
}

fn noop(cfg: &SandboxConfig) -> RunSpec {
    RunSpec {
        task_id: uuid::Uuid::new_v4(),
        run: 1,
        command: vec!["true".into()],
        env: Default::default(),
        secrets: Vec::new(),
        context: Vec::new(),
        tier: cfg.tiers.smallest().clone(),
        idempotency_key: None,
        max_output_bytes: 4096,
    }
}

/// `runs` no-op runs of each kind (after a few unmeasured ones): (unisolated, isolated).
pub async fn measure(runs: usize, work_dir: &Path) -> anyhow::Result<(Times, Times)> {
    let mut cfg = SandboxConfig::default();
    cfg.work_dir = work_dir.join("isolated");
    let isolated = LocalProvider::isolated(&cfg, Vec::new())?;
    let unisolated = LocalProvider::unisolated(work_dir.join("unisolated"));
    let (mut plain, mut boxed) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    for i in 0..runs + 5 {
        for (p, out) in [(&unisolated, &mut plain), (&isolated, &mut boxed)] {
            let started = Instant::now();
            let o = p.run(noop(&cfg), CancellationToken::new()).await?;
            let ms = started.elapsed().as_secs_f64() * 1000.0;
            anyhow::ensure!(o.exit_code == Some(0), "a no-op run failed: {o:?}");
            if i >= 5 {
                out.push(ms);
            }
        }
    }
    plain.sort_by(f64::total_cmp);
    boxed.sort_by(f64::total_cmp);
    let _ = std::fs::remove_dir_all(work_dir);
    Ok((Times(plain), Times(boxed)))
}

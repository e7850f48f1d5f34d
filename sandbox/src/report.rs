//! The review of choices: outcomes by tier and mode, and the tasks whose tier did not fit.
//!
//! - **Under-provisioned**: the run was stopped by a limit of its tier (timeout, memory,
//!   CPU, disk, processes). The suggestion is the smallest configured tier that is larger in that
//!   dimension.
//! - **Over-provisioned**: the run was not stopped, and a configured tier with less memory
//!   than the one it had would still have held it with headroom: its peak within
//!   [`HEADROOM`] of that tier's memory and its duration within [`HEADROOM`] of that
//!   tier's timeout. The suggestion is the smallest such tier.
//!
//! Classification compares the tier as it was decided (the decision's snapshot) with the
//! tiers configured now.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::state::{Mode, Verdict};
use super::store::{self, DecisionRow};
use airlock_core::config::sandbox::{Tier, Tiers};

/// The share of a smaller tier's memory and timeout a run may use and still count as
/// fitting it.
pub const HEADROOM: f64 = 0.5;

/// How well a tier fitted a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "fit", content = "suggested_tier")]
pub enum Fit {
    Right,
    Over(String),
    Under(Option<String>),
}

/// Classifies one outcome.
pub fn classify(tiers: &Tiers, used: &Tier, peak_rss_kib: u64, duration_ms: u64, killed_for: Option<&str>) -> Fit {
    if let Some(limit) = killed_for {
        let bigger = tiers.iter().find(|t| match limit {
            "memory" => t.memory_mb > used.memory_mb,
            "timeout" => t.timeout_seconds > used.timeout_seconds,
            "cpu" => t.cpus * t.timeout_seconds as f64 > used.cpus * used.timeout_seconds as f64,
            "disk" => t.disk_mb > used.disk_mb,
            "processes" => t.max_processes > used.max_processes,
            _ => false,
        });
        return Fit::Under(bigger.map(|t| t.name.clone()));
    }
    let fits = |t: &&Tier| {
        t.memory_mb < used.memory_mb
            && peak_rss_kib as f64 <= HEADROOM * t.memory_kib() as f64
            && duration_ms as f64 <= HEADROOM * t.timeout_ms() as f64
    };
    match tiers.iter().find(fits) {
        Some(t) => Fit::Over(t.name.clone()),
        None => Fit::Right,
    }
}

/// Counts for one tier and mode.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Row {
    pub tier: String,
    pub mode: String,
    pub runs: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub timed_out: u64,
    pub killed_for_memory: u64,
    pub over_provisioned: u64,
    pub under_provisioned: u64,
    pub total_duration_ms: u64,
    pub max_peak_rss_kib: u64,
    pub cost: f64,
}

/// One run whose tier did not fit.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub decision_id: Uuid,
    pub task_id: Uuid,
    pub agent: String,
    pub kind: Option<String>,
    pub tier: String,
    pub mode: Mode,
    pub chooser: String,
    pub peak_rss_kib: u64,
    pub duration_ms: u64,
    pub tier_memory_mb: u64,
    pub tier_timeout_seconds: u64,
    pub killed_for: Option<String>,
    pub exit_code: Option<i32>,
    pub suggested_tier: Option<String>,
}

/// Decisions by mode and verdict (escalations and denials have no outcome but count).
#[derive(Debug, Clone, Serialize)]
pub struct VerdictCount {
    pub mode: Mode,
    pub verdict: Verdict,
    pub count: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub since: DateTime<Utc>,
    pub rows: Vec<Row>,
    pub over_provisioned: Vec<Finding>,
    pub under_provisioned: Vec<Finding>,
    pub decisions: Vec<VerdictCount>,
}

/// Builds the report over outcomes recorded since `since`.
pub async fn build(pool: &PgPool, tiers: &Tiers, since: DateTime<Utc>) -> Result<Report, sqlx::Error> {
    let outcomes = store::outcomes_since(pool, since).await?;
    let verdicts = store::verdict_counts_since(pool, since).await?;
    let mut report = summarise(tiers, &outcomes);
    report.since = since;
    report.decisions =
        verdicts.into_iter().map(|(mode, verdict, count)| VerdictCount { mode, verdict, count }).collect();
    Ok(report)
}

fn summarise(tiers: &Tiers, outcomes: &[DecisionRow]) -> Report {
    let mut rows: BTreeMap<(String, &'static str), Row> = BTreeMap::new();
    let mut over = Vec::new();
    let mut under = Vec::new();
    for r in outcomes {
        let d = &r.decision;
        let Some(tier) = d.tier_spec.as_ref().map(|t| &t.0) else { continue };
        let peak = d.peak_rss_kib.unwrap_or(0).max(0) as u64;
        let ms = d.duration_ms.unwrap_or(0).max(0) as u64;
        let fit = classify(tiers, tier, peak, ms, d.killed_for.as_deref());
        let row = rows.entry((tier.name.clone(), d.mode.as_str())).or_insert_with(|| Row {
            tier: tier.name.clone(),
            mode: d.mode.as_str().into(),
            ..Row::default()
        });
        row.runs += 1;
        match (d.timed_out, d.exit_code, d.killed_for.as_deref()) {
            (Some(true), _, _) => row.timed_out += 1,
            (_, Some(0), None) => row.succeeded += 1,
            _ => row.failed += 1,
        }
        if d.killed_for.as_deref() == Some("memory") {
            row.killed_for_memory += 1;
        }
        row.total_duration_ms += ms;
        row.max_peak_rss_kib = row.max_peak_rss_kib.max(peak);
        row.cost += tier.cost_of(ms);
        let finding = |suggested: Option<String>| Finding {
            decision_id: d.id,
            task_id: d.task_id,
            agent: r.agent.clone(),
            kind: r.kind.clone(),
            tier: tier.name.clone(),
            mode: d.mode,
            chooser: d.chooser.clone(),
            peak_rss_kib: peak,
            duration_ms: ms,
            tier_memory_mb: tier.memory_mb,
            tier_timeout_seconds: tier.timeout_seconds,
            killed_for: d.killed_for.clone(),
            exit_code: d.exit_code,
            suggested_tier: suggested,
        };
        match fit {
            Fit::Right => {}
            Fit::Over(s) => {
                row.over_provisioned += 1;
                over.push(finding(Some(s)));
            }
            Fit::Under(s) => {
                row.under_provisioned += 1;
                under.push(finding(s));
            }
        }
    }
    Report {
        since: DateTime::<Utc>::MIN_UTC,
        rows: rows.into_values().collect(),
        over_provisioned: over,
        under_provisioned: under,
        decisions: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_core::config::sandbox::SandboxConfig;

    #[test]
    fn fits() {
        let c = SandboxConfig::default();
        let t = |n: &str| c.tiers.get(n).unwrap().clone();
        // `echo` on heavy: light would have held it.
        assert_eq!(classify(&c.tiers, &t("heavy"), 1_000, 5, None), Fit::Over("light".into()));
        // 700 MiB peak on heavy: light (512) does not hold it with headroom, standard does.
        assert_eq!(classify(&c.tiers, &t("heavy"), 700 * 1024, 5, None), Fit::Over("standard".into()));
        // On the smallest tier nothing is smaller.
        assert_eq!(classify(&c.tiers, &t("light"), 1_000, 5, None), Fit::Right);
        // A run using most of its tier fits it.
        assert_eq!(classify(&c.tiers, &t("standard"), 1500 * 1024, 5, None), Fit::Right);
        // A long run is not over-provisioned for memory alone: light's timeout is 300 s.
        assert_eq!(classify(&c.tiers, &t("standard"), 1_000, 200_000, None), Fit::Right);
        assert_eq!(classify(&c.tiers, &t("light"), 600_000, 5, Some("memory")), Fit::Under(Some("standard".into())));
        assert_eq!(classify(&c.tiers, &t("standard"), 1, 1, Some("timeout")), Fit::Under(Some("heavy".into())));
        assert_eq!(classify(&c.tiers, &t("heavy"), 1, 1, Some("timeout")), Fit::Under(None));
        assert_eq!(classify(&c.tiers, &t("light"), 1, 1, Some("processes")), Fit::Under(Some("standard".into())));
    }
}

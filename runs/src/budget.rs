//! Budgets: the limits a run is created with, within the ceilings the operator sets per
//! agent (`runs.*`), and what one step spends.
//!
//! 0 in a request means "as much as the ceiling allows"; a ceiling of 0 means none, and so
//! does a limit of 0 stored on a run. A request above its ceiling is refused, naming the
//! limit: no agent sets itself a budget larger than its operator allows.

use airlock_core::config::RunsConfig;
use serde::{Deserialize, Serialize};

use crate::error::RunError;

/// A run's limits (0: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub max_steps: i64,
    pub max_tokens: i64,
    pub max_cost_micros: i64,
}

/// What one step spends beside the step itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Usage {
    pub tokens: i64,
    pub cost_micros: i64,
}

impl Usage {
    /// Refuses negative usage.
    pub fn check(self) -> Result<Self, RunError> {
        if self.tokens < 0 || self.cost_micros < 0 {
            return Err(RunError::Invalid("usage: tokens and cost_micros must be 0 or positive".into()));
        }
        Ok(self)
    }
}

/// The limits of a new run of `agent`: each asked limit within its ceiling, 0 taking the
/// ceiling.
pub fn limits_for(cfg: &RunsConfig, agent: &str, asked: Limits) -> Result<Limits, RunError> {
    let (steps, tokens, cost) = cfg.ceilings(agent);
    let within = |name: &'static str, asked: i64, ceiling: i64| -> Result<i64, RunError> {
        if asked < 0 {
            return Err(RunError::Invalid(format!("budget.{name}: must be 0 (the ceiling) or positive")));
        }
        match (asked, ceiling) {
            (0, c) => Ok(c),
            (a, 0) => Ok(a),
            (a, c) if a <= c => Ok(a),
            (a, c) => Err(RunError::Invalid(format!(
                "budget.{name}: {a} is above this agent's ceiling of {c} (runs.{name}); ask for at most {c}, or 0"
            ))),
        }
    };
    Ok(Limits {
        max_steps: within("max_steps", asked.max_steps, steps)?,
        max_tokens: within("max_tokens", asked.max_tokens, tokens)?,
        max_cost_micros: within("max_cost_micros", asked.max_cost_micros, cost)?,
    })
}

/// Which limit one more step spending `usage` would pass, given what is used; `None`: it
/// fits.
pub fn passed(limits: Limits, used: (i64, i64, i64), usage: Usage) -> Option<&'static str> {
    let over = |limit: i64, used: i64, more: i64| limit != 0 && used + more > limit;
    if over(limits.max_steps, used.0, 1) {
        Some("max_steps")
    } else if over(limits.max_tokens, used.1, usage.tokens) {
        Some("max_tokens")
    } else if over(limits.max_cost_micros, used.2, usage.cost_micros) {
        Some("max_cost_micros")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> RunsConfig {
        let mut c = RunsConfig::default();
        c.agents.insert(
            "big".into(),
            airlock_core::config::RunCeilings {
                max_steps: Some(50_000),
                max_tokens: Some(1_000),
                ..Default::default()
            },
        );
        c
    }

    #[test]
    fn asked_limits_stay_within_their_ceilings() {
        let c = cfg();
        let l = limits_for(&c, "agent-1", Limits::default()).unwrap();
        assert_eq!(l, Limits { max_steps: 10_000, max_tokens: 0, max_cost_micros: 0 }, "0 takes the ceiling");
        let l = limits_for(&c, "agent-1", Limits { max_steps: 5, max_tokens: 7, max_cost_micros: 9 }).unwrap();
        assert_eq!(l, Limits { max_steps: 5, max_tokens: 7, max_cost_micros: 9 }, "no ceiling: as asked");
        let e = limits_for(&c, "agent-1", Limits { max_steps: 10_001, ..Default::default() }).unwrap_err();
        assert!(e.to_string().contains("max_steps") && e.to_string().contains("10000"), "{e}");
        let l = limits_for(&c, "big", Limits { max_steps: 20_000, ..Default::default() }).unwrap();
        assert_eq!(l.max_steps, 20_000, "an agent's own ceiling replaces the default");
        assert_eq!(l.max_tokens, 1_000);
        assert!(limits_for(&c, "big", Limits { max_tokens: 1_001, ..Default::default() }).is_err());
        assert!(limits_for(&c, "agent-1", Limits { max_steps: -1, ..Default::default() }).is_err());
    }

    #[test]
    fn a_step_passes_the_first_limit_it_would_exceed() {
        let l = Limits { max_steps: 3, max_tokens: 100, max_cost_micros: 0 };
        assert_eq!(passed(l, (2, 0, 0), Usage::default()), None);
        assert_eq!(passed(l, (3, 0, 0), Usage::default()), Some("max_steps"));
        assert_eq!(passed(l, (0, 90, 0), Usage { tokens: 10, cost_micros: 0 }), None);
        assert_eq!(passed(l, (0, 90, 0), Usage { tokens: 11, cost_micros: 0 }), Some("max_tokens"));
        assert_eq!(passed(l, (0, 0, 5), Usage { tokens: 0, cost_micros: 1_000_000 }), None, "no cost limit");
    }
}

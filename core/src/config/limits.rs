//! Limits an agent cannot lift (`limits.*`): how many deliveries an agent may submit in a
//! rolling hour, and how many emails one address may be sent in a rolling day.

use std::collections::BTreeMap;

use serde::Deserialize;

/// `limits.*`. A limit of 0 means "no limit".
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Submissions one agent may make in a rolling hour.
    pub deliveries_per_hour: u32,
    /// Emails to one address in a rolling day, across all agents.
    pub per_recipient_per_day: u32,
    /// One agent's own limits, replacing the ones above for it
    /// (`limits.agents.<agent>.deliveries_per_hour`).
    pub agents: BTreeMap<String, AgentLimits>,
}

/// One agent's limits; an unset one is the default.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentLimits {
    pub deliveries_per_hour: Option<u32>,
}

impl LimitsConfig {
    /// The submissions `agent` may make in a rolling hour (0: no limit).
    pub fn deliveries_per_hour(&self, agent: &str) -> u32 {
        self.agents
            .get(agent)
            .or_else(|| self.agents.get(&agent.to_ascii_lowercase()))
            .and_then(|a| a.deliveries_per_hour)
            .unwrap_or(self.deliveries_per_hour)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_limit_replaces_the_default() {
        let mut c = LimitsConfig { deliveries_per_hour: 10, ..Default::default() };
        c.agents.insert("bulk".into(), AgentLimits { deliveries_per_hour: Some(100) });
        c.agents.insert("quiet".into(), AgentLimits { deliveries_per_hour: None });
        assert_eq!(c.deliveries_per_hour("bulk"), 100);
        assert_eq!(c.deliveries_per_hour("quiet"), 10);
        assert_eq!(c.deliveries_per_hour("other"), 10);
    }
}

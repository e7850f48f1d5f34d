//! Tier selection: a pure function from a request, the configuration and a few facts read
//! from the database (minutes used, outcomes of similar tasks) to a [`Decision`].
//!
//! The order of checks, for every mode:
//! 1. **Scopes** (hard): the durable context and the secrets a task asks for must be in the
//!    agent's scope; otherwise the request is denied, whatever the mode.
//! 2. **Mode**:
//!    - `human`: escalated; an operator chooses.
//!    - `agent`: the agent's tier (its request, else its default) must be within bounds;
//!      otherwise denied.
//!    - `hybrid`: the same proposal and bounds, but a proposal out of bounds is escalated
//!      to an operator instead of denied.
//!    - `platform`: central rules pick the tier (history of similar tasks, then the task
//!      kind, then the declared size, then the agent's default); a pick out of bounds is
//!      escalated.
//! 3. **Bounds** (what a machine may grant on its own): the tier is allowed to the agent,
//!    does not need approval (`sandbox.approval_tiers`), and fits the agent's daily quota.
//!
//! A human's choice (`POST /admin/v1/tasks/{id}/choose`) is the exception path and is not
//! bounded here: it is audited instead.

use super::state::{Mode, Size, Verdict};
use airlock_core::config::sandbox::{AgentPolicy, SandboxConfig, Tier};

/// Who a decision names as the chooser when the platform decides.
pub const PLATFORM: &str = "platform";

/// The parts of a task that selection looks at.
#[derive(Debug, Clone)]
pub struct Ask<'a> {
    pub agent: &'a str,
    pub mode: Mode,
    pub requested_tier: Option<&'a str>,
    pub reason: Option<&'a str>,
    pub kind: Option<&'a str>,
    pub size: Option<Size>,
    pub context: &'a [String],
    pub secrets: &'a [String],
}

/// One finished similar task: what it used, and the tier it had.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub peak_rss_kib: u64,
    pub duration_ms: u64,
    pub killed_for: Option<String>,
    pub tier: Tier,
}

/// What the database knows that selection needs.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// Sandbox minutes of this agent's decisions in the last 24 hours (real durations for
    /// finished runs, the tier's timeout for the others).
    pub used_minutes: f64,
    /// Outcomes of similar tasks of this agent, newest first.
    pub history: Vec<Sample>,
}

/// A decision, before it is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub verdict: Verdict,
    /// The tier, when chosen.
    pub tier: Option<Tier>,
    pub chooser: String,
    pub reason: String,
}

impl Decision {
    fn chosen(tier: &Tier, chooser: String, reason: String) -> Self {
        Self { verdict: Verdict::Chosen, tier: Some(tier.clone()), chooser, reason }
    }
    fn escalated(reason: String) -> Self {
        Self { verdict: Verdict::Escalated, tier: None, chooser: PLATFORM.into(), reason }
    }
    fn denied(reason: String) -> Self {
        Self { verdict: Verdict::Denied, tier: None, chooser: PLATFORM.into(), reason }
    }
}

/// The chooser name of an agent.
pub fn agent_chooser(agent: &str) -> String {
    format!("agent:{agent}")
}

/// The chooser name of a human.
pub fn human_chooser(name: &str) -> String {
    format!("human:{name}")
}

/// Headroom the history rule wants over the most a similar task used.
const HISTORY_HEADROOM: u64 = 2;

/// Decides the tier of one task.
pub fn decide(cfg: &SandboxConfig, ask: &Ask<'_>, facts: &Facts) -> Decision {
    let policy = cfg.policy(ask.agent);
    if let Err(why) = check_scopes(policy, ask) {
        return Decision::denied(why);
    }
    let with_reason = |base: String| match ask.reason {
        Some(r) => format!("{base}; the agent said: {r}"),
        None => base,
    };
    match ask.mode {
        Mode::Human => Decision::escalated(with_reason("mode human: an operator chooses the tier".into())),
        Mode::Agent | Mode::Hybrid => {
            let name = ask.requested_tier.unwrap_or(&policy.default_tier);
            let Some(tier) = cfg.tiers.get(name) else {
                return Decision::denied(format!("tier `{name}` is not configured"));
            };
            let source = if ask.requested_tier.is_some() { "requested" } else { "the agent's default" };
            match check_bounds(cfg, policy, tier, facts) {
                Ok(()) => Decision::chosen(
                    tier,
                    agent_chooser(ask.agent),
                    with_reason(format!("{} ({source}) is within the agent's bounds", tier.name)),
                ),
                Err(why) if ask.mode == Mode::Agent => Decision::denied(with_reason(format!(
                    "{} ({source}) is out of bounds: {why}; ask with mode hybrid or human for an exception",
                    tier.name
                ))),
                Err(why) => Decision::escalated(with_reason(format!(
                    "{} ({source}) is out of bounds: {why}; an operator decides",
                    tier.name
                ))),
            }
        }
        Mode::Platform => {
            let (tier, rule) = platform_pick(cfg, policy, ask, facts);
            match check_bounds(cfg, policy, tier, facts) {
                Ok(()) => Decision::chosen(tier, PLATFORM.into(), rule),
                Err(why) => Decision::escalated(format!("{rule}; but {why}; an operator decides")),
            }
        }
    }
}

/// The context and secrets asked for must be in the agent's scope.
fn check_scopes(policy: &AgentPolicy, ask: &Ask<'_>) -> Result<(), String> {
    if let Some(other) = ask.context.iter().find(|c| !policy.may_read_context_of(ask.agent, c)) {
        return Err(format!("the agent's scope does not include reading the context of agent `{other}`"));
    }
    if let Some(s) = ask.secrets.iter().find(|s| !policy.may_use_secret(s)) {
        return Err(format!("the agent's scope does not include the secret `{s}`"));
    }
    Ok(())
}

/// What a machine may grant on its own: an allowed tier, not reserved for approval, within
/// the daily quota.
fn check_bounds(cfg: &SandboxConfig, policy: &AgentPolicy, tier: &Tier, facts: &Facts) -> Result<(), String> {
    if !policy.allows_tier(&tier.name) {
        return Err(format!("the agent may use only {}", policy.allowed_tiers.join(", ")));
    }
    if cfg.needs_approval(&tier.name) {
        return Err(format!("{} needs an operator's approval", tier.name));
    }
    let quota = policy.quota_minutes_per_day as f64;
    let reserve = tier.timeout_seconds as f64 / 60.0;
    if quota > 0.0 && facts.used_minutes + reserve > quota {
        return Err(format!(
            "the daily quota of {quota} minutes would be passed ({:.1} used in the last 24 hours, {} reserves {reserve:.1})",
            facts.used_minutes, tier.name
        ));
    }
    Ok(())
}

/// The platform's central rules, first match wins: history of similar tasks, task kind,
/// declared size, the agent's default. Returns the tier and the rule that picked it.
fn platform_pick<'c>(cfg: &'c SandboxConfig, policy: &AgentPolicy, ask: &Ask<'_>, facts: &Facts) -> (&'c Tier, String) {
    if facts.history.len() >= cfg.platform.history_min_samples {
        return history_pick(cfg, &facts.history);
    }
    let kind_rule = ask.kind.and_then(|k| cfg.platform.kinds.get(k).and_then(|t| cfg.tiers.get(t)).map(|t| (k, t)));
    if let Some((kind, t)) = kind_rule {
        return (t, format!("platform rule: tasks of kind `{kind}` run in {}", t.name));
    }
    if let Some(size) = ask.size {
        let t = match size {
            Size::Small => cfg.tiers.smallest(),
            Size::Medium => cfg.tiers.get(&policy.default_tier).unwrap_or(cfg.tiers.smallest()),
            Size::Large => cfg.tiers.largest(),
        };
        return (t, format!("platform rule: declared size {} runs in {}", size.as_str(), t.name));
    }
    let t = cfg.tiers.get(&policy.default_tier).unwrap_or(cfg.tiers.smallest());
    (t, format!("platform rule: no history, kind rule or size; the agent's default tier {}", t.name))
}

/// The smallest tier that holds the most any similar task used, with headroom, and more
/// than any tier a similar task was killed in for lack of it.
fn history_pick<'c>(cfg: &'c SandboxConfig, history: &[Sample]) -> (&'c Tier, String) {
    let mut need_kib = 0u64;
    let mut need_ms = 0u64;
    let mut need_disk_mb = 0u64;
    for s in history {
        need_kib = need_kib.max(s.peak_rss_kib.saturating_mul(HISTORY_HEADROOM));
        need_ms = need_ms.max(s.duration_ms.saturating_mul(HISTORY_HEADROOM));
        match s.killed_for.as_deref() {
            Some("memory") => need_kib = need_kib.max(s.tier.memory_kib() + 1),
            Some("timeout") | Some("cpu") => need_ms = need_ms.max(s.tier.timeout_ms() + 1),
            Some("disk") => need_disk_mb = need_disk_mb.max(s.tier.disk_mb + 1),
            _ => {}
        }
    }
    let killed = history.iter().filter(|s| s.killed_for.is_some()).count();
    let fits =
        cfg.tiers.iter().find(|t| t.memory_kib() >= need_kib && t.timeout_ms() >= need_ms && t.disk_mb >= need_disk_mb);
    let summary = format!(
        "history: {} similar tasks used at most {} KiB and {} ms ({killed} killed for a limit)",
        history.len(),
        need_kib / HISTORY_HEADROOM,
        need_ms / HISTORY_HEADROOM
    );
    match fits {
        Some(t) => {
            (t, format!("{summary}; {} is the smallest tier that fits with {HISTORY_HEADROOM}x headroom", t.name))
        }
        None => {
            let t = cfg.tiers.largest();
            (t, format!("{summary}; no tier fits with {HISTORY_HEADROOM}x headroom, so the largest, {}", t.name))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_core::config::Config;

    fn cfg(extra: &[(&str, &str)]) -> SandboxConfig {
        let mut vars = vec![("DATABASE_URL".to_string(), "postgres://x/y".to_string())];
        vars.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Config::from_sources(None, &vars).unwrap().sandbox
    }

    fn ask(mode: Mode, tier: Option<&'static str>) -> Ask<'static> {
        Ask {
            agent: "a1",
            mode,
            requested_tier: tier,
            reason: None,
            kind: None,
            size: None,
            context: &[],
            secrets: &[],
        }
    }

    fn sample(c: &SandboxConfig, tier: &str, kib: u64, ms: u64, killed: Option<&str>) -> Sample {
        Sample {
            peak_rss_kib: kib,
            duration_ms: ms,
            killed_for: killed.map(String::from),
            tier: c.tiers.get(tier).unwrap().clone(),
        }
    }

    fn tier(d: &Decision) -> Option<&str> {
        d.tier.as_ref().map(|t| t.name.as_str())
    }

    #[test]
    fn agent_mode_chooses_within_bounds_and_denies_outside() {
        let c = cfg(&[]);
        let d = decide(&c, &ask(Mode::Agent, Some("light")), &Facts::default());
        assert_eq!((d.verdict, tier(&d), d.chooser.as_str()), (Verdict::Chosen, Some("light"), "agent:a1"));
        let d = decide(&c, &ask(Mode::Agent, None), &Facts::default());
        assert_eq!(tier(&d), Some("standard"), "the default tier");
        let d = decide(&c, &ask(Mode::Agent, Some("heavy")), &Facts::default());
        assert_eq!((d.verdict, d.chooser.as_str()), (Verdict::Denied, "platform"));
        assert!(d.reason.contains("out of bounds"), "{}", d.reason);
    }

    #[test]
    fn allowed_tiers_are_per_agent() {
        let c = cfg(&[("AIRLOCK__SANDBOX__AGENTS__A1__ALLOWED_TIERS", "light")]);
        let d = decide(&c, &ask(Mode::Agent, Some("standard")), &Facts::default());
        assert_eq!(d.verdict, Verdict::Denied);
        assert!(d.reason.contains("may use only light"), "{}", d.reason);
        let mut other = ask(Mode::Agent, Some("standard"));
        other.agent = "a2";
        assert_eq!(decide(&c, &other, &Facts::default()).verdict, Verdict::Chosen);
    }

    #[test]
    fn hybrid_escalates_what_agent_mode_denies() {
        let c = cfg(&[]);
        let d = decide(&c, &ask(Mode::Hybrid, Some("light")), &Facts::default());
        assert_eq!((d.verdict, tier(&d), d.chooser.as_str()), (Verdict::Chosen, Some("light"), "agent:a1"));
        let d = decide(&c, &ask(Mode::Hybrid, Some("heavy")), &Facts::default());
        assert_eq!((d.verdict, d.chooser.as_str()), (Verdict::Escalated, "platform"));
        assert!(d.reason.contains("may use only light, standard"), "{}", d.reason);
        // Even a tier allowed to the agent needs a human when it is an approval tier.
        let c = cfg(&[("AIRLOCK__SANDBOX__AGENTS__A1__ALLOWED_TIERS", "light,standard,heavy")]);
        let d = decide(&c, &ask(Mode::Hybrid, Some("heavy")), &Facts::default());
        assert_eq!(d.verdict, Verdict::Escalated);
        assert!(d.reason.contains("heavy needs an operator's approval"), "{}", d.reason);
    }

    #[test]
    fn quota_bounds_machine_choices() {
        let c = cfg(&[("AIRLOCK__SANDBOX__AGENTS__A1__QUOTA_MINUTES_PER_DAY", "10")]);
        let used = Facts { used_minutes: 6.0, history: vec![] };
        // light reserves 5 minutes: 6 + 5 > 10.
        assert_eq!(decide(&c, &ask(Mode::Agent, Some("light")), &used).verdict, Verdict::Denied);
        let d = decide(&c, &ask(Mode::Hybrid, Some("light")), &used);
        assert_eq!(d.verdict, Verdict::Escalated);
        assert!(d.reason.contains("quota"), "{}", d.reason);
        let fresh = Facts { used_minutes: 4.0, history: vec![] };
        assert_eq!(decide(&c, &ask(Mode::Agent, Some("light")), &fresh).verdict, Verdict::Chosen);
    }

    #[test]
    fn human_mode_always_escalates() {
        let c = cfg(&[]);
        let d = decide(&c, &ask(Mode::Human, Some("light")), &Facts::default());
        assert_eq!(d.verdict, Verdict::Escalated);
        assert_eq!(d.tier, None);
    }

    #[test]
    fn scopes_are_hard_in_every_mode() {
        let c =
            cfg(&[("AIRLOCK__SANDBOX__AGENTS__A1__CONTEXT", "a3"), ("AIRLOCK__SANDBOX__AGENTS__A1__SECRETS", "S1")]);
        let ok_ctx = ["a1".to_string(), "a3".to_string()];
        let bad_ctx = ["a2".to_string()];
        let ok_sec = ["S1".to_string()];
        let bad_sec = ["S2".to_string()];
        for mode in Mode::ALL {
            let mut a = ask(mode, Some("light"));
            a.context = &bad_ctx;
            let d = decide(&c, &a, &Facts::default());
            assert_eq!(d.verdict, Verdict::Denied, "{mode:?}");
            assert!(d.reason.contains("`a2`"));
            let mut a = ask(mode, Some("light"));
            a.secrets = &bad_sec;
            assert_eq!(decide(&c, &a, &Facts::default()).verdict, Verdict::Denied, "{mode:?}");
            let mut a = ask(mode, Some("light"));
            a.context = &ok_ctx;
            a.secrets = &ok_sec;
            assert_ne!(decide(&c, &a, &Facts::default()).verdict, Verdict::Denied, "{mode:?}");
        }
    }

    #[test]
    fn platform_rules_in_order() {
        let c = cfg(&[("AIRLOCK__SANDBOX__PLATFORM__KINDS__LINT", "light")]);
        let mut a = ask(Mode::Platform, Some("standard"));
        let d = decide(&c, &a, &Facts::default());
        assert_eq!((d.verdict, tier(&d), d.chooser.as_str()), (Verdict::Chosen, Some("standard"), "platform"));
        a.size = Some(Size::Small);
        assert_eq!(tier(&decide(&c, &a, &Facts::default())), Some("light"));
        a.kind = Some("lint");
        a.size = Some(Size::Large);
        let d = decide(&c, &a, &Facts::default());
        assert_eq!(tier(&d), Some("light"), "the kind rule comes before the size");
        assert!(d.reason.contains("kind `lint`"), "{}", d.reason);
        a.kind = None;
        let d = decide(&c, &a, &Facts::default());
        assert_eq!(d.verdict, Verdict::Escalated, "large means heavy, which needs approval");
    }

    #[test]
    fn platform_history_right_sizes() {
        let c = cfg(&[]);
        let a = ask(Mode::Platform, None);
        let small =
            Facts { used_minutes: 0.0, history: (0..3).map(|_| sample(&c, "standard", 10_000, 200, None)).collect() };
        let d = decide(&c, &a, &small);
        assert_eq!(tier(&d), Some("light"));
        assert!(d.reason.starts_with("history: 3 similar tasks"), "{}", d.reason);
        // Two samples are not enough: the default applies.
        let few = Facts { used_minutes: 0.0, history: small.history[..2].to_vec() };
        assert_eq!(tier(&decide(&c, &a, &few)), Some("standard"));
        // A task killed in light for memory goes to a bigger tier.
        let mut killed = small.clone();
        killed.history[0] = sample(&c, "light", 600 * 1024, 100, Some("memory"));
        assert_eq!(tier(&decide(&c, &a, &killed)), Some("standard"));
        // A timeout in standard needs more than standard's timeout: heavy, which escalates.
        killed.history[0] = sample(&c, "standard", 1000, 1_800_000, Some("timeout"));
        assert_eq!(decide(&c, &a, &killed).verdict, Verdict::Escalated);
    }
}

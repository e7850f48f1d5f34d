//! Scoring: a persisted delivery is scored and routed to review (below the threshold) or to
//! approval, where a matching standing grant approves it at once and its send is enqueued.
//!
//! One path for one delivery or many: [`score`] is [`score_many`] of one. The deliveries a
//! worker scores at the same moment share one transaction, and a grant's uses are counted
//! once per transaction, so deliveries approved by one grant do not queue on its row one
//! commit at a time. A grant never gives more uses than it has left: when a batch would
//! overspend it, the batch is rolled back and scored again with only as many deliveries
//! taking that grant as it has uses, the others passing it over.
//!
//! With a [`Judge`] (`scoring.model`), every persisted delivery of the batch is judged
//! first, with no transaction open (a model answers in seconds, and no row may stay locked
//! that long); the transaction then takes the lower of the two scores. A verdict counts only
//! for the artifact it read: a judge that could not answer, broke its protocol, or read
//! another version routes the delivery to review (fail closed), never to approval.

use std::collections::{BTreeMap, HashMap, HashSet};

use airlock_core::config::Config;
use airlock_core::ids::{DeliveryId, GrantId};
use airlock_queue::{self as queue, Lease, NewJob, QueueError, Waker};
use serde_json::json;
use sqlx::PgPool;

use super::{PipelineError, SEND_QUEUE, send_job_for, stored_limits};
use crate::actor::Actor;
use crate::artifact::Artifact;
use crate::grants;
use crate::scoring::{Judge, Score, Scorer, Verdict};
use crate::state::{Action, DeliveryState};
use crate::store::{self, Delivery, NewApproval, NewScore, Step};

/// The most deliveries [`score_many`] scores in one transaction.
pub const MAX_SCORE_BATCH: usize = 32;

/// Scores a persisted delivery and routes it to review or approval, completing its job in
/// the same transaction; a delivery already past `persisted` just completes the job.
pub async fn score(
    pool: &PgPool,
    cfg: &Config,
    waker: &Waker,
    scorer: &dyn Scorer,
    judge: Option<&dyn Judge>,
    lease: Lease,
    delivery_id: DeliveryId,
) -> Result<(), PipelineError> {
    let mut out = score_many(pool, cfg, waker, scorer, judge, &[(lease, delivery_id)]).await;
    out.pop().unwrap_or(Ok(()))
}

/// Scores several deliveries, each under its own job's lease, in one transaction. A lease
/// that is no longer held gets [`QueueError::LeaseLost`] and nothing is written for it; a
/// delivery that does not exist gets `NotFound`. Results are in input order.
pub async fn score_many(
    pool: &PgPool,
    cfg: &Config,
    waker: &Waker,
    scorer: &dyn Scorer,
    judge: Option<&dyn Judge>,
    items: &[(Lease, DeliveryId)],
) -> Vec<Result<(), PipelineError>> {
    let mut results: Vec<Option<Result<(), PipelineError>>> = items.iter().map(|_| None).collect();
    let judged = match judge {
        Some(judge) => {
            let ids: Vec<DeliveryId> = items.iter().map(|(_, id)| *id).collect();
            match judge_all(pool, judge, &ids).await {
                Ok(j) => Some(Judged { name: judge.name(), verdicts: j }),
                Err(e) => {
                    let all: Vec<usize> = (0..items.len()).collect();
                    fail_all(&mut results, &all, e);
                    return results.into_iter().map(|r| r.unwrap_or(Ok(()))).collect();
                }
            }
        }
        None => None,
    };
    // Uses a grant may still give in this batch, once it turned out to have fewer than asked.
    let mut caps: HashMap<GrantId, i32> = HashMap::new();
    loop {
        let pending: Vec<usize> = (0..items.len()).filter(|i| results[*i].is_none()).collect();
        if pending.is_empty() {
            break;
        }
        match score_pending(pool, cfg, scorer, judged.as_ref(), items, &pending, &caps).await {
            Ok(Scored::Committed { missing, sends }) => {
                for i in pending {
                    results[i] =
                        Some(if missing.contains(&i) { Err(PipelineError::NotFound("delivery")) } else { Ok(()) });
                }
                if sends {
                    waker.wake(SEND_QUEUE);
                }
            }
            Ok(Scored::LeasesLost(lost)) => {
                for i in lost {
                    results[i] = Some(Err(QueueError::lost(items[i].0).into()));
                }
            }
            Ok(Scored::GrantShort(grant)) => match grants::uses_left(pool, grant).await {
                Ok(n) => {
                    caps.insert(grant, n);
                }
                Err(e) => fail_all(&mut results, &pending, e.into()),
            },
            Err(e) => fail_all(&mut results, &pending, e),
        }
    }
    results.into_iter().map(|r| r.unwrap_or(Ok(()))).collect()
}

/// Gives every pending item the error of their shared transaction.
fn fail_all(results: &mut [Option<Result<(), PipelineError>>], pending: &[usize], e: PipelineError) {
    let Some((first, rest)) = pending.split_first() else { return };
    for i in rest {
        results[*i] = Some(Err(e.for_each()));
    }
    results[*first] = Some(Err(e));
}

/// What one transaction of [`score_many`] did.
enum Scored {
    /// Committed; `missing` lists the items whose delivery does not exist (nothing was
    /// written for them), `sends` whether a grant approved any delivery.
    Committed { missing: HashSet<usize>, sends: bool },
    /// Rolled back: these items' leases are no longer held.
    LeasesLost(Vec<usize>),
    /// Rolled back: this grant has fewer uses left than the batch asked of it.
    GrantShort(GrantId),
}

/// The grant that approves a delivery, and the actor its approval is recorded by.
type ByGrant = (GrantId, Actor);

/// A judge's verdicts on a batch, each with the artifact version it read.
struct Judged<'a> {
    name: &'a str,
    verdicts: HashMap<DeliveryId, (String, Verdict)>,
}

/// Judges every persisted delivery of `ids`, at once, outside any transaction.
async fn judge_all(
    pool: &PgPool,
    judge: &dyn Judge,
    ids: &[DeliveryId],
) -> Result<HashMap<DeliveryId, (String, Verdict)>, PipelineError> {
    let rows = store::persisted_artifacts(pool, ids).await?;
    let mut artifacts = Vec::with_capacity(rows.len());
    for (id, sha, body) in rows {
        // A stored artifact that no longer parses is scored (and refused) in the transaction.
        if let Ok(a) = Artifact::from_json(&body, &stored_limits()) {
            artifacts.push((id, sha, a));
        }
    }
    let verdicts = futures_util::future::join_all(artifacts.iter().map(|(_, _, a)| judge.judge(a))).await;
    Ok(artifacts.into_iter().zip(verdicts).map(|((id, sha, _), v)| (id, (sha, v))).collect())
}

/// How scoring routes one delivery: to review below the threshold (or when the judge gave
/// no verdict on this artifact), else to approval.
struct Routed {
    score: Score,
    scorer: String,
    judge: Option<serde_json::Value>,
    route: Action,
    why: String,
}

fn route(cfg: &Config, scorer: &dyn Scorer, judged: Option<&Judged>, d: &Delivery, artifact: &Artifact) -> Routed {
    let own = scorer.score(artifact);
    let threshold = cfg.scoring.review_threshold;
    let (mut score, name, judge, refused) = match judged {
        None => (own, scorer.name().to_string(), None, None),
        Some(j) => match j.verdicts.get(&d.id) {
            Some((sha, Ok(verdict))) if *sha == d.artifact_sha256 => {
                let seen = json!({"scorer": j.name, "value": verdict.value, "reasons": verdict.reasons});
                if verdict.value < own.value {
                    (verdict.clone(), j.name.to_string(), Some(seen), None)
                } else {
                    (own, scorer.name().to_string(), Some(seen), None)
                }
            }
            Some((sha, Err(why))) if *sha == d.artifact_sha256 => {
                let why = format!("the judge {} gave no score: {why}", j.name);
                (own, scorer.name().to_string(), Some(json!({"scorer": j.name, "error": why})), Some(why))
            }
            _ => {
                let why = format!("the judge {} did not read this version of the artifact", j.name);
                (own, scorer.name().to_string(), Some(json!({"scorer": j.name, "error": why})), Some(why))
            }
        },
    };
    let (route, why) = match refused {
        Some(why) => {
            score.reasons.push(why.clone());
            (Action::RouteToReview, why)
        }
        None if score.value < threshold => {
            (Action::RouteToReview, format!("score {} is below the review threshold {threshold}", score.value))
        }
        None => {
            (Action::RouteToApproval, format!("score {} is at or above the review threshold {threshold}", score.value))
        }
    };
    Routed { score, scorer: name, judge, route, why }
}

/// The moves of one scored delivery: scored, routed, and approved when a grant matched.
fn score_steps<'a>(r: &'a Routed, actor: &'a Actor, grant: Option<(GrantId, &'a Actor)>, sha: &str) -> Vec<Step<'a>> {
    let mut steps = vec![
        Step {
            action: Action::Score,
            actor,
            reason: None,
            data: match &r.judge {
                None => json!({"score": r.score.value, "reasons": r.score.reasons}),
                Some(j) => json!({"score": r.score.value, "reasons": r.score.reasons, "scorer": r.scorer, "judge": j}),
            },
        },
        Step { action: r.route, actor, reason: Some(&r.why), data: json!({}) },
    ];
    if let Some((grant_id, grant_actor)) = grant {
        steps.push(Step {
            action: Action::Approve,
            actor: grant_actor,
            reason: Some("matched a standing grant"),
            data: json!({"artifact_sha256": sha, "grant_id": grant_id}),
        });
    }
    steps
}

/// One transaction over the `pending` items: every write for them, or none.
async fn score_pending(
    pool: &PgPool,
    cfg: &Config,
    scorer: &dyn Scorer,
    judged: Option<&Judged<'_>>,
    items: &[(Lease, DeliveryId)],
    pending: &[usize],
    caps: &HashMap<GrantId, i32>,
) -> Result<Scored, PipelineError> {
    let ids: Vec<DeliveryId> = pending.iter().map(|i| items[*i].1).collect();
    let index: HashMap<DeliveryId, usize> = pending.iter().map(|i| (items[*i].1, *i)).collect();
    let mut tx = pool.begin().await?;
    // Locked in id order, so two batches over overlapping deliveries cannot deadlock.
    let locked = store::lock_many_with_artifact(&mut *tx, &ids).await?;
    let found: HashSet<usize> = locked.iter().map(|(d, _)| index[&d.id]).collect();
    let missing: HashSet<usize> = pending.iter().copied().filter(|i| !found.contains(i)).collect();
    let mut caps = caps.clone();
    let mut scored: Vec<(&Delivery, Routed, Option<ByGrant>)> = Vec::with_capacity(locked.len());
    for (d, body) in &locked {
        if d.state != DeliveryState::Persisted {
            continue;
        }
        let artifact = Artifact::from_json(body, &stored_limits())?;
        let r = route(cfg, scorer, judged, d, &artifact);
        let grant = match r.route {
            Action::RouteToApproval => matching_grant(&mut tx, d, &artifact, r.score.value, &mut caps).await?,
            _ => None,
        };
        scored.push((d, r, grant.map(|g| (g, Actor::new("grant", g.to_string())))));
    }
    let threshold = cfg.scoring.review_threshold;
    let scores: Vec<NewScore> = scored
        .iter()
        .map(|(d, r, _)| NewScore {
            delivery_id: d.id,
            artifact_sha256: &d.artifact_sha256,
            value: r.score.value,
            reasons: &r.score.reasons,
            scorer: &r.scorer,
            threshold,
        })
        .collect();
    store::insert_scores(&mut *tx, &scores).await?;
    let approvals: Vec<NewApproval> = scored
        .iter()
        .filter_map(|(d, _, g)| g.as_ref().map(|(grant_id, _)| (d, *grant_id)))
        .map(|(d, grant_id)| NewApproval {
            delivery_id: d.id,
            artifact_sha256: &d.artifact_sha256,
            approver: None,
            grant_id: Some(grant_id),
            note: None,
        })
        .collect();
    store::insert_approvals(&mut *tx, &approvals).await?;
    let actor = Actor::system(&format!("scorer.{}", scorer.name()));
    let steps: Vec<Vec<Step>> = scored
        .iter()
        .map(|(d, r, g)| score_steps(r, &actor, g.as_ref().map(|(id, a)| (*id, a)), &d.artifact_sha256))
        .collect();
    let moves: Vec<(&Delivery, &[Step])> = scored.iter().zip(&steps).map(|((d, _, _), s)| (*d, s.as_slice())).collect();
    let moved = store::advance_many(&mut tx, &moves).await?;
    let sends: Vec<NewJob> =
        moved.iter().zip(&scored).filter(|(_, (_, _, g))| g.is_some()).map(|(d, _)| send_job_for(cfg, d)).collect();
    queue::enqueue_many_quiet(&mut tx, &sends).await?;
    // Every found delivery's job ends here, scored or already past `persisted`.
    let leases: Vec<Lease> = locked.iter().map(|(d, _)| items[index[&d.id]].0).collect();
    let completed: HashSet<Lease> = queue::complete_many(&mut *tx, &leases).await?.into_iter().collect();
    if completed.len() != leases.len() {
        tx.rollback().await?;
        let lost = locked.iter().map(|(d, _)| index[&d.id]).filter(|i| !completed.contains(&items[*i].0)).collect();
        return Ok(Scored::LeasesLost(lost));
    }
    // Last, in id order: each grant's row is locked only for the commit, as every delivery
    // it approves counts its uses on that one row.
    let mut uses = BTreeMap::<GrantId, i32>::new();
    for (grant_id, _) in scored.iter().filter_map(|(_, _, g)| g.as_ref()) {
        *uses.entry(*grant_id).or_default() += 1;
    }
    for (grant_id, n) in uses {
        if !grants::consume_many(&mut *tx, grant_id, n).await? {
            tx.rollback().await?;
            return Ok(Scored::GrantShort(grant_id));
        }
    }
    airlock_core::fault::hit("score.before_commit").await.map_err(|e| PipelineError::Invalid(e.to_string()))?;
    tx.commit().await?;
    Ok(Scored::Committed { missing, sends: !sends.is_empty() })
}

/// The grant that approves a delivery routed to approval, if one matches and has a use
/// left in this batch (`caps`, which it spends from).
async fn matching_grant(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    d: &Delivery,
    artifact: &Artifact,
    score: f64,
    caps: &mut HashMap<GrantId, i32>,
) -> Result<Option<GrantId>, sqlx::Error> {
    let spent: Vec<GrantId> = caps.iter().filter(|(_, n)| **n <= 0).map(|(g, _)| *g).collect();
    let grant = grants::find_match(&mut **tx, &d.agent, artifact, score, &spent).await?;
    if let Some(g) = grant
        && let Some(n) = caps.get_mut(&g)
    {
        *n -= 1;
    }
    Ok(grant)
}

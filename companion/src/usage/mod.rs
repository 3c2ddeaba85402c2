//! The usage ledger (issue 16): what the gateways report (`POST /internal/v1/usage`, contract in
//! `maas_types::usage`) kept per key, subject, tier, model and hour in PostgreSQL, rolled up to
//! days after `--usage-hourly-retention-days`; read back by `GET /v1/usage`; turned into the
//! chargeback counters `maas_companion_usage_*`. `GET /v1/quota` (here too) reads the budget
//! lease store instead: the numbers the gateways enforce.
//!
//! - [`store`]: the SQL (one statement per batch, one per rollup pass);
//! - [`ingest`]: the internal report endpoint;
//! - [`api`]: `GET /v1/usage` and `GET /v1/quota`, their parameters and who may see what.

pub mod api;
pub mod ingest;
pub mod store;

use crate::metrics::{Metrics, ResultLabels, UsageLabels};
use crate::settings::UsageSettings;
use chrono::Utc;
use maas_types::usage::UsageRecord;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use store::{Chargeback, RolledUp, StoreError, UsageStore};

/// The `user` label value of everyone beyond the cap.
pub const OTHER_USER: &str = "other";

/// Batch ids are remembered this long (a resend after that would count twice).
pub const BATCH_ID_RETENTION: chrono::TimeDelta = chrono::TimeDelta::days(1);

/// Which `user` label a subject gets: none (per-user labels off), its name as the logs show it
/// (the keyed pseudonym unless clear names are on: `crate::pseudonym`; the first `max` distinct
/// users seen since start), or [`OTHER_USER`].
pub struct UserLabels {
    max: Option<usize>,
    seen: Mutex<HashSet<String>>,
}

impl UserLabels {
    pub fn new(max: Option<u32>) -> UserLabels {
        UserLabels {
            max: max.map(|m| usize::try_from(m).unwrap_or(usize::MAX)),
            seen: Mutex::new(HashSet::new()),
        }
    }

    pub fn label(&self, subject: &str) -> Option<String> {
        let max = self.max?;
        let subject = &crate::pseudonym::user(subject);
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.contains(subject) {
            return Some(subject.to_string());
        }
        if seen.len() < max && subject != OTHER_USER {
            seen.insert(subject.to_string());
            return Some(subject.to_string());
        }
        Some(OTHER_USER.to_string())
    }
}

/// The usage capability as handlers and the rollup task see it.
#[derive(Clone)]
pub struct Usage {
    pub store: UsageStore,
    metrics: Arc<Metrics>,
    users: Arc<UserLabels>,
    settings: UsageSettings,
}

impl Usage {
    pub fn new(store: UsageStore, metrics: Arc<Metrics>, settings: UsageSettings) -> Usage {
        Usage {
            store,
            metrics,
            users: Arc::new(UserLabels::new(settings.metrics_max_users)),
            settings,
        }
    }

    /// Counts a report's result (`applied`, `duplicate`, `invalid`, `unavailable`, `error`).
    pub fn count_report(&self, result: &'static str) {
        self.metrics
            .usage
            .reports
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// Whether the last ledger write reached the database.
    fn database_up(&self, up: bool) {
        self.metrics.usage.database_up.set(i64::from(up));
    }

    /// Adds an applied batch to the chargeback counters (`charge`: what a record is charged to,
    /// as the ledger wrote it).
    pub fn count_records(
        &self,
        records: &[UsageRecord],
        charge: impl Fn(&UsageRecord) -> Chargeback,
    ) {
        let m = &self.metrics.usage;
        for r in records {
            let c = charge(r);
            let rate = |r: &str| r.parse::<f64>().unwrap_or(0.0);
            let cached = r.cached_input_tokens.min(r.prompt_tokens);
            #[allow(clippy::cast_precision_loss)] // a dashboard figure; the ledger is exact
            let spend = (r.prompt_tokens - cached) as f64 * rate(&c.rates.input)
                + cached as f64 * rate(&c.rates.cached_input)
                + r.completion_tokens as f64 * rate(&c.rates.output);
            if spend > 0.0 {
                let or_none = |s: &str| {
                    if s.is_empty() {
                        "none".to_string()
                    } else {
                        s.to_string()
                    }
                };
                m.cost
                    .get_or_create(&vec![
                        ("tier", r.tier.clone()),
                        ("model", r.model.clone()),
                        ("organization", or_none(&c.organization)),
                        ("cost_center", or_none(&c.cost_center)),
                    ])
                    .inc_by(spend);
            }
            let user = self.users.label(&r.subject);
            let labels = |extra: Option<(&'static str, String)>| -> UsageLabels {
                let mut l = vec![("tier", r.tier.clone()), ("model", r.model.clone())];
                l.extend(extra);
                if let Some(u) = &user {
                    l.push(("user", u.clone()));
                }
                l
            };
            if r.requests > 0 {
                m.requests.get_or_create(&labels(None)).inc_by(r.requests);
            }
            for (direction, n) in [
                ("prompt", r.prompt_tokens),
                ("completion", r.completion_tokens),
            ] {
                if n > 0 {
                    m.tokens
                        .get_or_create(&labels(Some(("direction", direction.to_string()))))
                        .inc_by(n);
                }
            }
            for (reason, n) in &r.refused {
                if *n > 0 {
                    m.refused
                        .get_or_create(&labels(Some(("reason", reason.clone()))))
                        .inc_by(*n);
                }
            }
        }
    }

    /// One rollup pass: hourly rows older than the retention (whole UTC days) become daily
    /// rows; batch ids older than a day are forgotten.
    pub async fn roll_up(&self) -> Result<RolledUp, StoreError> {
        let now = Utc::now();
        let cutoff = store::rollup_cutoff(now, self.settings.hourly_retention_days);
        let outcome = self.store.roll_up(cutoff, now - BATCH_ID_RETENTION).await;
        match &outcome {
            Ok(done) => {
                self.database_up(true);
                self.metrics.usage.rolled_up_rows.inc_by(done.hourly_rows);
                if done.hourly_rows > 0 {
                    tracing::info!(
                        hourly_rows = done.hourly_rows,
                        daily_rows = done.daily_rows,
                        %cutoff,
                        "usage rolled up into days"
                    );
                }
            }
            Err(e) => {
                if e.is_unavailable() {
                    self.database_up(false);
                }
                tracing::warn!(error = %e, "usage rollup failed; retried at the next interval");
            }
        }
        outcome
    }

    /// The rollup every interval (the first at once).
    pub fn spawn_rollup(&self) -> tokio::task::JoinHandle<()> {
        let usage = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(usage.settings.rollup_interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let _ = usage.roll_up().await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_user_label_unless_enabled_and_at_most_max_distinct_users() {
        assert_eq!(UserLabels::new(None).label("alice"), None);
        let users = UserLabels::new(Some(2));
        assert_eq!(users.label("alice").as_deref(), Some("alice"));
        assert_eq!(users.label("bob").as_deref(), Some("bob"));
        assert_eq!(users.label("carol").as_deref(), Some(OTHER_USER));
        // Users already labelled keep their label.
        assert_eq!(users.label("alice").as_deref(), Some("alice"));
        // A user named "other" never takes a place of its own.
        let users = UserLabels::new(Some(5));
        assert_eq!(users.label(OTHER_USER).as_deref(), Some(OTHER_USER));
        assert_eq!(users.seen.lock().unwrap().len(), 0);
    }
}

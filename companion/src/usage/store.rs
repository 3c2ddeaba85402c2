//! The one place with SQL on the usage ledger (migration 0003): a report batch applied in one
//! statement, the hourly → daily rollup in one statement, and the `GET /v1/usage` query.
//!
//! A record naming the backend that served (a model with several: migration 0008) is added to
//! the ledger's rows as any other, and to the same row split by backend in
//! `usage_backend_hourly` (rolled up into `usage_backend_daily` alike), which only
//! `groupBy=backend` reads.
//!
//! The ledger names an API key by the key API's id (`api_keys.id`, the UUID of
//! `GET /v1/api-keys/{id}`), so a user can find and revoke the key a row belongs to. The gateway
//! reports the key id of the key's secret (`sk-oai-<key id>_…`, the authenticate answer's
//! `key_id`): the batch's statement maps it (migration 0005 mapped the rows written before). A
//! key id no longer in `api_keys` (an ephemeral key deleted by the cleanup) stays as reported;
//! the query maps rows an older companion wrote during a rolling upgrade the same way.

use crate::db::MigrationState;
use chrono::{DateTime, NaiveDate, Utc};
use maas_types::usage::UsageRecord;
use sqlx::{PgPool, Postgres, QueryBuilder, Row};
use std::collections::{BTreeMap, HashMap};

pub use crate::db::StoreError;

/// One ledger row's dimensions (as reported: the statement maps the key).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RowKey {
    /// The reported key id (the one in the key's secret); `''` for a token caller.
    pub key_id: String,
    pub subject: String,
    pub tier: String,
    pub model: String,
    /// The backend that served (`''`: none named).
    pub backend: String,
    pub hour_start: u64,
    pub chargeback: Chargeback,
}

/// What a row is charged to (migration 0006): the attribution and rate of the subscription the
/// usage ran under, as the policy said when it was reported.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Chargeback {
    /// `tokenMetadata.organizationId`; `''` outside subscriptions or without one.
    pub organization: String,
    /// `tokenMetadata.costCenter`; `''` likewise.
    pub cost_center: String,
    /// The price of an uncached input token, of a cached one and of an output token (validated
    /// non-negative decimals; `"0"` without a price): the subscription model's
    /// `billingRate.perToken` for all three, else its `pricing`, else the model's `pricing`.
    pub rates: Rates,
}

/// Prices per token as exact decimal strings.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rates {
    pub input: String,
    pub cached_input: String,
    pub output: String,
}

impl Default for Rates {
    fn default() -> Self {
        Rates::flat("0")
    }
}

impl Rates {
    /// One price for every token.
    pub fn flat(rate: &str) -> Rates {
        Rates {
            input: rate.to_string(),
            cached_input: rate.to_string(),
            output: rate.to_string(),
        }
    }
}

/// One ledger row's counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    pub requests: u64,
    pub refused: BTreeMap<String, u64>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// The part of `prompt_tokens` served from the provider's prompt cache.
    pub cached_input_tokens: u64,
}

impl Counts {
    fn add(&mut self, r: &UsageRecord) {
        self.requests = self.requests.saturating_add(r.requests);
        for (reason, n) in &r.refused {
            let c = self.refused.entry(reason.clone()).or_default();
            *c = c.saturating_add(*n);
        }
        self.prompt_tokens = self.prompt_tokens.saturating_add(r.prompt_tokens);
        self.completion_tokens = self.completion_tokens.saturating_add(r.completion_tokens);
        self.cached_input_tokens = self
            .cached_input_tokens
            .saturating_add(r.cached_input_tokens);
    }
}

/// The records of a batch added up per ledger row, in key order: one statement may not update
/// a row twice, and a worker may send one row's usage in two records.
pub fn merge(
    records: &[UsageRecord],
    chargeback: impl Fn(&UsageRecord) -> Chargeback,
) -> Vec<(RowKey, Counts)> {
    let mut rows: BTreeMap<RowKey, Counts> = BTreeMap::new();
    for r in records {
        let key = RowKey {
            key_id: r.key_id.clone().unwrap_or_default(),
            subject: r.subject.clone(),
            tier: r.tier.clone(),
            model: r.model.clone(),
            backend: r.backend.clone().unwrap_or_default(),
            hour_start: r.hour_start,
            chargeback: chargeback(r),
        };
        rows.entry(key).or_default().add(r);
    }
    rows.into_iter().collect()
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// What the ledger answered to a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Added: this many ledger rows inserted or updated.
    Rows(u64),
    /// The batch id had been applied before: nothing added.
    Duplicate,
}

/// What one rollup pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RolledUp {
    /// Hourly rows deleted (all of them added to daily rows).
    pub hourly_rows: u64,
    /// Daily rows inserted or updated.
    pub daily_rows: u64,
    /// Applied batch ids forgotten (older than a day).
    pub batch_ids: u64,
    /// Hourly rows of the backend split moved into its daily rows.
    pub backend_hourly_rows: u64,
}

/// How `GET /v1/usage` groups rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBy {
    /// Per UTC day and model.
    Day,
    /// Per hour and model (rolled-up days at their 00:00).
    Hour,
    Model,
    /// Per API key (`''`: token callers).
    Key,
    /// Per user.
    User,
    /// Per subscription (`''`: usage on a tier).
    Subscription,
    /// Per organisation (`tokenMetadata.organizationId`; `''`: none).
    Organization,
    /// Per cost centre (`tokenMetadata.costCenter`; `''`: none).
    CostCenter,
    /// Per backend and model (a model with several backends; only usage that named one).
    Backend,
}

impl GroupBy {
    pub fn parse(s: &str) -> Option<GroupBy> {
        Some(match s {
            "day" => GroupBy::Day,
            "hour" => GroupBy::Hour,
            "model" => GroupBy::Model,
            "key" => GroupBy::Key,
            "user" => GroupBy::User,
            "subscription" => GroupBy::Subscription,
            "organization" => GroupBy::Organization,
            "costCenter" => GroupBy::CostCenter,
            "backend" => GroupBy::Backend,
            _ => return None,
        })
    }

    /// The grouping SQL expressions (text) over the ledger union `u`.
    fn columns(self) -> (&'static str, Option<&'static str>) {
        match self {
            GroupBy::Day => (
                "to_char(u.t AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
                Some("u.model"),
            ),
            GroupBy::Hour => (
                "to_char(u.t AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:00:00\"Z\"')",
                Some("u.model"),
            ),
            GroupBy::Model => ("u.model", None),
            GroupBy::Key => ("u.key_id", None),
            GroupBy::User => ("u.subject", None),
            // The ledger's tier of a subscription's usage is `subscription:<name>`
            // (`maas_types::subscription::limits_tier_name`).
            GroupBy::Subscription => (
                "CASE WHEN u.tier LIKE 'subscription:%' THEN substr(u.tier, 14) ELSE '' END",
                None,
            ),
            GroupBy::Organization => ("u.organization", None),
            GroupBy::CostCenter => ("u.cost_center", None),
            GroupBy::Backend => ("u.backend", Some("u.model")),
        }
    }

    /// The tables the grouping reads (hourly, daily) and their backend column: the backend
    /// split for [`GroupBy::Backend`], else the ledger's (every request, backend or not).
    fn tables(self) -> (&'static str, &'static str, &'static str) {
        match self {
            GroupBy::Backend => ("usage_backend_hourly", "usage_backend_daily", "backend"),
            _ => ("usage_hourly", "usage_daily", "''::text"),
        }
    }
}

/// A checked usage query: whose rows, which period, how grouped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageQuery {
    /// `None`: every user (admins only).
    pub subject: Option<String>,
    /// An API key caller sees its own key's rows only.
    pub key_id: Option<String>,
    pub tier: Option<String>,
    /// Rows whose hour (rolled-up rows: whose day) starts in `[from, to)`.
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub group_by: GroupBy,
}

/// One group of `GET /v1/usage`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageGroup {
    /// The day, hour, model, key id or user.
    pub group: String,
    /// The model, for day and hour groups.
    pub model: Option<String>,
    /// The key's name, for key groups (when the key still exists).
    pub key_name: Option<String>,
    pub counts: Counts,
    /// The rows' cost (an exact decimal, in the billing rates' unit).
    pub cost: String,
}

#[derive(Clone)]
pub struct UsageStore {
    pool: PgPool,
    migrations: MigrationState,
}

/// Adds a batch to the hourly ledger once (a known batch id adds nothing): one statement.
const APPLY_BATCH: &str = "WITH batch AS (
                 INSERT INTO usage_batches (replica, batch_id) VALUES ($1, $2)
                 ON CONFLICT DO NOTHING
                 RETURNING 1
             ), mapped AS (
                 -- The gateway reports a key by the key id in its secret; the ledger names it
                 -- by the key API's id. Mapped records of one row are added up (one statement
                 -- may not update a row twice).
                 SELECT COALESCE(a.id::text, u.k) AS k, u.s, u.t, u.m, u.b, u.hs, u.r, u.f,
                        u.p, u.c, u.ci, u.o, u.cc,
                        (u.p - LEAST(u.ci, u.p))::numeric * u.ir::numeric
                            + LEAST(u.ci, u.p)::numeric * u.cr::numeric
                            + u.c::numeric * u.orate::numeric AS cost
                 FROM UNNEST($3::text[], $4::text[], $5::text[], $6::text[], $7::int8[],
                             $8::int8[], $9::text[], $10::int8[], $11::int8[], $12::int8[],
                             $13::text[], $14::text[], $15::text[], $16::text[], $17::text[],
                             $18::text[])
                      AS u(k, s, t, m, hs, r, f, p, c, ci, o, cc, ir, cr, orate, b)
                 LEFT JOIN api_keys a ON u.k <> '' AND a.key_id = u.k
             ), by_backend AS (
                 -- Rows naming the backend that served, split by it (migration 0008).
                 INSERT INTO usage_backend_hourly AS h (key_id, subject, tier, model, backend,
                     hour_start, requests, refused, prompt_tokens, completion_tokens,
                     cached_input_tokens, organization, cost_center, cost)
                 SELECT k, s, t, m, b, to_timestamp(hs), SUM(r)::bigint,
                        maas_usage_sum_counts(f::jsonb), SUM(p)::bigint, SUM(c)::bigint,
                        SUM(ci)::bigint, max(o), max(cc), SUM(cost)
                 FROM mapped
                 WHERE b <> '' AND EXISTS (SELECT 1 FROM batch)
                 GROUP BY k, s, t, m, b, hs
                 ON CONFLICT (subject, key_id, tier, model, backend, hour_start) DO UPDATE SET
                     requests = h.requests + EXCLUDED.requests,
                     refused = maas_usage_add_counts(h.refused, EXCLUDED.refused),
                     prompt_tokens = h.prompt_tokens + EXCLUDED.prompt_tokens,
                     completion_tokens = h.completion_tokens + EXCLUDED.completion_tokens,
                     cached_input_tokens = h.cached_input_tokens + EXCLUDED.cached_input_tokens,
                     organization = CASE WHEN h.organization = '' THEN EXCLUDED.organization
                                         ELSE h.organization END,
                     cost_center = CASE WHEN h.cost_center = '' THEN EXCLUDED.cost_center
                                        ELSE h.cost_center END,
                     cost = h.cost + EXCLUDED.cost
                 RETURNING 1
             ), added AS (
                 INSERT INTO usage_hourly AS h (key_id, subject, tier, model, hour_start,
                     requests, refused, prompt_tokens, completion_tokens, cached_input_tokens,
                     organization, cost_center, cost)
                 SELECT k, s, t, m, to_timestamp(hs), SUM(r)::bigint,
                        maas_usage_sum_counts(f::jsonb), SUM(p)::bigint, SUM(c)::bigint,
                        SUM(ci)::bigint, max(o), max(cc), SUM(cost)
                 FROM mapped
                 WHERE EXISTS (SELECT 1 FROM batch)
                 GROUP BY k, s, t, m, hs
                 ON CONFLICT (subject, key_id, tier, model, hour_start) DO UPDATE SET
                     requests = h.requests + EXCLUDED.requests,
                     refused = maas_usage_add_counts(h.refused, EXCLUDED.refused),
                     prompt_tokens = h.prompt_tokens + EXCLUDED.prompt_tokens,
                     completion_tokens = h.completion_tokens + EXCLUDED.completion_tokens,
                     cached_input_tokens = h.cached_input_tokens + EXCLUDED.cached_input_tokens,
                     -- The hour keeps its first labels (a row an older release wrote gets
                     -- them now).
                     organization = CASE WHEN h.organization = '' THEN EXCLUDED.organization
                                         ELSE h.organization END,
                     cost_center = CASE WHEN h.cost_center = '' THEN EXCLUDED.cost_center
                                        ELSE h.cost_center END,
                     cost = h.cost + EXCLUDED.cost
                 RETURNING 1
             )
             SELECT (SELECT count(*) FROM batch) AS new_batch, (SELECT count(*) FROM added) AS rows";

impl UsageStore {
    pub fn new(pool: PgPool, migrations: MigrationState) -> UsageStore {
        UsageStore { pool, migrations }
    }

    fn ready(&self) -> Result<&PgPool, StoreError> {
        if self.migrations.is_done() {
            Ok(&self.pool)
        } else {
            Err(StoreError::NotReady)
        }
    }

    /// Records the batch id and adds the batch's rows, in one statement (so atomically): a
    /// batch id already recorded adds nothing.
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "usage.apply"))]
    pub async fn apply(
        &self,
        replica: &str,
        batch_id: &str,
        records: &[UsageRecord],
        chargeback: impl Fn(&UsageRecord) -> Chargeback,
    ) -> Result<Applied, StoreError> {
        let pool = self.ready()?;
        let rows = merge(records, chargeback);
        let mut key_ids = Vec::with_capacity(rows.len());
        let mut subjects = Vec::with_capacity(rows.len());
        let mut tiers = Vec::with_capacity(rows.len());
        let mut models = Vec::with_capacity(rows.len());
        let mut hours = Vec::with_capacity(rows.len());
        let mut requests = Vec::with_capacity(rows.len());
        let mut refused = Vec::with_capacity(rows.len());
        let mut prompt = Vec::with_capacity(rows.len());
        let mut completion = Vec::with_capacity(rows.len());
        let mut cached = Vec::with_capacity(rows.len());
        let mut organizations = Vec::with_capacity(rows.len());
        let mut cost_centers = Vec::with_capacity(rows.len());
        let mut input_rates = Vec::with_capacity(rows.len());
        let mut cached_rates = Vec::with_capacity(rows.len());
        let mut output_rates = Vec::with_capacity(rows.len());
        let mut backends = Vec::with_capacity(rows.len());
        for (k, c) in rows {
            backends.push(k.backend);
            organizations.push(k.chargeback.organization);
            cost_centers.push(k.chargeback.cost_center);
            input_rates.push(k.chargeback.rates.input);
            cached_rates.push(k.chargeback.rates.cached_input);
            output_rates.push(k.chargeback.rates.output);
            key_ids.push(k.key_id);
            subjects.push(k.subject);
            tiers.push(k.tier);
            models.push(k.model);
            hours.push(to_i64(k.hour_start));
            requests.push(to_i64(c.requests));
            refused.push(serde_json::to_string(&c.refused).unwrap_or_else(|_| "{}".into()));
            prompt.push(to_i64(c.prompt_tokens));
            completion.push(to_i64(c.completion_tokens));
            cached.push(to_i64(c.cached_input_tokens));
        }
        let row = sqlx::query(APPLY_BATCH)
            .bind(replica)
            .bind(batch_id)
            .bind(key_ids)
            .bind(subjects)
            .bind(tiers)
            .bind(models)
            .bind(hours)
            .bind(requests)
            .bind(refused)
            .bind(prompt)
            .bind(completion)
            .bind(cached)
            .bind(organizations)
            .bind(cost_centers)
            .bind(input_rates)
            .bind(cached_rates)
            .bind(output_rates)
            .bind(backends)
            .fetch_one(pool)
            .await?;
        let new_batch: i64 = row.try_get("new_batch")?;
        let rows: i64 = row.try_get("rows")?;
        Ok(if new_batch == 0 {
            Applied::Duplicate
        } else {
            Applied::Rows(to_u64(rows))
        })
    }

    /// Moves hourly rows older than `cutoff` (a UTC midnight) into daily rows, in one statement,
    /// and forgets batch ids applied before `batches_before`.
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "usage.roll_up"))]
    pub async fn roll_up(
        &self,
        cutoff: DateTime<Utc>,
        batches_before: DateTime<Utc>,
    ) -> Result<RolledUp, StoreError> {
        let pool = self.ready()?;
        let row = sqlx::query(
            "WITH moved AS (
                 DELETE FROM usage_hourly WHERE hour_start < $1 RETURNING *
             ), added AS (
                 INSERT INTO usage_daily AS d (key_id, subject, tier, model, day, requests,
                     refused, prompt_tokens, completion_tokens, cached_input_tokens,
                     organization, cost_center, cost)
                 SELECT key_id, subject, tier, model, (hour_start AT TIME ZONE 'UTC')::date,
                        SUM(requests)::bigint, maas_usage_sum_counts(refused),
                        SUM(prompt_tokens)::bigint, SUM(completion_tokens)::bigint,
                        SUM(cached_input_tokens)::bigint, max(organization), max(cost_center),
                        SUM(cost)
                 FROM moved
                 GROUP BY key_id, subject, tier, model, (hour_start AT TIME ZONE 'UTC')::date
                 ON CONFLICT (subject, key_id, tier, model, day) DO UPDATE SET
                     requests = d.requests + EXCLUDED.requests,
                     refused = maas_usage_add_counts(d.refused, EXCLUDED.refused),
                     prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
                     completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
                     cached_input_tokens = d.cached_input_tokens + EXCLUDED.cached_input_tokens,
                     organization = CASE WHEN d.organization = '' THEN EXCLUDED.organization
                                         ELSE d.organization END,
                     cost_center = CASE WHEN d.cost_center = '' THEN EXCLUDED.cost_center
                                        ELSE d.cost_center END,
                     cost = d.cost + EXCLUDED.cost
                 RETURNING 1
             ), moved_by_backend AS (
                 DELETE FROM usage_backend_hourly WHERE hour_start < $1 RETURNING *
             ), added_by_backend AS (
                 INSERT INTO usage_backend_daily AS d (key_id, subject, tier, model, backend,
                     day, requests, refused, prompt_tokens, completion_tokens,
                     cached_input_tokens, organization, cost_center, cost)
                 SELECT key_id, subject, tier, model, backend,
                        (hour_start AT TIME ZONE 'UTC')::date, SUM(requests)::bigint,
                        maas_usage_sum_counts(refused), SUM(prompt_tokens)::bigint,
                        SUM(completion_tokens)::bigint, SUM(cached_input_tokens)::bigint,
                        max(organization), max(cost_center), SUM(cost)
                 FROM moved_by_backend
                 GROUP BY key_id, subject, tier, model, backend,
                          (hour_start AT TIME ZONE 'UTC')::date
                 ON CONFLICT (subject, key_id, tier, model, backend, day) DO UPDATE SET
                     requests = d.requests + EXCLUDED.requests,
                     refused = maas_usage_add_counts(d.refused, EXCLUDED.refused),
                     prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
                     completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
                     cached_input_tokens = d.cached_input_tokens + EXCLUDED.cached_input_tokens,
                     organization = CASE WHEN d.organization = '' THEN EXCLUDED.organization
                                         ELSE d.organization END,
                     cost_center = CASE WHEN d.cost_center = '' THEN EXCLUDED.cost_center
                                        ELSE d.cost_center END,
                     cost = d.cost + EXCLUDED.cost
                 RETURNING 1
             ), forgotten AS (
                 DELETE FROM usage_batches WHERE applied_at < $2 RETURNING 1
             )
             SELECT (SELECT count(*) FROM moved) AS hourly, (SELECT count(*) FROM added) AS daily,
                    (SELECT count(*) FROM forgotten) AS batches,
                    (SELECT count(*) FROM moved_by_backend) AS backend_hourly",
        )
        .bind(cutoff)
        .bind(batches_before)
        .fetch_one(pool)
        .await?;
        Ok(RolledUp {
            hourly_rows: to_u64(row.try_get("hourly")?),
            daily_rows: to_u64(row.try_get("daily")?),
            batch_ids: to_u64(row.try_get("batches")?),
            backend_hourly_rows: to_u64(row.try_get("backend_hourly")?),
        })
    }

    /// The groups of a usage query, ordered by group (then model).
    #[tracing::instrument(name = "db.query", skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "usage.query"))]
    pub async fn query(&self, q: &UsageQuery) -> Result<Vec<UsageGroup>, StoreError> {
        let pool = self.ready()?;
        let (first, second) = q.group_by.columns();
        let (hourly, daily, backend) = q.group_by.tables();
        let mut b: QueryBuilder<Postgres> = QueryBuilder::new("SELECT ");
        b.push(first).push(" AS g1, ");
        b.push(second.unwrap_or("NULL::text")).push(" AS g2, ");
        b.push(
            "SUM(u.requests)::bigint AS requests, maas_usage_sum_counts(u.refused)::text AS refused, \
             SUM(u.prompt_tokens)::bigint AS prompt_tokens, \
             SUM(u.completion_tokens)::bigint AS completion_tokens, \
             SUM(u.cached_input_tokens)::bigint AS cached_input_tokens, \
             SUM(u.cost)::text AS cost \
             FROM (SELECT COALESCE(a.id::text, l.key_id) AS key_id, l.subject, l.tier, l.model, \
                          l.backend, l.t, l.requests, l.refused, l.prompt_tokens, \
                          l.completion_tokens, l.cached_input_tokens, l.organization, \
                          l.cost_center, l.cost \
                   FROM (SELECT key_id, subject, tier, model, ",
        );
        // The table names are constants of the grouping (never input).
        b.push(backend).push(
            " AS backend, hour_start AS t, requests, refused, \
                                prompt_tokens, completion_tokens, cached_input_tokens, \
                                organization, cost_center, cost \
                         FROM ",
        );
        b.push(hourly).push(
            " UNION ALL \
                         SELECT key_id, subject, tier, model, ",
        );
        b.push(backend).push(
            " AS backend, (day::timestamp AT TIME ZONE 'UTC') AS t, requests, refused, \
                                prompt_tokens, completion_tokens, cached_input_tokens, \
                                organization, cost_center, cost \
                         FROM ",
        );
        b.push(daily).push(
            ") AS l \
                   LEFT JOIN api_keys a ON l.key_id <> '' AND a.key_id = l.key_id) AS u \
             WHERE u.t >= ",
        );
        b.push_bind(q.from).push(" AND u.t < ").push_bind(q.to);
        if let Some(subject) = &q.subject {
            b.push(" AND u.subject = ").push_bind(subject.clone());
        }
        if let Some(key_id) = &q.key_id {
            b.push(" AND u.key_id = ").push_bind(key_id.clone());
        }
        if let Some(tier) = &q.tier {
            b.push(" AND u.tier = ").push_bind(tier.clone());
        }
        b.push(" GROUP BY g1, g2 ORDER BY g1, g2");
        let rows = b.build().fetch_all(pool).await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let refused: Option<String> = row.try_get("refused")?;
            out.push(UsageGroup {
                group: row.try_get::<Option<String>, _>("g1")?.unwrap_or_default(),
                model: row.try_get("g2")?,
                key_name: None,
                counts: Counts {
                    requests: to_u64(row.try_get("requests")?),
                    refused: refused
                        .and_then(|r| serde_json::from_str(&r).ok())
                        .unwrap_or_default(),
                    prompt_tokens: to_u64(row.try_get("prompt_tokens")?),
                    completion_tokens: to_u64(row.try_get("completion_tokens")?),
                    cached_input_tokens: to_u64(row.try_get("cached_input_tokens")?),
                },
                cost: normalize_decimal(
                    &row.try_get::<Option<String>, _>("cost")?
                        .unwrap_or_else(|| "0".into()),
                ),
            });
        }
        if q.group_by == GroupBy::Key {
            let ids: Vec<uuid::Uuid> = out
                .iter()
                .filter_map(|g| uuid::Uuid::parse_str(&g.group).ok())
                .collect();
            let names = self.key_names(pool, ids).await?;
            for g in &mut out {
                g.key_name = names.get(&g.group).cloned();
            }
        }
        Ok(out)
    }

    /// The names of the keys still in `api_keys`, by the key API's id.
    async fn key_names(
        &self,
        pool: &PgPool,
        ids: Vec<uuid::Uuid>,
    ) -> Result<HashMap<String, String>, StoreError> {
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        let rows = sqlx::query("SELECT id, name FROM api_keys WHERE id = ANY($1)")
            .bind(ids)
            .fetch_all(pool)
            .await?;
        let mut names = HashMap::new();
        for row in rows {
            let id: uuid::Uuid = row.try_get("id")?;
            names.insert(id.to_string(), row.try_get("name")?);
        }
        Ok(names)
    }
}

/// A NUMERIC's text without trailing fractional zeros (`0.000400000` → `0.0004`, `3.000` → `3`).
pub fn normalize_decimal(s: &str) -> String {
    match s.split_once('.') {
        Some((int, frac)) => {
            let frac = frac.trim_end_matches('0');
            if frac.is_empty() {
                int.to_string()
            } else {
                format!("{int}.{frac}")
            }
        }
        None => s.to_string(),
    }
}

/// The oldest hour kept hourly at `now`: UTC midnight `retention_days` days before today's
/// (so a day is rolled up whole, never half).
pub fn rollup_cutoff(now: DateTime<Utc>, retention_days: u32) -> DateTime<Utc> {
    let today = now.date_naive();
    let day = today
        .checked_sub_days(chrono::Days::new(u64::from(retention_days)))
        .unwrap_or(NaiveDate::MIN);
    day.and_hms_opt(0, 0, 0).unwrap_or_default().and_utc()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: Option<&str>, hour: u64, requests: u64, reason: Option<&str>) -> UsageRecord {
        UsageRecord {
            subject: "alice".into(),
            key_id: key.map(Into::into),
            tier: "free".into(),
            model: "m".into(),
            hour_start: hour,
            requests,
            refused: reason
                .map(|r| BTreeMap::from([(r.to_string(), 1)]))
                .unwrap_or_default(),
            prompt_tokens: requests * 10,
            completion_tokens: requests * 20,
            cached_input_tokens: requests * 3,
            backend: None,
        }
    }

    #[test]
    fn records_of_one_row_are_added_before_the_statement() {
        let rows = merge(
            &[
                record(Some("k1"), 3600, 1, Some("rate_limit_exceeded")),
                record(None, 3600, 5, None),
                record(Some("k1"), 3600, 2, Some("rate_limit_exceeded")),
                record(Some("k1"), 7200, 4, None),
            ],
            |_| Chargeback::default(),
        );
        assert_eq!(rows.len(), 3, "{rows:?}");
        let (key, counts) = &rows[0];
        assert_eq!((key.key_id.as_str(), key.hour_start), ("", 3600));
        assert_eq!(counts.requests, 5);
        let (key, counts) = &rows[1];
        assert_eq!((key.key_id.as_str(), key.hour_start), ("k1", 3600));
        assert_eq!(counts.requests, 3);
        assert_eq!(counts.prompt_tokens, 30);
        assert_eq!(counts.cached_input_tokens, 9);
        assert_eq!(counts.refused.get("rate_limit_exceeded"), Some(&2));
    }

    #[test]
    fn records_of_each_backend_are_rows_of_their_own() {
        let served = |backend: Option<&str>, requests| UsageRecord {
            backend: backend.map(Into::into),
            ..record(None, 3600, requests, None)
        };
        let rows = merge(
            &[
                served(Some("a"), 1),
                served(Some("b"), 2),
                served(None, 4),
                served(Some("a"), 8),
            ],
            |_| Chargeback::default(),
        );
        let by: Vec<(&str, u64)> = rows
            .iter()
            .map(|(k, c)| (k.backend.as_str(), c.requests))
            .collect();
        assert_eq!(by, [("", 4), ("a", 9), ("b", 2)]);
    }

    #[test]
    fn numeric_text_loses_only_trailing_fractional_zeros() {
        assert_eq!(normalize_decimal("0.000400000"), "0.0004");
        assert_eq!(normalize_decimal("3.000"), "3");
        assert_eq!(normalize_decimal("120"), "120");
        assert_eq!(normalize_decimal("0"), "0");
        assert_eq!(normalize_decimal("10.50"), "10.5");
    }

    #[test]
    fn the_rollup_cutoff_is_a_midnight_retention_days_back() {
        let now = DateTime::parse_from_rfc3339("2026-12-31T17:45:00Z")
            .unwrap()
            .to_utc();
        assert_eq!(
            rollup_cutoff(now, 31).to_rfc3339(),
            "2026-11-30T00:00:00+00:00"
        );
        assert_eq!(
            rollup_cutoff(now, 1).to_rfc3339(),
            "2026-12-30T00:00:00+00:00"
        );
    }
}

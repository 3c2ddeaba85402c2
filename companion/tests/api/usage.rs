//! The usage ledger end to end: `POST /internal/v1/usage` (reports), `GET /v1/usage`,
//! `GET /v1/quota` (over the lease store, in memory and in a real redis-server), the hourly →
//! daily rollup and the chargeback metrics. The companion in-process (port 0) over a fresh
//! PostgreSQL database per test (`MAAS_TEST_DATABASE_URL`, as the other companion tests).

use crate::helpers::{self, Reply, TestApp, spawn_app, spawn_app_with};
use maas_companion::settings::RedisSettings;
use maas_types::lease::LEASES_PATH;
use maas_types::usage::USAGE_PATH;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const HOUR: i64 = 3600;
const DAY: i64 = 86_400;

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

fn this_hour() -> i64 {
    now() - now() % HOUR
}

fn record(subject: &str, key: Option<&str>, tier: &str, model: &str, hour: i64) -> Value {
    let mut r = json!({
        "subject": subject, "tier": tier, "model": model, "hourStart": hour,
        "requests": 2, "promptTokens": 10, "completionTokens": 20,
    });
    if let Some(k) = key {
        r["keyId"] = json!(k);
    }
    r
}

async fn report(app: &TestApp, batch: &str, records: Value) -> Reply {
    app.internal_post(
        USAGE_PATH,
        &json!({"replica": "gw-1", "batchId": batch, "records": records}),
    )
    .await
}

/// `(requests, prompt, completion)` summed over the hourly ledger.
async fn hourly_sums(app: &TestApp) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT COALESCE(SUM(requests),0)::bigint, COALESCE(SUM(prompt_tokens),0)::bigint, \
         COALESCE(SUM(completion_tokens),0)::bigint FROM usage_hourly",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// A minted key: the plaintext, the key id the gateway reports it under (its secret's), and the
/// key API's id (what the ledger names it by).
struct Minted {
    key: String,
    reported: String,
    id: String,
}

/// Mints a key for `token`.
async fn key_of(app: &TestApp, token: &str, name: &str) -> Minted {
    let minted = app.mint_named(token, name).await;
    let key = minted["key"].as_str().unwrap().to_string();
    let auth = app.authenticate(&key).await;
    assert_eq!(auth.status, 200, "{}", auth.body);
    let reported = auth.body["key_id"].as_str().unwrap().to_string();
    let id = minted["id"].as_str().unwrap().to_string();
    assert_ne!(reported, id);
    Minted { key, reported, id }
}

#[tokio::test]
async fn a_report_is_added_to_the_ledger_and_a_resent_batch_id_is_not_counted_twice() {
    let app = spawn_app().await;
    let h = this_hour();
    let mut refused = record("alice", None, "free", "sim-model", h);
    refused["requests"] = json!(0);
    refused["promptTokens"] = json!(0);
    refused["completionTokens"] = json!(0);
    refused["refused"] = json!({"rate_limit_exceeded": 3, "tokens_exceed_limit": 1});
    let records = json!([
        record("alice", None, "free", "sim-model", h),
        // The same row twice in one batch: added up, not a failed statement.
        record("alice", None, "free", "sim-model", h),
        record("alice", Some("k1"), "free", "sim-model", h),
        refused,
    ]);
    let r = report(&app, "b1", records.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body, json!({"accepted": 4, "duplicate": false}));
    assert_eq!(hourly_sums(&app).await, (6, 30, 60));

    // The answer was lost and the gateway resends: nothing more is counted.
    let again = report(&app, "b1", records.clone()).await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body, json!({"accepted": 0, "duplicate": true}));
    assert_eq!(hourly_sums(&app).await, (6, 30, 60));

    // A new batch adds to the same rows.
    let next = report(&app, "b2", records).await;
    assert_eq!(next.body["accepted"], 4);
    assert_eq!(hourly_sums(&app).await, (12, 60, 120));
    let rows: Vec<(String, i64, String)> =
        sqlx::query_as("SELECT key_id, requests, refused::text FROM usage_hourly ORDER BY key_id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!((rows[0].0.as_str(), rows[0].1), ("", 8));
    let refused: Value = serde_json::from_str(&rows[0].2).unwrap();
    assert_eq!(
        refused,
        json!({"rate_limit_exceeded": 6, "tokens_exceed_limit": 2})
    );
    assert_eq!((rows[1].0.as_str(), rows[1].1), ("k1", 4));
}

#[tokio::test]
async fn cached_input_tokens_are_optional_added_up_and_shown_in_usage() {
    let app = spawn_app().await;
    let h = this_hour();
    // An older filter's record has no cachedInputTokens: it counts none.
    let old = record("alice", None, "free", "sim-model", h);
    let mut cached = record("alice", None, "free", "sim-model", h);
    cached["cachedInputTokens"] = json!(6);
    let r = report(&app, "c1", json!([old, cached.clone()])).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = report(&app, "c2", json!([cached])).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let sum: i64 = sqlx::query_scalar("SELECT SUM(cached_input_tokens)::bigint FROM usage_hourly")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(sum, 12);
    let u = app
        .public_get(
            &format!("/v1/usage?groupBy=model&{}", period()),
            Some("alice-token"),
        )
        .await;
    assert_eq!(u.status, 200, "{}", u.body);
    assert_eq!(u.body["data"][0]["promptTokens"], 30, "{}", u.body);
    assert_eq!(u.body["data"][0]["cachedInputTokens"], 12, "{}", u.body);
}

#[tokio::test]
async fn a_bad_report_is_a_400_naming_the_field_and_applies_nothing() {
    let app = spawn_app().await;
    let h = this_hour();
    let cases = [
        (
            json!({"replica": "gw-1", "batchId": "b", "records": [record("alice", None, "free", "m", h + 1)]}),
            "records[0].hourStart",
        ),
        (
            json!({"replica": "gw-1", "batchId": "b", "records": [record("alice", None, "free", "m", h), record("", None, "free", "m", h)]}),
            "records[1].subject",
        ),
        (
            json!({"replica": "gw-1", "batchId": "b", "records": [record("alice", None, "free", "m", h + 3 * HOUR)]}),
            "records[0].hourStart",
        ),
        (
            json!({"replica": "", "batchId": "b", "records": []}),
            "replica",
        ),
        (
            json!({"replica": "gw-1", "batchId": "b", "records": vec![record("a", None, "free", "m", h); 1025]}),
            "records",
        ),
    ];
    for (body, field) in cases {
        let r = app.internal_post(USAGE_PATH, &body).await;
        assert_eq!(r.status, 400, "{field}: {}", r.body);
        assert_eq!(r.body["error"]["param"], field, "{}", r.body);
        assert_eq!(r.code(), "invalid_usage_report");
    }
    // Cached input tokens are part of the prompt tokens: never more.
    let mut too_cached = record("alice", None, "free", "m", h);
    too_cached["cachedInputTokens"] = json!(11);
    let r = report(&app, "b", json!([too_cached])).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        r.body["error"]["param"], "records[0].cachedInputTokens",
        "{}",
        r.body
    );
    let mut bad_reason = record("alice", None, "free", "m", h);
    bad_reason["refused"] = json!({"Not A Code": 1});
    let r = report(&app, "b", json!([bad_reason])).await;
    assert_eq!(r.body["error"]["param"], "records[0].refused", "{}", r.body);
    // Unknown fields and malformed JSON are refused too.
    let r = report(
        &app,
        "b",
        json!([{"subject": "a", "tier": "t", "model": "m", "hourStart": h, "cost": 1}]),
    )
    .await;
    assert_eq!((r.status, r.code()), (400, "invalid_json"), "{}", r.body);
    assert_eq!(hourly_sums(&app).await, (0, 0, 0));
    // Nothing was applied, so the batch id is still free.
    let ok = report(&app, "b", json!([record("alice", None, "free", "m", h)])).await;
    assert_eq!(ok.body, json!({"accepted": 1, "duplicate": false}));
    // Internal only: the public listener does not serve it.
    let public = app
        .public_post(
            USAGE_PATH,
            None,
            &json!({"replica": "x", "batchId": "y", "records": []}),
        )
        .await;
    assert_eq!(public.status, 404);
}

#[tokio::test]
async fn a_report_is_a_503_while_the_database_cannot_take_it() {
    let app = spawn_app_with(|s| {
        s.database.url = "postgres://postgres@127.0.0.1:1/nowhere".to_string().into();
    })
    .await;
    let r = report(
        &app,
        "b1",
        json!([record("alice", None, "free", "m", this_hour())]),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "service_unavailable");
    assert_eq!(
        app.metric("maas_companion_usage_reports_total{result=\"unavailable\"}")
            .await,
        1.0
    );
}

/// Alice: token usage and two keys, over two days and two models; bob (premium): one row.
/// Answers alice's first key, and both keys' ids in the ledger (the key API's).
async fn ledger_for_queries(app: &TestApp) -> (String, String, String) {
    let first = key_of(app, "alice-token", "first").await;
    let second = key_of(app, "alice-token", "second").await;
    let (alice_key, k1, k2) = (first.key, first.reported, second.reported);
    let today = now() - now() % DAY;
    let yesterday = today - DAY;
    let mut big = record(
        "alice",
        Some(&k1),
        "free",
        "sim-model",
        yesterday + 5 * HOUR,
    );
    big["promptTokens"] = json!(100);
    big["cachedInputTokens"] = json!(64);
    let records = json!([
        record("alice", None, "free", "sim-model", today),
        record("alice", None, "free", "sim-model", today + HOUR),
        record("alice", Some(&k1), "free", "sim-model", today),
        big,
        record("alice", Some(&k2), "free", "sim-premium", today),
        record("bob", None, "premium", "sim-premium", today),
    ]);
    let r = report(app, "q1", records).await;
    assert_eq!(r.status, 200, "{}", r.body);
    (alice_key, first.id, second.id)
}

/// From the day before yesterday to the end of today (the ledger's rows may lie an hour ahead).
fn period() -> String {
    let today = now() - now() % DAY;
    format!("from={}&to={}", day_of(today - 2 * DAY), day_of(today))
}

fn day_of(unix: i64) -> String {
    chrono::DateTime::from_timestamp(unix, 0)
        .unwrap()
        .format("%Y-%m-%d")
        .to_string()
}

#[tokio::test]
async fn usage_is_grouped_by_day_hour_model_key_and_user() {
    let app = spawn_app().await;
    let (_, k1, k2) = ledger_for_queries(&app).await;
    let today = now() - now() % DAY;
    let get = |q: &'static str| {
        let app = &app;
        async move {
            let r = app
                .public_get(&format!("/v1/usage?{q}&{}", period()), Some("alice-token"))
                .await;
            assert_eq!(r.status, 200, "{q}: {}", r.body);
            r.body
        }
    };

    // The web UI's shape: per day and model.
    let by_day = get("groupBy=day").await;
    assert_eq!(by_day["groupBy"], "day");
    assert_eq!(
        by_day["data"],
        json!([
            {"day": day_of(today - DAY), "model": "sim-model", "requests": 2, "refused": {},
             "promptTokens": 100, "completionTokens": 20, "totalTokens": 120, "cachedInputTokens": 64, "cost": "0"},
            {"day": day_of(today), "model": "sim-model", "requests": 6, "refused": {},
             "promptTokens": 30, "completionTokens": 60, "totalTokens": 90, "cachedInputTokens": 0, "cost": "0"},
            {"day": day_of(today), "model": "sim-premium", "requests": 2, "refused": {},
             "promptTokens": 10, "completionTokens": 20, "totalTokens": 30, "cachedInputTokens": 0, "cost": "0"},
        ]),
        "{by_day}"
    );
    // Dates as the UI sends them: `to` includes its day.
    let q = format!(
        "/v1/usage?from={}&to={}&groupBy=day",
        day_of(today),
        day_of(today)
    );
    let r = app.public_get(&q, Some("alice-token")).await;
    assert_eq!(r.body["data"].as_array().unwrap().len(), 2, "{}", r.body);

    let by_hour = get("groupBy=hour").await;
    let hours: Vec<(String, String, u64)> = by_hour["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["hour"].as_str().unwrap().to_string(),
                r["model"].as_str().unwrap().to_string(),
                r["requests"].as_u64().unwrap(),
            )
        })
        .collect();
    let hour = |t: i64| {
        chrono::DateTime::from_timestamp(t, 0)
            .unwrap()
            .format("%Y-%m-%dT%H:00:00Z")
            .to_string()
    };
    assert_eq!(
        hours,
        vec![
            (hour(today - DAY + 5 * HOUR), "sim-model".into(), 2),
            (hour(today), "sim-model".into(), 4),
            (hour(today), "sim-premium".into(), 2),
            (hour(today + HOUR), "sim-model".into(), 2),
        ]
    );

    let by_model = get("groupBy=model").await;
    assert_eq!(by_model["data"][0]["model"], "sim-model");
    assert_eq!(by_model["data"][0]["requests"], 8);
    assert_eq!(by_model["data"][1]["model"], "sim-premium");
    assert_eq!(by_model["data"].as_array().unwrap().len(), 2);

    let by_key = get("groupBy=key").await;
    let keys: Vec<(Value, Value, u64)> = by_key["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["keyId"].clone(),
                r["keyName"].clone(),
                r["requests"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut expected = vec![
        (json!(k1), json!("first"), 4),
        (json!(k2), json!("second"), 2),
    ];
    expected.sort_by_key(|e| e.0.as_str().unwrap().to_string());
    expected.insert(0, (Value::Null, Value::Null, 4));
    assert_eq!(keys, expected, "{by_key}");

    let by_user = get("groupBy=user").await;
    assert_eq!(
        by_user["data"],
        json!([{"user": "alice", "requests": 10, "refused": {}, "promptTokens": 140,
                "completionTokens": 100, "totalTokens": 240, "cachedInputTokens": 64, "cost": "0"}])
    );

    // A period with nothing in it.
    let empty = app
        .public_get(
            "/v1/usage?from=2020-01-01&to=2020-01-02",
            Some("alice-token"),
        )
        .await;
    assert_eq!(empty.body["data"], json!([]), "{}", empty.body);
}

/// The gateway reports a key by its secret's key id; the ledger row carries the key API's id,
/// which the key API finds and revokes (`GET`/`DELETE /v1/api-keys/{id}`).
#[tokio::test]
async fn a_ledger_row_names_its_key_by_the_key_api_id_which_finds_and_revokes_it() {
    let app = spawn_app().await;
    let k = key_of(&app, "alice-token", "billed").await;
    let h = this_hour();
    let r = report(
        &app,
        "ids-1",
        json!([record("alice", Some(&k.reported), "free", "sim-model", h)]),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The row in PostgreSQL carries the key API's id.
    let stored: Vec<String> = sqlx::query_scalar("SELECT key_id FROM usage_hourly")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored, vec![k.id.clone()]);
    let by_key = app
        .public_get(
            &format!("/v1/usage?groupBy=key&{}", period()),
            Some("alice-token"),
        )
        .await;
    assert_eq!(by_key.status, 200, "{}", by_key.body);
    let row = &by_key.body["data"][0];
    assert_eq!(row["keyId"], json!(k.id), "{}", by_key.body);
    assert_eq!(row["keyName"], "billed", "{}", by_key.body);
    // The id the row names is the key API's: found, then revoked.
    let id = row["keyId"].as_str().unwrap();
    let found = app
        .public_get(&format!("/v1/api-keys/{id}"), Some("alice-token"))
        .await;
    assert_eq!(found.status, 200, "{}", found.body);
    assert_eq!(found.body["name"], "billed");
    let revoked = app
        .public_delete(&format!("/v1/api-keys/{id}"), Some("alice-token"))
        .await;
    assert_eq!(revoked.status, 200, "{}", revoked.body);
    assert_eq!(app.authenticate(&k.key).await.status, 401);
    // Two records of one row, one reported by the secret's key id and one already by the key
    // API's id (a resend across an upgrade), make one row: nothing is refused or lost.
    let r = report(
        &app,
        "ids-2",
        json!([
            record("alice", Some(&k.reported), "free", "sim-model", h),
            record("alice", Some(&k.id), "free", "sim-model", h)
        ]),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT key_id, requests FROM usage_hourly")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, [(k.id.clone(), 6)]);
}

/// Ledger rows written before migration 0005 named keys by the secret's key id: the migration
/// maps them to the key API's id (a key id whose key is gone stays as it was).
#[tokio::test]
async fn rows_written_before_are_migrated_to_the_key_api_id() {
    let database_url = helpers::create_database().await;
    let pool = sqlx::PgPool::connect(&database_url).await.unwrap();
    // The companion's migrations (the same directory it embeds) up to 0004.
    let all = sqlx::migrate!("./migrations");
    let before = sqlx::migrate::Migrator {
        migrations: std::borrow::Cow::Owned(
            all.migrations
                .iter()
                .filter(|m| m.version <= 4)
                .cloned()
                .collect(),
        ),
        ..sqlx::migrate::Migrator::DEFAULT
    };
    before.run(&pool).await.unwrap();
    let id = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO api_keys (id, key_id, key_hash, username, name, user_groups, expires_at) \
         VALUES ($1, 'OldKeyId0123456', 'hash', 'alice', 'old-key', '{}', now() + interval '1 day')",
    )
    .bind(id)
    .execute(&pool)
    .await
    .unwrap();
    let today = now() - now() % DAY;
    for key in ["OldKeyId0123456", "GoneKeyId012345", ""] {
        sqlx::query(
            "INSERT INTO usage_hourly (key_id, subject, tier, model, hour_start, requests) \
             VALUES ($1, 'alice', 'free', 'sim-model', to_timestamp($2), 3)",
        )
        .bind(key)
        .bind(today)
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO usage_daily (key_id, subject, tier, model, day, requests) \
             VALUES ($1, 'alice', 'free', 'sim-model', (to_timestamp($2) AT TIME ZONE 'UTC')::date - 40, 5)",
        )
        .bind(key)
        .bind(today)
        .execute(&pool)
        .await
        .unwrap();
    }
    let app = helpers::spawn_app_on(database_url, |_| {}).await;
    for table in ["usage_hourly", "usage_daily"] {
        let mut keys: Vec<String> =
            sqlx::query_scalar(&format!("SELECT key_id FROM {table} ORDER BY key_id"))
                .fetch_all(&pool)
                .await
                .unwrap();
        keys.sort();
        let mut want = vec![String::new(), "GoneKeyId012345".into(), id.to_string()];
        want.sort();
        assert_eq!(keys, want, "{table}");
    }
    let by_key = app
        .public_get(
            &format!(
                "/v1/usage?groupBy=key&from={}&to={}",
                day_of(today - 45 * DAY),
                day_of(today)
            ),
            Some("alice-token"),
        )
        .await;
    assert_eq!(by_key.status, 200, "{}", by_key.body);
    let old = by_key.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["keyId"] == json!(id.to_string()))
        .cloned()
        .unwrap_or_else(|| panic!("no row for the key API's id: {}", by_key.body));
    assert_eq!(old["keyName"], "old-key");
    assert_eq!(old["requests"], 8, "the hourly and the daily row");
}

#[tokio::test]
async fn callers_see_their_own_usage_a_key_its_own_and_admins_anyone() {
    let app = spawn_app().await;
    let (alice_key, k1, _) = ledger_for_queries(&app).await;
    let total = |body: &Value| -> u64 {
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["requests"].as_u64().unwrap())
            .sum()
    };
    let p = period();
    let alice = app
        .public_get(&format!("/v1/usage?groupBy=model&{p}"), Some("alice-token"))
        .await;
    assert_eq!(total(&alice.body), 10, "token: all of alice's usage");
    let key = app
        .public_get(&format!("/v1/usage?groupBy=key&{p}"), Some(&alice_key))
        .await;
    assert_eq!(key.status, 200, "{}", key.body);
    assert_eq!(
        key.body["data"].as_array().unwrap().len(),
        1,
        "{}",
        key.body
    );
    assert_eq!(key.body["data"][0]["keyId"], json!(k1));
    assert_eq!(
        total(&key.body),
        4,
        "an API key sees its own key's usage only"
    );
    let bob = app
        .public_get(&format!("/v1/usage?{p}"), Some("bob-token"))
        .await;
    assert_eq!(total(&bob.body), 2);

    // Someone else's usage: admins only.
    for (q, param) in [
        ("user=bob", "user"),
        ("user=*", "user"),
        ("tier=premium", "tier"),
    ] {
        for credential in ["alice-token", alice_key.as_str()] {
            let r = app
                .public_get(&format!("/v1/usage?{q}"), Some(credential))
                .await;
            assert_eq!(r.status, 403, "{q}: {}", r.body);
            assert_eq!(r.body["error"]["type"], "permission_error");
            assert_eq!(r.body["error"]["param"], param);
        }
    }
    let own = app
        .public_get(&format!("/v1/usage?user=alice&{p}"), Some("alice-token"))
        .await;
    assert_eq!(total(&own.body), 10);

    let carol = |q: &'static str| {
        let app = &app;
        let p = p.clone();
        async move {
            let r = app
                .public_get(&format!("/v1/usage?{q}&{p}"), Some("carol-token"))
                .await;
            assert_eq!(r.status, 200, "{q}: {}", r.body);
            r.body
        }
    };
    assert_eq!(
        total(&carol("groupBy=day").await),
        0,
        "an admin's own usage by default"
    );
    assert_eq!(total(&carol("user=alice").await), 10);
    assert_eq!(
        total(&carol("tier=premium").await),
        2,
        "everyone in the tier"
    );
    assert_eq!(total(&carol("user=*").await), 12);
    let users = carol("user=*&groupBy=user").await;
    assert_eq!(users["data"][0]["user"], "alice");
    assert_eq!(users["data"][1]["user"], "bob");
    assert_eq!(total(&carol("user=alice&tier=premium").await), 0);

    // Bad parameters are named; no credential is a 401.
    for (q, param) in [
        ("groupBy=week", "groupBy"),
        ("from=last-week", "from"),
        ("from=2026-01-02&to=2026-01-01", "to"),
        ("limit=5", "query"),
    ] {
        let r = app
            .public_get(&format!("/v1/usage?{q}"), Some("alice-token"))
            .await;
        assert_eq!(r.status, 400, "{q}: {}", r.body);
        assert_eq!(r.body["error"]["param"], param, "{q}");
    }
    assert_eq!(app.public_get("/v1/usage", None).await.status, 401);
}

/// Waits until at least `secs` seconds are left in the current minute (so a test's lease
/// writes and quota reads fall in one window).
async fn with_room_in_the_minute(secs: i64) {
    let left = 60 - now() % 60;
    if left < secs {
        tokio::time::sleep(Duration::from_secs(u64::try_from(left).unwrap() + 1)).await;
    }
}

/// Takes 5 requests and 700 tokens of alice's 1-minute windows through the lease endpoint, as
/// gateways do, and checks that `GET /v1/quota` shows them.
async fn quota_follows_the_lease_counters(app: &TestApp, store: &str) {
    with_room_in_the_minute(10).await;
    let start = now() - now() % 60;
    let r = app
        .internal_post(
            LEASES_PATH,
            &json!({"replica": "gw-1", "items": [
                {"subject": "alice", "kind": "requests", "windowSeconds": 60, "windowStart": start,
                 "limit": 30, "need": 5},
                {"subject": "alice", "kind": "tokens", "windowSeconds": 60, "windowStart": start,
                 "limit": 2000, "debt": 700},
            ]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["grants"][0]["taken"], 5);

    let q = app.public_get("/v1/quota", Some("alice-token")).await;
    assert_eq!(q.status, 200, "{}", q.body);
    assert_eq!(q.body["tier"], "free");
    assert_eq!(q.body["store"], store);
    let resets = chrono::DateTime::from_timestamp(start + 60, 0)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let day_start = now() - now() % DAY;
    let day_resets = chrono::DateTime::from_timestamp(day_start + DAY, 0)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let rows: Vec<(Value, Value, Value, Value, Value, Value)> = q.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["kind"].clone(),
                r["window"].clone(),
                r["limit"].clone(),
                r["used"].clone(),
                r["remaining"].clone(),
                r["resetsAt"].clone(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (
                json!("requests"),
                json!("1m"),
                json!(30),
                json!(5),
                json!(25),
                json!(resets)
            ),
            (
                json!("tokens"),
                json!("1m"),
                json!(2000),
                json!(700),
                json!(1300),
                json!(resets)
            ),
            (
                json!("tokens"),
                json!("1d"),
                json!(100000),
                json!(0),
                json!(100000),
                json!(day_resets)
            ),
        ],
        "{}",
        q.body
    );
    // An API key of alice's reads the same counters (one budget per person).
    let key = key_of(app, "alice-token", "quota").await.key;
    let by_key = app.public_get("/v1/quota", Some(&key)).await;
    assert_eq!(by_key.body["data"][0]["used"], 5, "{}", by_key.body);
    // Bob's counters are his own; dave has no tier.
    let bob = app.public_get("/v1/quota", Some("bob-token")).await;
    assert_eq!(bob.body["tier"], "premium");
    assert_eq!(bob.body["data"][0]["used"], 0);
    assert_eq!(bob.body["data"][0]["limit"], 300);
    let dave = app.public_get("/v1/quota", Some("dave-token")).await;
    assert_eq!(
        (dave.status, dave.code()),
        (403, "no_tier"),
        "{}",
        dave.body
    );
    assert_eq!(app.public_get("/v1/quota", None).await.status, 401);
}

#[tokio::test]
async fn quota_shows_the_in_process_lease_counters() {
    let app = spawn_app().await;
    quota_follows_the_lease_counters(&app, "memory").await;
}

/// A throwaway redis-server on a free port (killed on drop).
struct Redis {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> Redis {
        let binary = std::env::var("MAAS_REDIS_SERVER")
            .ok()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "/usr/bin/redis-server".into());
        let dir = tempfile::tempdir().unwrap();
        for _ in 0..10 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let mut child = std::process::Command::new(&binary)
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                ])
                .args(["--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("{binary}: {e} (apt-get install redis-server)"));
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && child.try_wait().unwrap().is_none() {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Redis {
                        child,
                        port,
                        _dir: dir,
                    };
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("redis-server did not start");
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn quota_shows_the_redis_lease_counters_and_503_without_redis() {
    let redis = Redis::start();
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let app = spawn_app_with(|s| {
        s.leases.redis = Some(RedisSettings {
            url: url.clone().into(),
            endpoint: url,
            timeout: Duration::from_millis(500),
        });
    })
    .await;
    quota_follows_the_lease_counters(&app, "redis").await;
    drop(redis);
    let r = app.public_get("/v1/quota", Some("alice-token")).await;
    assert_eq!(
        (r.status, r.code()),
        (503, "lease_store_unavailable"),
        "{}",
        r.body
    );
}

async fn daily_rows(app: &TestApp) -> Vec<(String, i64, i64, i64, String)> {
    sqlx::query_as(
        "SELECT day::text, requests, prompt_tokens, completion_tokens, refused::text \
         FROM usage_daily ORDER BY day, key_id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

async fn hourly_count(app: &TestApp, before: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM usage_hourly WHERE hour_start < to_timestamp($1)")
        .bind(before)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// Records of two days past a 31-day retention (`day` and the day before, one refused, one
/// with cached input tokens) and one of this hour.
fn records_past_the_retention(day: i64) -> serde_json::Value {
    let mut refused = record("alice", None, "free", "sim-model", day + 2 * HOUR);
    refused["refused"] = json!({"rate_limit_exceeded": 4});
    let mut cached = record("alice", None, "free", "sim-model", day + HOUR);
    cached["cachedInputTokens"] = json!(4);
    json!([
        cached,
        refused,
        record("alice", None, "free", "sim-model", day + 23 * HOUR),
        record(
            "alice",
            Some("k1"),
            "free",
            "sim-model",
            day - DAY + 3 * HOUR
        ),
        record("alice", None, "free", "sim-model", this_hour()),
    ])
}

async fn insert_a_day_old_batch(app: &TestApp) {
    sqlx::query(
        "INSERT INTO usage_batches (replica, batch_id, applied_at) \
         VALUES ('gw-old', 'b-old', now() - interval '25 hours')",
    )
    .execute(&app.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn hours_past_the_retention_are_rolled_up_into_days_once() {
    let app = spawn_app_with(|s| {
        s.usage.hourly_retention_days = 31;
        s.usage.rollup_interval = Duration::from_millis(200);
    })
    .await;
    let day = now() - now() % DAY - 40 * DAY;
    let records = records_past_the_retention(day);
    // Batch ids are forgotten after a day.
    insert_a_day_old_batch(&app).await;
    let before = app
        .public_get(
            &format!("/v1/usage?groupBy=model&from={}", day - DAY),
            Some("alice-token"),
        )
        .await;
    let r = report(&app, "old", records).await;
    assert_eq!(r.status, 200, "{}", r.body);

    let deadline = Instant::now() + Duration::from_secs(10);
    while hourly_count(&app, now() - 31 * DAY).await > 0 {
        assert!(Instant::now() < deadline, "the rollup did not run");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rolled = daily_rows(&app).await;
    assert_eq!(
        rolled,
        vec![
            (day_of(day - DAY), 2, 10, 20, "{}".to_string()),
            (
                day_of(day),
                6,
                30,
                60,
                r#"{"rate_limit_exceeded": 4}"#.to_string()
            ),
        ]
    );
    // The recent hour stays hourly.
    assert_eq!(hourly_count(&app, now() + HOUR).await, 1);
    let batches: Vec<String> = sqlx::query_scalar("SELECT batch_id FROM usage_batches")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(batches, vec!["old".to_string()]);

    // More passes change nothing.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(daily_rows(&app).await, rolled);
    assert!(
        app.metric("maas_companion_usage_rolled_up_rows_total")
            .await
            >= 4.0
    );

    // The API reads the days as it read the hours.
    let after = app
        .public_get(
            &format!("/v1/usage?groupBy=model&from={}", day_of(day - DAY)),
            Some("alice-token"),
        )
        .await;
    assert_eq!(after.status, 200, "{}", after.body);
    assert_eq!(before.body["data"], json!([]), "nothing before the report");
    assert_eq!(after.body["data"][0]["requests"], 10, "{}", after.body);
    // Cached input tokens are rolled up with the rest.
    let daily_cached: i64 =
        sqlx::query_scalar("SELECT COALESCE(SUM(cached_input_tokens),0)::bigint FROM usage_daily")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(daily_cached, 4);
    assert_eq!(
        after.body["data"][0]["cachedInputTokens"], 4,
        "{}",
        after.body
    );
    assert_eq!(
        after.body["data"][0]["refused"],
        json!({"rate_limit_exceeded": 4})
    );
    let by_hour = app
        .public_get(
            &format!(
                "/v1/usage?groupBy=hour&from={}&to={}",
                day_of(day),
                day_of(day)
            ),
            Some("alice-token"),
        )
        .await;
    let hour0 = chrono::DateTime::from_timestamp(day, 0)
        .unwrap()
        .format("%Y-%m-%dT%H:00:00Z")
        .to_string();
    assert_eq!(
        by_hour.body["data"][0]["hour"],
        json!(hour0),
        "{}",
        by_hour.body
    );
    assert_eq!(by_hour.body["data"][0]["requests"], 6);
}

#[tokio::test]
async fn reports_feed_token_request_and_refusal_counters_by_tier_and_model() {
    let app = spawn_app().await;
    let h = this_hour();
    let mut refused = record("bob", None, "premium", "sim-premium", h);
    refused["refused"] = json!({"rate_limit_exceeded": 3});
    let records = json!([
        record("alice", None, "free", "sim-model", h),
        record("alice", Some("k1"), "free", "sim-model", h),
        refused,
    ]);
    assert_eq!(report(&app, "m1", records.clone()).await.status, 200);
    // A resent batch is not counted again.
    assert_eq!(report(&app, "m1", records).await.body["duplicate"], true);
    let series = [
        (
            "maas_companion_usage_tokens_total{tier=\"free\",model=\"sim-model\",direction=\"prompt\"}",
            20.0,
        ),
        (
            "maas_companion_usage_tokens_total{tier=\"free\",model=\"sim-model\",direction=\"completion\"}",
            40.0,
        ),
        (
            "maas_companion_usage_requests_total{tier=\"free\",model=\"sim-model\"}",
            4.0,
        ),
        (
            "maas_companion_usage_requests_total{tier=\"premium\",model=\"sim-premium\"}",
            2.0,
        ),
        (
            "maas_companion_usage_refused_total{tier=\"premium\",model=\"sim-premium\",reason=\"rate_limit_exceeded\"}",
            3.0,
        ),
        (
            "maas_companion_usage_reports_total{result=\"applied\"}",
            1.0,
        ),
        (
            "maas_companion_usage_reports_total{result=\"duplicate\"}",
            1.0,
        ),
    ];
    for (name, value) in series {
        assert_eq!(app.metric(name).await, value, "{name}");
    }
    let text = app.scrape().await;
    assert!(!text.contains("user=\""), "no user label by default");
}

#[tokio::test]
async fn per_user_labels_are_capped_and_the_rest_is_other() {
    let app = spawn_app_with(|s| s.usage.metrics_max_users = Some(2)).await;
    let h = this_hour();
    let records = json!([
        record("alice", None, "free", "sim-model", h),
        record("bob", None, "free", "sim-model", h),
        record("carol", None, "free", "sim-model", h),
        record("dave", None, "free", "sim-model", h),
        record("alice", None, "free", "sim-model", h),
    ]);
    assert_eq!(report(&app, "u1", records).await.status, 200);
    let requests = |user: &str| {
        format!(
            "maas_companion_usage_requests_total{{tier=\"free\",model=\"sim-model\",user=\"{user}\"}}"
        )
    };
    // The label is the user as the logs name them (a keyed pseudonym once set for the process).
    let as_logged = maas_companion::pseudonym::user;
    assert_eq!(app.metric(&requests(&as_logged("alice"))).await, 4.0);
    assert_eq!(app.metric(&requests(&as_logged("bob"))).await, 2.0);
    assert_eq!(app.metric(&requests("other")).await, 4.0, "carol and dave");
    let text = app.scrape().await;
    for gone in ["carol", "dave"] {
        assert!(
            !text.contains(&format!("user=\"{}\"", as_logged(gone))),
            "{text}"
        );
    }
}

/// Chargeback (issue 30): each row is charged, when reported, to its subscription's
/// `tokenMetadata` organisation and cost centre at the model's `billingRate.perToken` (exact
/// decimals); admins group everyone's usage by subscription, organisation or cost centre, as
/// JSON or CSV; the labels and the cost survive the rollup to days.
#[tokio::test]
async fn usage_is_charged_back_by_subscription_organization_and_cost_center() {
    let app = crate::subscriptions::spawn_with_subscriptions().await;
    let h = this_hour();
    let records = json!([
        // team-a: org-team-a, cc-1001, sim-model at 0.000002 per token.
        record("alice", None, "subscription:team-a", "sim-model", h),
        record("alice", None, "subscription:team-a", "sim-model", h - HOUR),
        // premium-sub: cc-2002, no organisation, no rate.
        record("bob", None, "subscription:premium-sub", "sim-premium", h),
        // A tier's usage: no subscription, nothing to charge.
        record("carol", None, "enterprise", "sim-model", h),
        // A subscription no longer in the policy: counted, charged to nobody.
        record("erin", None, "subscription:gone", "sim-model", h),
    ]);
    let r = report(&app, "cb-1", records).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let get = |q: String| {
        let app = &app;
        async move {
            let r = app
                .public_get(&format!("/v1/usage?user=*&{q}"), Some("carol-token"))
                .await;
            assert_eq!(r.status, 200, "{q}: {}", r.body);
            r.body["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|row| {
                    (
                        row[&q["groupBy=".len()..]].as_str().unwrap().to_string(),
                        row["totalTokens"].as_u64().unwrap(),
                        row["cost"].as_str().unwrap().to_string(),
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    let s = |v: &str| v.to_string();
    assert_eq!(
        get(s("groupBy=organization")).await,
        [(s(""), 90, s("0")), (s("org-team-a"), 60, s("0.00012"))]
    );
    assert_eq!(
        get(s("groupBy=costCenter")).await,
        [
            (s(""), 60, s("0")),
            (s("cc-1001"), 60, s("0.00012")),
            (s("cc-2002"), 30, s("0"))
        ]
    );
    assert_eq!(
        get(s("groupBy=subscription")).await,
        [
            (s(""), 30, s("0")),
            (s("gone"), 30, s("0")),
            (s("premium-sub"), 30, s("0")),
            (s("team-a"), 60, s("0.00012"))
        ]
    );

    // A user sees only their own rows, by organisation too.
    let own = app
        .public_get("/v1/usage?groupBy=organization", Some("alice-token"))
        .await;
    assert_eq!(
        own.body["data"].as_array().unwrap().len(),
        1,
        "{}",
        own.body
    );
    assert_eq!(own.body["data"][0]["organization"], "org-team-a");

    // CSV for the spreadsheet.
    let csv = app
        .http
        .get(format!("{}/v1/usage?user=*&groupBy=costCenter", app.public))
        .bearer_auth("carol-token")
        .header("accept", "text/csv")
        .send()
        .await
        .unwrap();
    assert_eq!(csv.status(), 200);
    assert_eq!(
        csv.headers()["content-type"].to_str().unwrap(),
        "text/csv; charset=utf-8"
    );
    let text = csv.text().await.unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            "costCenter,requests,refused,promptTokens,completionTokens,totalTokens,cachedInputTokens,cost",
            ",4,,20,40,60,0,0",
            "cc-1001,4,,20,40,60,0,0.00012",
            "cc-2002,2,,10,20,30,0,0",
        ],
        "{text}"
    );

    // A second report of the hour adds to the cost; the labels stay.
    let r = report(
        &app,
        "cb-2",
        json!([record("alice", None, "subscription:team-a", "sim-model", h)]),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        get(s("groupBy=organization")).await,
        [(s(""), 90, s("0")), (s("org-team-a"), 90, s("0.00018"))]
    );
}

/// The labels and the cost are rolled up to days with the counts.
#[tokio::test]
async fn chargeback_labels_and_cost_are_rolled_up() {
    let app = crate::subscriptions::spawn_with_subscriptions_and(|s| {
        s.usage.hourly_retention_days = 31;
        s.usage.rollup_interval = Duration::from_millis(200);
    })
    .await;
    let day = now() - now() % DAY - 40 * DAY;
    let r = report(
        &app,
        "old-cb",
        json!([
            record(
                "alice",
                None,
                "subscription:team-a",
                "sim-model",
                day + HOUR
            ),
            record(
                "alice",
                None,
                "subscription:team-a",
                "sim-model",
                day + 5 * HOUR
            ),
        ]),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let deadline = Instant::now() + Duration::from_secs(10);
    while hourly_count(&app, now() - 31 * DAY).await > 0 {
        assert!(Instant::now() < deadline, "the rollup did not run");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let daily: Vec<(String, String, String)> =
        sqlx::query_as("SELECT organization, cost_center, cost::text FROM usage_daily")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        daily,
        [(
            "org-team-a".to_string(),
            "cc-1001".to_string(),
            "0.000120".to_string()
        )]
    );
    let body = app
        .public_get(
            &format!("/v1/usage?groupBy=organization&from={}", day_of(day - DAY)),
            Some("alice-token"),
        )
        .await
        .body;
    assert_eq!(body["data"][0]["cost"], "0.00012", "{body}");
}

/// A name that a spreadsheet would run as a formula (a user name from an identity provider, a
/// key name a user chose) is exported as text: a leading `'`.
#[tokio::test]
async fn the_csv_export_never_holds_a_formula() {
    let app = spawn_app().await;
    let r = report(
        &app,
        "csv-formula",
        json!([
            record(
                "=HYPERLINK(\"http://x\",\"y\")",
                None,
                "free",
                "sim-model",
                this_hour()
            ),
            record("@SUM(1)", None, "free", "sim-model", this_hour()),
            record("plain", None, "free", "sim-model", this_hour()),
        ]),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let csv = app
        .http
        .get(format!("{}/v1/usage?user=*&groupBy=user", app.public))
        .bearer_auth("carol-token")
        .header("accept", "text/csv")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let firsts: Vec<String> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap().to_string())
        .collect();
    assert!(firsts.contains(&"'@SUM(1)".to_string()), "{csv}");
    assert!(firsts.contains(&"plain".to_string()), "{csv}");
    assert!(
        csv.lines().any(|l| l.starts_with("\"'=HYPERLINK(")),
        "{csv}"
    );
    assert!(
        !csv.lines()
            .any(|l| l.starts_with('=') || l.starts_with("\"=")),
        "{csv}"
    );
}

/// `record` naming the backend that served (`None`: none).
fn served(subject: &str, model: &str, backend: Option<&str>, hour: i64) -> Value {
    let mut r = record(subject, None, "free", model, hour);
    if let Some(b) = backend {
        r["backend"] = json!(b);
    }
    r
}

/// `GET /v1/usage?groupBy=backend` rows as `(backend, model, requests, totalTokens)`.
async fn by_backend(app: &TestApp, token: &str, query: &str) -> Vec<(String, String, u64, u64)> {
    let r = app
        .public_get(&format!("/v1/usage?groupBy=backend{query}"), Some(token))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["groupBy"], "backend");
    r.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            (
                row["backend"].as_str().unwrap().to_string(),
                row["model"].as_str().unwrap().to_string(),
                row["requests"].as_u64().unwrap(),
                row["totalTokens"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn usage_is_grouped_by_the_backend_that_served_and_the_ledger_keeps_every_request() {
    let app = spawn_app().await;
    let h = this_hour();
    let records = json!([
        served("alice", "duo", Some("a"), h),
        served("alice", "duo", Some("b"), h),
        served("alice", "duo", Some("a"), h),
        // A model without backends (or a filter that does not send one): no backend row.
        served("alice", "sim-model", None, h),
        served("bob", "duo", Some("b"), h),
    ]);
    let r = report(&app, "be-1", records.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The ledger's rows hold every request, backend or not (as before).
    assert_eq!(hourly_sums(&app).await, (10, 50, 100));
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT subject, backend, requests FROM usage_backend_hourly ORDER BY subject, backend",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let s = |v: &str| v.to_string();
    assert_eq!(
        rows,
        [
            (s("alice"), s("a"), 4),
            (s("alice"), s("b"), 2),
            (s("bob"), s("b"), 2)
        ]
    );
    // A resent batch adds nothing to either.
    let again = report(&app, "be-1", records).await;
    assert_eq!(again.body["duplicate"], true, "{}", again.body);
    assert_eq!(hourly_sums(&app).await, (10, 50, 100));

    // Alice sees her own; an admin everyone's.
    assert_eq!(
        by_backend(&app, "alice-token", &format!("&{}", period())).await,
        [(s("a"), s("duo"), 4, 60), (s("b"), s("duo"), 2, 30)]
    );
    assert_eq!(
        by_backend(&app, "carol-token", &format!("&user=*&{}", period())).await,
        [(s("a"), s("duo"), 4, 60), (s("b"), s("duo"), 4, 60)]
    );
    // The other groupings read the ledger as before: the backend split adds nothing to them.
    let models = app
        .public_get(
            &format!("/v1/usage?groupBy=model&{}", period()),
            Some("alice-token"),
        )
        .await;
    let requests: Vec<(String, u64)> = models.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["model"].as_str().unwrap().to_string(),
                r["requests"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(requests, [(s("duo"), 6), (s("sim-model"), 2)]);
    assert!(models.body["data"][0].get("backend").is_none());

    // As CSV: the backend and its model first.
    let csv = app
        .http
        .get(format!("{}/v1/usage?groupBy=backend", app.public))
        .bearer_auth("alice-token")
        .header("accept", "text/csv")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert!(lines[0].starts_with("backend,model,requests,"), "{csv}");
    assert!(lines[1].starts_with("a,duo,4,"), "{csv}");

    // An unknown grouping still names the known ones.
    let bad = app
        .public_get("/v1/usage?groupBy=backends", Some("alice-token"))
        .await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(
        bad.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("or backend"),
        "{}",
        bad.body
    );
}

#[tokio::test]
async fn backend_rows_past_the_retention_are_rolled_up_into_days() {
    let app = spawn_app_with(|s| {
        s.usage.hourly_retention_days = 31;
        s.usage.rollup_interval = Duration::from_millis(200);
    })
    .await;
    let day = now() - now() % DAY - 40 * DAY;
    let records = json!([
        served("alice", "duo", Some("a"), day + HOUR),
        served("alice", "duo", Some("a"), day + 5 * HOUR),
        served("alice", "duo", Some("b"), day + 2 * HOUR),
        served("alice", "duo", Some("b"), this_hour()),
    ]);
    let r = report(&app, "be-old", records).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let old_backend_hours = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM usage_backend_hourly WHERE hour_start < to_timestamp($1)",
        )
        .bind(now() - 31 * DAY)
        .fetch_one(&app.pool)
        .await
        .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while old_backend_hours().await > 0 {
        assert!(Instant::now() < deadline, "the rollup did not run");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let daily: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT day::text, backend, requests FROM usage_backend_daily ORDER BY backend",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let s = |v: &str| v.to_string();
    assert_eq!(daily, [(day_of(day), s("a"), 4), (day_of(day), s("b"), 2)]);
    // The recent hour stays hourly; the query reads days and hours alike.
    let recent: i64 = sqlx::query_scalar("SELECT count(*) FROM usage_backend_hourly")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(recent, 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        by_backend(&app, "alice-token", &format!("&from={}", day_of(day - DAY))).await,
        [(s("a"), s("duo"), 4, 60), (s("b"), s("duo"), 4, 60)]
    );
}

//! OIDC identities: JWTs verified against a JWKS served by a local HTTP stand-in.

use crate::helpers::{IDENTITIES, create_database, local_policy, spawn_with_config};
use axum::routing::get;
use axum::{Json, Router};
use jwt_simple::prelude::*;
use maas_companion::settings::{IdentityProvider, OidcSettings};
use serde_json::json;

pub const ISSUER: &str = "https://issuer.example.test";
pub const AUDIENCE: &str = "maas";

#[derive(Serialize, Deserialize)]
struct UserClaims {
    preferred_username: String,
    groups: Vec<String>,
}

pub fn token(key: &ES256KeyPair, issuer: &str, audience: &str, valid_for: Duration) -> String {
    let claims = Claims::with_custom_claims(
        UserClaims {
            preferred_username: "olivia".into(),
            groups: vec!["tier-premium-users".into()],
        },
        valid_for,
    )
    .with_issuer(issuer)
    .with_audience(audience)
    .with_subject("0b7c-olivia");
    key.sign(claims).unwrap()
}

/// Serves `{"keys":[<key's public JWK>]}` on a local port; returns its URL.
pub async fn start_jwks(key: &ES256KeyPair) -> String {
    let jwk: serde_json::Value = serde_json::from_str(&key.public_key().to_jwk()).unwrap();
    let jwks = json!({"keys": [jwk]});
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let jwks_url = format!("http://{}/jwks", listener.local_addr().unwrap());
    let router = Router::new().route("/jwks", get(move || async move { Json(jwks) }));
    tokio::spawn(async move { axum::serve(listener, router).await });
    jwks_url
}

/// The companion with `--identity-provider oidc` trusting the JWKS at `jwks_url`.
async fn spawn_oidc_app(jwks_url: String) -> crate::helpers::TestApp {
    let database_url = create_database().await;
    let dir = tempfile::tempdir().unwrap();
    let policy_path = dir.path().join("policy.yaml");
    let ids = dir.path().join("ids.yaml");
    std::fs::write(&policy_path, local_policy()).unwrap();
    std::fs::write(&ids, IDENTITIES).unwrap();
    std::fs::write(dir.path().join("creds.yaml"), "credentials: {}\n").unwrap();
    let mut config = crate::helpers::local_settings(
        &database_url,
        &policy_path,
        &ids,
        &dir.path().join("creds.yaml"),
    );
    config.identity.provider = IdentityProvider::Oidc(OidcSettings {
        issuer: ISSUER.into(),
        audience: AUDIENCE.into(),
        jwks_url,
        groups_claim: "groups".into(),
    });
    spawn_with_config(config, dir, policy_path, database_url, Default::default()).await
}

#[tokio::test]
async fn oidc_tokens_are_verified_against_the_jwks() {
    let key = ES256KeyPair::generate().with_key_id("k1");
    let app = spawn_oidc_app(start_jwks(&key).await).await;

    let good = token(&key, ISSUER, AUDIENCE, Duration::from_hours(1));
    let r = app.authenticate(&good).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["subject"], "olivia");
    assert_eq!(r.body["tier"], "premium");
    assert_eq!(
        r.body["groups"],
        json!(["system:authenticated", "tier-premium-users"])
    );
    assert!(r.body["expires_at"].as_i64().unwrap() > chrono::Utc::now().timestamp());
    let minted = app.mint(&good, json!({"name": "from-oidc"})).await;
    assert_eq!(minted["tier"], "premium");

    for (what, bad) in [
        (
            "wrong issuer",
            token(&key, "https://evil.test", AUDIENCE, Duration::from_hours(1)),
        ),
        (
            "wrong audience",
            token(&key, ISSUER, "other", Duration::from_hours(1)),
        ),
        (
            "other key, same kid",
            token(
                &ES256KeyPair::generate().with_key_id("k1"),
                ISSUER,
                AUDIENCE,
                Duration::from_hours(1),
            ),
        ),
        ("not a JWT", "a.b.c".to_string()),
        (
            "another client's azp, aud not ours",
            azp_token(&key, "account", "other-client"),
        ),
        ("azp but another issuer", {
            let claims = azp_claims("account", AUDIENCE).with_issuer("https://evil.test");
            key.sign(claims).unwrap()
        }),
    ] {
        let r = app.authenticate(&bad).await;
        assert_eq!(r.status, 401, "{what}: {}", r.body);
        assert_eq!(r.message(), "invalid token", "{what}");
    }
    // Expired (beyond the clock tolerance).
    let mut claims = Claims::with_custom_claims(
        UserClaims {
            preferred_username: "olivia".into(),
            groups: vec![],
        },
        Duration::from_hours(1),
    )
    .with_issuer(ISSUER)
    .with_audience(AUDIENCE);
    claims.expires_at = Some(Clock::now_since_epoch() - Duration::from_mins(10));
    let expired = key.sign(claims).unwrap();
    assert_eq!(app.authenticate(&expired).await.status, 401);
    // Keycloak's access tokens: `aud` is `account`, the client is `azp` (the reference's check).
    let r = app
        .authenticate(&azp_token(&key, "account", AUDIENCE))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["subject"], "olivia");
    // The static identities are not accepted when OIDC is configured.
    assert_eq!(app.authenticate("alice-token").await.status, 401);
}

#[derive(Serialize, Deserialize)]
struct AzpClaims {
    preferred_username: String,
    azp: String,
}

fn azp_claims(audience: &str, azp: &str) -> JWTClaims<AzpClaims> {
    Claims::with_custom_claims(
        AzpClaims {
            preferred_username: "olivia".into(),
            azp: azp.into(),
        },
        Duration::from_hours(1),
    )
    .with_issuer(ISSUER)
    .with_audience(audience)
}

/// A token whose `aud` is `audience` and whose authorized party (`azp`) is `azp`.
fn azp_token(key: &ES256KeyPair, audience: &str, azp: &str) -> String {
    key.sign(azp_claims(audience, azp)).unwrap()
}

/// Claims that pass every check; each case below breaks one time claim.
fn valid_claims() -> JWTClaims<UserClaims> {
    Claims::with_custom_claims(
        UserClaims {
            preferred_username: "olivia".into(),
            groups: vec![],
        },
        Duration::from_hours(1),
    )
    .with_issuer(ISSUER)
    .with_audience(AUDIENCE)
}

#[tokio::test]
async fn oidc_time_claims_are_required_and_checked_with_a_small_skew() {
    let key = ES256KeyPair::generate().with_key_id("k1");
    let app = spawn_oidc_app(start_jwks(&key).await).await;
    let now = Clock::now_since_epoch();

    let r = app.authenticate(&key.sign(valid_claims()).unwrap()).await;
    assert_eq!(r.status, 200, "control: {}", r.body);

    let mut no_exp = valid_claims();
    no_exp.expires_at = None;
    let mut nbf_future = valid_claims();
    nbf_future.invalid_before = Some(now + Duration::from_mins(5));
    let mut iat_future = valid_claims();
    iat_future.issued_at = Some(now + Duration::from_mins(5));
    for (what, claims) in [
        ("no exp (would never expire)", no_exp),
        ("nbf 5 min in the future", nbf_future),
        ("iat 5 min in the future", iat_future),
    ] {
        let token = key.sign(claims).unwrap();
        let r = app.authenticate(&token).await;
        assert_eq!(r.status, 401, "{what}: {}", r.body);
        assert_eq!(r.message(), "invalid token", "{what}");
        // The public API refuses it too.
        let r = app.public_get("/v1/models", Some(&token)).await;
        assert_eq!(r.status, 401, "{what}: public API: {}", r.body);
    }

    // Within the skew (an issuer clock 30 s ahead): accepted.
    let mut slightly_ahead = valid_claims();
    slightly_ahead.issued_at = Some(now + Duration::from_secs(30));
    slightly_ahead.invalid_before = Some(now + Duration::from_secs(30));
    let r = app.authenticate(&key.sign(slightly_ahead).unwrap()).await;
    assert_eq!(r.status, 200, "within the skew: {}", r.body);
}

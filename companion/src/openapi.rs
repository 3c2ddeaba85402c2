//! `GET /openapi.json`: OpenAPI 3.0 description of every public endpoint.
//! A test checks it against [`crate::startup::PUBLIC_ROUTES`] and the router.

use axum::Json;
use serde_json::{Value, json};

fn error_responses(codes: &[&str]) -> Value {
    let mut m = serde_json::Map::new();
    for c in codes {
        m.insert(
            (*c).to_string(),
            json!({"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}),
        );
    }
    Value::Object(m)
}

fn with_errors(mut ok: Value, codes: &[&str]) -> Value {
    if let (Some(o), Value::Object(errs)) = (ok.as_object_mut(), error_responses(codes)) {
        o.extend(errs);
    }
    ok
}

fn json_ok(code: &str, description: &str, schema: &str) -> Value {
    json!({code: {"description": description, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}}})
}

fn body(schema: &str) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}})
}

pub fn document() -> Value {
    let secured = json!([{"bearer": []}]);
    let id_param = json!([{"name": "id", "in": "path", "required": true, "schema": {"type": "string", "format": "uuid"}}]);
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "MaaS Gateway companion API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "API keys, tiers and model listing. Through the gateway every path is under /maas-api. Authenticate with `Authorization: Bearer <cluster token | sk-oai-… key>`; only a cluster identity may mint or revoke keys."
        },
        "paths": {
            "/v1/api-keys": {"post": {
                "summary": "Mint an API key (the plaintext key is in this response only)",
                "security": secured, "requestBody": body("CreateApiKeyRequest"),
                "responses": with_errors(json_ok("201", "created", "CreateApiKeyResponse"), &["400", "401", "403", "413", "503"])
            }},
            "/v1/api-keys/search": {"post": {
                "summary": "Search API keys (own keys; admins: anyone's)",
                "security": secured, "requestBody": body("SearchRequest"),
                "responses": with_errors(json_ok("200", "keys", "ApiKeyList"), &["400", "401", "403", "503"])
            }},
            "/v1/api-keys/bulk-revoke": {"post": {
                "summary": "Revoke every active key of a user",
                "security": secured, "requestBody": body("BulkRevokeRequest"),
                "responses": with_errors(json_ok("200", "revoked", "BulkRevokeResponse"), &["400", "401", "403", "503"])
            }},
            "/v1/api-keys/config": {"get": {
                "summary": "Key lifetime limits",
                "security": secured,
                "responses": with_errors(json_ok("200", "limits", "KeyConfig"), &["401"])
            }},
            "/v1/api-keys/{id}": {
                "get": {
                    "summary": "Get an API key (never the key itself); another user's key is 404",
                    "security": secured, "parameters": id_param,
                    "responses": with_errors(json_ok("200", "the key", "ApiKey"), &["401", "404", "503"])
                },
                "delete": {
                    "summary": "Revoke an API key; again or unknown is 404",
                    "security": secured, "parameters": id_param,
                    "responses": with_errors(json_ok("200", "revoked", "ApiKey"), &["401", "403", "404", "503"])
                }
            },
            "/v1/models": {"get": {
                "summary": "Models the caller's tier may use (OpenAI list)",
                "security": secured,
                "responses": with_errors(json_ok("200", "models", "ModelList"), &["401"])
            }},
            "/v1/tiers": {"get": {
                "summary": "Tiers, their limits and models, and which the caller qualifies for",
                "security": secured,
                "responses": with_errors(json_ok("200", "tiers", "TierList"), &["401"])
            }},
            "/health": {"get": {"summary": "Liveness", "responses": {"200": {"description": "healthy"}}}},
            "/ready": {"get": {"summary": "Readiness (PostgreSQL reachable, migrations applied)", "responses": with_errors(json!({"200": {"description": "ready"}}), &["503"])}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI document"}}}}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {
                    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": "string", "nullable": true}, "code": {"type": "string", "nullable": true}}}}},
                "CreateApiKeyRequest": {"type": "object", "properties": {
                    "name": {"type": "string", "maxLength": 128, "description": "required unless ephemeral"},
                    "description": {"type": "string"},
                    "expiresIn": {"oneOf": [{"type": "string", "example": "30d"}, {"type": "number", "description": "seconds"}], "description": "30d, 1.5d, 1h, 2h30m or seconds; default and maximum: the configured maximum (ephemeral: 1h)"},
                    "tier": {"type": "string", "description": "pin the key to a tier the caller qualifies for"},
                    "ephemeral": {"type": "boolean"}}},
                "CreateApiKeyResponse": {"type": "object", "properties": {
                    "id": {"type": "string", "format": "uuid"}, "key": {"type": "string", "description": "shown once"},
                    "keyPrefix": {"type": "string"}, "name": {"type": "string"}, "description": {"type": "string", "nullable": true},
                    "tier": {"type": "string"}, "createdAt": {"type": "string", "format": "date-time"},
                    "expiresAt": {"type": "string", "format": "date-time"}, "ephemeral": {"type": "boolean"}}},
                "ApiKey": {"type": "object", "properties": {
                    "id": {"type": "string", "format": "uuid"}, "name": {"type": "string"}, "description": {"type": "string"},
                    "username": {"type": "string"}, "groups": {"type": "array", "items": {"type": "string"}},
                    "tier": {"type": "string", "description": "pinned tier, absent when the key follows its owner's highest tier"},
                    "keyPrefix": {"type": "string"}, "creationDate": {"type": "string", "format": "date-time"},
                    "expirationDate": {"type": "string", "format": "date-time"},
                    "status": {"type": "string", "enum": ["active", "revoked", "expired"]},
                    "lastUsedAt": {"type": "string", "format": "date-time"}, "revokedAt": {"type": "string", "format": "date-time"},
                    "ephemeral": {"type": "boolean"}}},
                "SearchRequest": {"type": "object", "properties": {
                    "filters": {"type": "object", "properties": {"username": {"type": "string"}, "status": {"type": "array", "items": {"type": "string", "enum": ["active", "revoked", "expired"]}}, "includeEphemeral": {"type": "boolean"}}},
                    "sort": {"type": "object", "properties": {"by": {"type": "string", "enum": ["created_at", "expires_at", "last_used_at", "name"]}, "order": {"type": "string", "enum": ["asc", "desc"]}}},
                    "pagination": {"type": "object", "properties": {"limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 50}, "offset": {"type": "integer", "minimum": 0}}}}},
                "ApiKeyList": {"type": "object", "properties": {"object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": {"$ref": "#/components/schemas/ApiKey"}}, "has_more": {"type": "boolean"}}},
                "BulkRevokeRequest": {"type": "object", "required": ["username"], "properties": {"username": {"type": "string"}}},
                "BulkRevokeResponse": {"type": "object", "properties": {"revokedCount": {"type": "integer"}, "message": {"type": "string"}}},
                "KeyConfig": {"type": "object", "properties": {"maxExpirationDays": {"type": "integer"}, "defaultExpirationDays": {"type": "integer"}, "ephemeralMaxExpirationSeconds": {"type": "integer"}, "max_expiration_days": {"type": "integer"}, "ephemeral_max_expiration": {"type": "string"}}},
                "ModelList": {"type": "object", "properties": {"object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": {"type": "object", "properties": {
                    "id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]}, "created": {"type": "integer"}, "owned_by": {"type": "string"}, "ready": {"type": "boolean"}, "url": {"type": "string"}}}}}},
                "TierList": {"type": "object", "properties": {"object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": {"type": "object", "properties": {
                    "name": {"type": "string"}, "displayName": {"type": "string"}, "description": {"type": "string"}, "level": {"type": "integer"},
                    "limits": {"type": "object"}, "qualified": {"type": "boolean"}, "current": {"type": "boolean"}, "models": {"type": "array", "items": {"type": "string"}}}}}}}
            }
        }
    })
}

pub async fn serve() -> Json<Value> {
    Json(document())
}

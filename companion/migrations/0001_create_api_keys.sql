-- API keys: only the SHA-256 of the key is stored, never the plaintext.
-- `expired` is not a stored status: it is computed at read time from expires_at.
CREATE TABLE api_keys (
    id           UUID PRIMARY KEY,
    key_id       TEXT NOT NULL UNIQUE,
    key_hash     TEXT NOT NULL UNIQUE,
    username     TEXT NOT NULL,
    name         TEXT NOT NULL,
    description  TEXT,
    tier         TEXT,
    user_groups  TEXT[] NOT NULL,
    status       TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'revoked')),
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at   TIMESTAMPTZ NOT NULL,
    last_used_at TIMESTAMPTZ,
    revoked_at   TIMESTAMPTZ,
    ephemeral    BOOLEAN NOT NULL DEFAULT FALSE
);

-- Search: a user's keys (or everyone's, for admins) newest first; id breaks ties.
CREATE INDEX idx_api_keys_username_created ON api_keys (username, created_at DESC, id DESC);
CREATE INDEX idx_api_keys_created ON api_keys (created_at DESC, id DESC);
-- The revocation list served with the policy: keys revoked in the last 24 hours.
CREATE INDEX idx_api_keys_revoked_at ON api_keys (revoked_at) WHERE revoked_at IS NOT NULL;
-- Cleanup of expired ephemeral keys.
CREATE INDEX idx_api_keys_ephemeral_expires ON api_keys (expires_at) WHERE ephemeral;

-- Subscriptions (issue 15): the subscription a key is bound to at mint (NULL: the key follows
-- the tiers) and the key's labels ({"k": "v"}, searched with `labels @> {...}`).
ALTER TABLE api_keys ADD COLUMN subscription TEXT NULL;
ALTER TABLE api_keys ADD COLUMN labels JSONB NOT NULL DEFAULT '{}'::jsonb;

-- Search and bulk revoke by subscription.
CREATE INDEX idx_api_keys_subscription ON api_keys (subscription) WHERE subscription IS NOT NULL;

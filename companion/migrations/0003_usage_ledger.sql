-- The usage ledger (issue 16): what the gateways reported (POST /internal/v1/usage), per
-- API key ('' for a token caller), subject, tier, model and hour; rows older than the hourly
-- retention are rolled up into one row per day (same dimensions) and deleted.
--
-- Counts only ever grow by addition (INSERT ... ON CONFLICT DO UPDATE SET x = x + EXCLUDED.x),
-- so batches from many gateways and companions commute. `refused` is a JSON object
-- {reason: count}; maas_usage_add_counts adds two of them, maas_usage_sum_counts sums a column.

CREATE FUNCTION maas_usage_add_counts(a JSONB, b JSONB) RETURNS JSONB
LANGUAGE SQL IMMUTABLE PARALLEL SAFE AS $$
    SELECT COALESCE(jsonb_object_agg(reason, total), '{}'::jsonb)
    FROM (
        SELECT reason, SUM(n) AS total
        FROM (
            SELECT key AS reason, value::text::bigint AS n FROM jsonb_each(COALESCE(a, '{}'::jsonb))
            UNION ALL
            SELECT key AS reason, value::text::bigint AS n FROM jsonb_each(COALESCE(b, '{}'::jsonb))
        ) AS both_sides
        GROUP BY reason
    ) AS summed
$$;

CREATE AGGREGATE maas_usage_sum_counts(JSONB) (
    SFUNC = maas_usage_add_counts,
    STYPE = JSONB,
    INITCOND = '{}'
);

CREATE TABLE usage_hourly (
    key_id            TEXT        NOT NULL DEFAULT '',
    subject           TEXT        NOT NULL,
    tier              TEXT        NOT NULL,
    model             TEXT        NOT NULL,
    hour_start        TIMESTAMPTZ NOT NULL,
    requests          BIGINT      NOT NULL DEFAULT 0,
    refused           JSONB       NOT NULL DEFAULT '{}'::jsonb,
    prompt_tokens     BIGINT      NOT NULL DEFAULT 0,
    completion_tokens BIGINT      NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, key_id, tier, model, hour_start)
);

-- Admin queries by tier and time; the rollup scans by time.
CREATE INDEX usage_hourly_hour_idx ON usage_hourly (hour_start);
CREATE INDEX usage_hourly_tier_hour_idx ON usage_hourly (tier, hour_start);

CREATE TABLE usage_daily (
    key_id            TEXT   NOT NULL DEFAULT '',
    subject           TEXT   NOT NULL,
    tier              TEXT   NOT NULL,
    model             TEXT   NOT NULL,
    day               DATE   NOT NULL,
    requests          BIGINT NOT NULL DEFAULT 0,
    refused           JSONB  NOT NULL DEFAULT '{}'::jsonb,
    prompt_tokens     BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, key_id, tier, model, day)
);

CREATE INDEX usage_daily_day_idx ON usage_daily (day);
CREATE INDEX usage_daily_tier_day_idx ON usage_daily (tier, day);

-- Report batches already applied: a batch resent after a lost answer is ignored. Pruned after
-- a day by the rollup task.
CREATE TABLE usage_batches (
    replica    TEXT        NOT NULL,
    batch_id   TEXT        NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (replica, batch_id)
);

CREATE INDEX usage_batches_applied_idx ON usage_batches (applied_at);

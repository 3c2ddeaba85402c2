-- The backend that served, in the usage ledger (issue 29): a model with several backends has
-- its usage per backend here too, from records naming one (`backend`, the route's
-- x-maas-served-by). Additive: usage_hourly / usage_daily keep every request as before (a
-- record with a backend is added there as well), so the previous release's statements and
-- queries are unchanged; these tables hold the same rows split by backend, for
-- GET /v1/usage?groupBy=backend. Same dimensions, counts and rollup as the ledger's tables.

CREATE TABLE usage_backend_hourly (
    key_id              TEXT        NOT NULL DEFAULT '',
    subject             TEXT        NOT NULL,
    tier                TEXT        NOT NULL,
    model               TEXT        NOT NULL,
    backend             TEXT        NOT NULL,
    hour_start          TIMESTAMPTZ NOT NULL,
    requests            BIGINT      NOT NULL DEFAULT 0,
    refused             JSONB       NOT NULL DEFAULT '{}'::jsonb,
    prompt_tokens       BIGINT      NOT NULL DEFAULT 0,
    completion_tokens   BIGINT      NOT NULL DEFAULT 0,
    cached_input_tokens BIGINT      NOT NULL DEFAULT 0,
    organization        TEXT        NOT NULL DEFAULT '',
    cost_center         TEXT        NOT NULL DEFAULT '',
    cost                NUMERIC     NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, key_id, tier, model, backend, hour_start)
);

CREATE INDEX usage_backend_hourly_hour_idx ON usage_backend_hourly (hour_start);

CREATE TABLE usage_backend_daily (
    key_id              TEXT    NOT NULL DEFAULT '',
    subject             TEXT    NOT NULL,
    tier                TEXT    NOT NULL,
    model               TEXT    NOT NULL,
    backend             TEXT    NOT NULL,
    day                 DATE    NOT NULL,
    requests            BIGINT  NOT NULL DEFAULT 0,
    refused             JSONB   NOT NULL DEFAULT '{}'::jsonb,
    prompt_tokens       BIGINT  NOT NULL DEFAULT 0,
    completion_tokens   BIGINT  NOT NULL DEFAULT 0,
    cached_input_tokens BIGINT  NOT NULL DEFAULT 0,
    organization        TEXT    NOT NULL DEFAULT '',
    cost_center         TEXT    NOT NULL DEFAULT '',
    cost                NUMERIC NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, key_id, tier, model, backend, day)
);

CREATE INDEX usage_backend_daily_day_idx ON usage_backend_daily (day);

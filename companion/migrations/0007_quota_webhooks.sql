-- Quota warnings (issue 30): one row per (user, scope, model, kind, window, window start,
-- threshold, shadow) whose count crossed a `warnAt` threshold, inserted ON CONFLICT DO NOTHING
-- by whichever companion saw the crossing first: the webhook event is queued only when the
-- insert happened, so it fires once per window per threshold across companions and restarts.
-- `subject_sha256` is the hex SHA-256 of the user's name (the event carries the keyed
-- pseudonym). `delivery` ends as delivered, dead or dropped. Rows are deleted a day after their
-- window ended (no count of that window is leased any more).

CREATE TABLE quota_warnings (
    id             UUID        PRIMARY KEY,
    subject_sha256 TEXT        NOT NULL,
    scope          TEXT        NOT NULL,
    model          TEXT        NOT NULL DEFAULT '',
    kind           TEXT        NOT NULL,
    window_seconds BIGINT      NOT NULL,
    window_start   TIMESTAMPTZ NOT NULL,
    threshold      SMALLINT    NOT NULL,
    shadow         BOOLEAN     NOT NULL DEFAULT FALSE,
    window_end     TIMESTAMPTZ NOT NULL,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    delivery       TEXT        NOT NULL DEFAULT 'pending',
    attempts       INTEGER     NOT NULL DEFAULT 0,
    last_error     TEXT,
    CONSTRAINT quota_warnings_once UNIQUE
        (subject_sha256, scope, model, kind, window_seconds, window_start, threshold, shadow)
);

CREATE INDEX quota_warnings_window_end_idx ON quota_warnings (window_end);

-- The outbox: events not delivered yet (the body exactly as signed and sent, the same at every
-- attempt). A companion claims due rows with FOR UPDATE SKIP LOCKED, pushing next_attempt_at past
-- its attempt's timeout, so one companion sends a row at a time; delivered, dead and dropped
-- rows leave the table (their outcome stays in quota_warnings.delivery).
CREATE TABLE quota_webhook_outbox (
    id              UUID        PRIMARY KEY,
    body            TEXT        NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    attempts        INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error      TEXT
);

CREATE INDEX quota_webhook_outbox_due_idx ON quota_webhook_outbox (next_attempt_at);
CREATE INDEX quota_webhook_outbox_created_idx ON quota_webhook_outbox (created_at);

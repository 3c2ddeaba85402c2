-- Chargeback in the usage ledger (issue 30): each row carries the organisation and cost centre
-- of the subscription it ran under (its tokenMetadata when the usage was reported; '' outside
-- subscriptions) and its cost (tokens x the subscription model's billingRate.perToken, exact
-- NUMERIC, 0 without a rate). Not part of the key, so the previous release's statements keep
-- working: a row keeps the labels of the hour's first report (a day's, once rolled up).

ALTER TABLE usage_hourly ADD COLUMN organization TEXT NOT NULL DEFAULT '';
ALTER TABLE usage_hourly ADD COLUMN cost_center TEXT NOT NULL DEFAULT '';
ALTER TABLE usage_hourly ADD COLUMN cost NUMERIC NOT NULL DEFAULT 0;
ALTER TABLE usage_daily ADD COLUMN organization TEXT NOT NULL DEFAULT '';
ALTER TABLE usage_daily ADD COLUMN cost_center TEXT NOT NULL DEFAULT '';
ALTER TABLE usage_daily ADD COLUMN cost NUMERIC NOT NULL DEFAULT 0;

-- An API key's own limits, set when it is minted (issue 30: per-key limits and budgets at mint):
-- the `limits` object of the mint request (requests, tokens, budgets per window, as a tier's),
-- or NULL for a key without. Additive: the previous release ignores the column.
ALTER TABLE api_keys ADD COLUMN limits JSONB;

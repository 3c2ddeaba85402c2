-- Cached input tokens in the usage ledger (issue 15): the part of prompt_tokens the provider
-- served from its prompt cache (OpenAI prompt_tokens_details.cached_tokens, Responses
-- input_tokens_details.cached_tokens, Anthropic cache_read_input_tokens). Reports from filters
-- that do not send it add 0.

ALTER TABLE usage_hourly ADD COLUMN cached_input_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_daily ADD COLUMN cached_input_tokens BIGINT NOT NULL DEFAULT 0;

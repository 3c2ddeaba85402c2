-- The usage ledger names API keys by the key API's id (issue 26): api_keys.id, the UUID of
-- GET /v1/api-keys/{id}, where the gateway reports the key id of the key's secret
-- (sk-oai-<key_id>_...). Rows written before are mapped here; the companion maps each report
-- from now on. A key id whose key is gone (an ephemeral key deleted by the cleanup) stays as it
-- was. The mapping is one to one (key_id and id are both unique, a UUID never looks like a key
-- id), so no two rows of one table become the same row.

UPDATE usage_hourly AS u SET key_id = a.id::text
FROM api_keys AS a
WHERE u.key_id <> '' AND u.key_id = a.key_id;

UPDATE usage_daily AS u SET key_id = a.id::text
FROM api_keys AS a
WHERE u.key_id <> '' AND u.key_id = a.key_id;

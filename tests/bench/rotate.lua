-- two-replica: every request carries the next of a handful of API keys (one per user), in turn,
-- so every subject is busy at every gateway. The keys are the lines of BENCH_KEYS_FILE; this wrk
-- starts at line BENCH_KEY_START (the second gateway's wrk starts at another key).
-- Environment: BENCH_BODY_FILE, BENCH_KEYS_FILE, BENCH_KEY_START.
package.path = (os.getenv("BENCH_LUA_DIR") or ".") .. "/?.lua;" .. package.path
local report = require("report")

local f = assert(io.open(assert(os.getenv("BENCH_BODY_FILE"), "BENCH_BODY_FILE not set"), "rb"))
local body = f:read("*a")
f:close()
local auth = {}
local keys_file = assert(os.getenv("BENCH_KEYS_FILE"), "BENCH_KEYS_FILE not set")
for line in io.lines(keys_file) do
  if line ~= "" then auth[#auth + 1] = "Bearer " .. line end
end
assert(#auth > 0, "BENCH_KEYS_FILE has no keys")
local next_key = tonumber(os.getenv("BENCH_KEY_START") or "0") or 0
local headers = { ["Content-Type"] = "application/json" }

request = function()
  headers["Authorization"] = auth[(next_key % #auth) + 1]
  next_key = next_key + 1
  return wrk.format("POST", nil, headers, body)
end

done = report.done

-- filter-miss: every request carries an API key the filter has not cached yet. The keys are
-- fixed-width lines (68 characters + newline) in BENCH_KEYS_FILE; this run starts at line
-- BENCH_KEY_OFFSET and uses each key once. When the file runs out the thread stops (the
-- harness gives each run more keys than it can use, and checks).
-- Environment: BENCH_BODY_FILE, BENCH_KEYS_FILE, BENCH_KEY_OFFSET.
package.path = (os.getenv("BENCH_LUA_DIR") or ".") .. "/?.lua;" .. package.path
local report = require("report")

local LINE = 69
local f = assert(io.open(assert(os.getenv("BENCH_BODY_FILE"), "BENCH_BODY_FILE not set"), "rb"))
local body = f:read("*a")
f:close()
local keys = assert(io.open(assert(os.getenv("BENCH_KEYS_FILE"), "BENCH_KEYS_FILE not set"), "rb"))
keys:seek("set", tonumber(os.getenv("BENCH_KEY_OFFSET") or "0") * LINE)
local headers = { ["Content-Type"] = "application/json" }

request = function()
  local key = keys:read("*l")
  if not key then
    wrk.thread:stop()
    key = "exhausted"
  end
  headers["Authorization"] = "Bearer " .. key
  return wrk.format("POST", nil, headers, body)
end

done = report.done

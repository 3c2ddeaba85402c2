-- One fixed POST (the same request every time), for the direct, envoy, filter-cached and
-- filter-stream variants and the companion's authenticate endpoint.
-- Environment: BENCH_BODY_FILE (request body), BENCH_AUTH (Authorization header value, optional),
-- BENCH_HEADERS (extra "name: value" lines separated by "|", optional).
package.path = (os.getenv("BENCH_LUA_DIR") or ".") .. "/?.lua;" .. package.path
local report = require("report")

local f = assert(io.open(assert(os.getenv("BENCH_BODY_FILE"), "BENCH_BODY_FILE not set"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
local auth = os.getenv("BENCH_AUTH")
if auth and auth ~= "" then
  wrk.headers["Authorization"] = auth
end
local extra = os.getenv("BENCH_HEADERS")
if extra and extra ~= "" then
  for line in string.gmatch(extra, "[^|]+") do
    local name, value = string.match(line, "^%s*([^:]+):%s*(.-)%s*$")
    if name then wrk.headers[name] = value end
  end
end

done = report.done

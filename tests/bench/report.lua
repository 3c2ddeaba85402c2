-- Shared by the benchmark's wrk scripts: one machine-readable line at the end of a run.
-- Latencies are in microseconds; `status` counts non-2xx/3xx answers (a valid run has 0).
local M = {}

function M.done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests":%d,"duration_us":%d,"bytes":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d,' ..
    '"mean_us":%.1f,"max_us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}\n',
    summary.requests, summary.duration, summary.bytes,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9),
    latency.mean, latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end

return M

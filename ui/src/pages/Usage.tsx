import { useCallback, useEffect, useState } from "react";
import { ApiError, call, type UsageRow } from "../api";
import type { Ctx } from "../App";
import { ErrorBox, NotYet, asApiError } from "../widgets";
import { StackedBars, addDecimal } from "../charts";

function isoDay(d: Date): string {
  return d.toISOString().slice(0, 10);
}

/** Requests the gateway refused for the row, all reasons together. */
function refusedCount(r: UsageRow): number {
  return Object.values(r.refused ?? {}).reduce((s, n) => s + n, 0);
}

/** The reasons behind the count, for its tooltip: `rate_limit_exceeded: 2, …`. */
function refusedReasons(r: UsageRow): string {
  return Object.entries(r.refused ?? {})
    .map(([reason, n]) => `${reason}: ${n}`)
    .join(", ");
}

/** Tokens and spend per day by model, from `GET /v1/usage?from=&to=&groupBy=day`. */
export function UsagePage({ ctx }: { ctx: Ctx }) {
  const today = new Date();
  const [from, setFrom] = useState(isoDay(new Date(today.getTime() - 6 * 86_400_000)));
  const [to, setTo] = useState(isoDay(today));
  const [rows, setRows] = useState<UsageRow[] | null>(null);
  const [error, setError] = useState<ApiError | null>(null);

  const load = useCallback(async () => {
    setError(null);
    setRows(null);
    try {
      const q = new URLSearchParams({ from, to, groupBy: "day" });
      const r = await call<{ data: UsageRow[] }>(ctx.prefix, ctx.token, "GET", `/v1/usage?${q}`);
      setRows(r.data ?? []);
    } catch (e) {
      setError(asApiError(e));
    }
  }, [ctx.prefix, ctx.token, from, to]);

  useEffect(() => {
    void load();
  }, [load]);

  const days = [...new Set((rows ?? []).map((r) => r.day))].sort();
  const models = [...new Set((rows ?? []).map((r) => r.model))].sort();
  const total = (r: UsageRow) => r.promptTokens + r.completionTokens;
  const cell = (d: string, m: string) => (rows ?? []).filter((r) => r.day === d && r.model === m);
  const tokenRows = days.map((d) => ({
    label: d,
    parts: models.map((m) => String(cell(d, m).reduce((s, r) => s + total(r), 0))),
  }));
  const spendRows = days.map((d) => ({
    label: d,
    parts: models.map((m) => cell(d, m).reduce((s, r) => addDecimal(s, r.cost ?? "0"), "0")),
  }));
  const spent = spendRows.some((r) => r.parts.some((p) => p !== "0"));
  return (
    <>
      <h2>My usage</h2>
      <div className="filters">
        <label>
          From <input id="usage-from" type="date" value={from} onChange={(e) => setFrom(e.target.value)} />
        </label>
        <label>
          To <input id="usage-to" type="date" value={to} onChange={(e) => setTo(e.target.value)} />
        </label>
      </div>
      {error?.status === 404 ? (
        <NotYet what="Usage" />
      ) : (
        <ErrorBox error={error} />
      )}
      {rows && rows.length === 0 && <p id="usage-empty" className="muted">No usage in this period.</p>}
      {rows && rows.length > 0 && (
        <section className="card">
          <h3>Tokens per day</h3>
          <StackedBars id="usage-chart" series={models} rows={tokenRows} format={(t) => Number(t).toLocaleString()} />
          {spent && (
            <>
              <h3>Spend per day</h3>
              <StackedBars id="spend-chart" series={models} rows={spendRows} format={(t) => t} />
            </>
          )}
          <div className="table-scroll">
            <table id="usage-table">
              <thead>
                <tr>
                  <th>Day</th>
                  <th>Model</th>
                  <th>Requests</th>
                  <th>Prompt tokens</th>
                  <th>Completion tokens</th>
                  <th>Total</th>
                  <th>Refused</th>
                  <th>Cached input tokens</th>
                  <th>Cost</th>
                </tr>
              </thead>
              <tbody>
                {days.flatMap((d) =>
                  models.flatMap((m) =>
                    (rows ?? [])
                      .filter((r) => r.day === d && r.model === m)
                      .map((r) => (
                        <tr key={`${d}/${m}`}>
                          <td>{d}</td>
                          <td>{m}</td>
                          <td>{r.requests.toLocaleString()}</td>
                          <td>{r.promptTokens.toLocaleString()}</td>
                          <td>{r.completionTokens.toLocaleString()}</td>
                          <td>{total(r).toLocaleString()}</td>
                          <td className="refused" title={refusedReasons(r)}>{refusedCount(r).toLocaleString()}</td>
                          <td>{(r.cachedInputTokens ?? 0).toLocaleString()}</td>
                          <td className="cost">{r.cost ?? "0"}</td>
                        </tr>
                      )),
                  ),
                )}
              </tbody>
            </table>
          </div>
        </section>
      )}
    </>
  );
}

import { useState } from "react";
import { ApiError, call } from "../api";
import type { Ctx } from "../App";
import { StackedBars, addDecimal } from "../charts";
import { ErrorBox, asApiError } from "../widgets";

/** `GET /v1/usage?groupBy=organization|costCenter|subscription` rows (chargeback). */
interface SpendRow {
  organization?: string;
  costCenter?: string;
  subscription?: string;
  requests: number;
  promptTokens: number;
  completionTokens: number;
  cost?: string;
}

type Grouping = "organization" | "costCenter" | "subscription";
const LABELS: Record<Grouping, string> = {
  organization: "Organisation",
  costCenter: "Cost centre",
  subscription: "Subscription",
};

function isoDay(d: Date): string {
  return d.toISOString().slice(0, 10);
}

/** Admins: everyone's spend by organisation, cost centre or subscription over a period. */
export function SpendByGroup({ ctx }: { ctx: Ctx }) {
  const today = new Date();
  const [from, setFrom] = useState(isoDay(new Date(today.getTime() - 29 * 86_400_000)));
  const [to, setTo] = useState(isoDay(today));
  const [groupBy, setGroupBy] = useState<Grouping>("organization");
  const [rows, setRows] = useState<SpendRow[] | null>(null);
  const [shown, setShown] = useState<Grouping>("organization");
  const [error, setError] = useState<ApiError | null>(null);

  const load = async () => {
    setError(null);
    try {
      const q = new URLSearchParams({ from, to, groupBy, user: "*" });
      const r = await call<{ data: SpendRow[] }>(ctx.prefix, ctx.token, "GET", `/v1/usage?${q}`);
      setRows(r.data ?? []);
      setShown(groupBy);
    } catch (e) {
      setRows(null);
      setError(asApiError(e));
    }
  };

  const name = (r: SpendRow) => r[shown] || "(none)";
  const sorted = [...(rows ?? [])].sort((a, b) => Number(b.cost ?? "0") - Number(a.cost ?? "0"));
  const total = sorted.reduce((s, r) => addDecimal(s, r.cost ?? "0"), "0");
  return (
    <>
      <h2>Spend</h2>
      <form
        className="filters"
        onSubmit={(e) => {
          e.preventDefault();
          void load();
        }}
      >
        <label>
          By{" "}
          <select id="spend-group" value={groupBy} onChange={(e) => setGroupBy(e.target.value as Grouping)}>
            {(Object.keys(LABELS) as Grouping[]).map((g) => (
              <option key={g} value={g}>{LABELS[g]}</option>
            ))}
          </select>
        </label>
        <label>
          From <input id="spend-from" type="date" value={from} onChange={(e) => setFrom(e.target.value)} />
        </label>
        <label>
          To <input id="spend-to" type="date" value={to} onChange={(e) => setTo(e.target.value)} />
        </label>
        <button id="spend-load" type="submit">Show spend</button>
      </form>
      <ErrorBox error={error} />
      {rows && rows.length === 0 && <p id="spend-empty" className="muted">No usage in this period.</p>}
      {rows && rows.length > 0 && (
        <section className="card">
          <h3>
            Spend by {LABELS[shown].toLowerCase()}: {total}
          </h3>
          <StackedBars
            id="spend-by-group-chart"
            series={["cost"]}
            rows={sorted.map((r) => ({ label: name(r), parts: [r.cost ?? "0"] }))}
            format={(t) => t}
          />
          <div className="table-scroll">
            <table id="spend-table">
              <thead>
                <tr>
                  <th>{LABELS[shown]}</th>
                  <th>Requests</th>
                  <th>Prompt tokens</th>
                  <th>Completion tokens</th>
                  <th>Cost</th>
                </tr>
              </thead>
              <tbody>
                {sorted.map((r) => (
                  <tr key={name(r)}>
                    <td>{name(r)}</td>
                    <td>{r.requests.toLocaleString()}</td>
                    <td>{r.promptTokens.toLocaleString()}</td>
                    <td>{r.completionTokens.toLocaleString()}</td>
                    <td className="cost">{r.cost ?? "0"}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          </div>
        </section>
      )}
    </>
  );
}

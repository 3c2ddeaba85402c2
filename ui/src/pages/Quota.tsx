import { useEffect, useState } from "react";
import { ApiError, call, fmtDate, type QuotaRow } from "../api";
import type { Ctx } from "../App";
import { ErrorBox, NotYet, asApiError } from "../widgets";

/** What is left of each limit now, from `GET /v1/quota`; the tier's configured limits below. */
export function QuotaPage({ ctx }: { ctx: Ctx }) {
  const [rows, setRows] = useState<QuotaRow[] | null>(null);
  const [error, setError] = useState<ApiError | null>(null);
  useEffect(() => {
    call<{ data: QuotaRow[] }>(ctx.prefix, ctx.token, "GET", "/v1/quota")
      .then((r) => setRows(r.data ?? []))
      .catch((e) => setError(asApiError(e)));
  }, [ctx.prefix, ctx.token]);
  const tier = ctx.tiers.find((t) => t.current);
  return (
    <>
      <h2>My remaining quota</h2>
      {error?.status === 404 ? <NotYet what="Remaining quota" /> : <ErrorBox error={error} />}
      {rows && rows.length === 0 && <p className="muted">No limits apply to you.</p>}
      {rows && rows.length > 0 && (
        <section className="card">
          <h3>Now</h3>
          <div className="table-scroll">
            <table id="quota-table">
              <thead>
                <tr>
                  <th>Limit</th>
                  <th>Window</th>
                  <th>Used</th>
                  <th>Remaining</th>
                  <th />
                  <th>Resets</th>
                  <th>Warning</th>
                </tr>
              </thead>
              <tbody>
                {rows.map((r) => (
                  <tr key={`${r.kind}/${r.window}/${r.model ?? ""}/${r.scope ?? ""}`} className={r.amounts ? "money" : undefined}>
                    <td>
                      {r.amounts ? `${r.amounts.limit} spend` : `${r.limit.toLocaleString()} ${r.kind}`}
                      {r.model ? ` on ${r.model}` : ""}
                      {r.pool ? " · shared by the subscription's users" : ""}
                      {r.scope ? ` · scope ${r.scope}` : ""}
                    </td>
                    <td>{r.window}</td>
                    <td>{r.amounts ? r.amounts.used : r.used.toLocaleString()}</td>
                    <td>{r.amounts ? r.amounts.remaining : r.remaining.toLocaleString()}</td>
                    <td className="meter-cell">
                      <span className="meter">
                        <span style={{ width: `${Math.min(100, (100 * r.used) / Math.max(1, r.limit))}%` }} />
                      </span>
                    </td>
                    <td>{fmtDate(r.resetsAt)}</td>
                    <td className={r.warning ? "warning" : undefined}>
                      {r.warning ? `past ${r.warning}%` : ""}
                      {r.projectedExhaustionAt ? ` · runs out ${fmtDate(r.projectedExhaustionAt)}` : ""}
                    </td>
                  </tr>
                ))}
              </tbody>
            </table>
          </div>
        </section>
      )}
      {tier && (
        <section className="card" id="tier-limits">
          <h3>Your tier: {tier.displayName ?? tier.name}</h3>
          {tier.description && <p>{tier.description}</p>}
          <ul>
            {(tier.limits.requests ?? []).map((l) => (
              <li key={`r${l.window}`}>
                {l.limit.toLocaleString()} requests per {l.window}
              </li>
            ))}
            {(tier.limits.tokens ?? []).map((l) => (
              <li key={`t${l.window}`}>
                {l.limit.toLocaleString()} tokens per {l.window}
              </li>
            ))}
            {(tier.limits.budgets ?? []).filter((b) => !b.shadow).map((b) => (
              <li key={`b${b.window}`}>
                {b.amount} spend per {b.window}
              </li>
            ))}
          </ul>
          <p className="muted">Models: {tier.models.join(", ") || "none"}</p>
        </section>
      )}
    </>
  );
}

import { useState } from "react";
import { ApiError, call, type ApiKey } from "../api";
import type { Ctx } from "../App";
import { ErrorBox, asApiError } from "../widgets";
import { KeyTable } from "./Keys";
import { SpendByGroup } from "./Spend";

/** Admins: anyone's keys (search by username; empty = everyone), revoking all of a user's, and
 *  everyone's spend by organisation, cost centre or subscription. */
export function AdminPage({ ctx }: { ctx: Ctx }) {
  const [username, setUsername] = useState("");
  const [searched, setSearched] = useState<string | null>(null);
  const [activeOnly, setActiveOnly] = useState(true);
  const [keys, setKeys] = useState<ApiKey[] | null>(null);
  const [error, setError] = useState<ApiError | null>(null);
  const [notice, setNotice] = useState<string | null>(null);
  const [confirmBulk, setConfirmBulk] = useState(false);

  const search = async (user: string) => {
    setError(null);
    setNotice(null);
    try {
      const filters: Record<string, unknown> = { includeEphemeral: true };
      if (user) filters.username = user;
      if (activeOnly) filters.status = ["active"];
      const r = await call<{ data: ApiKey[] }>(ctx.prefix, ctx.token, "POST", "/v1/api-keys/search", {
        filters,
        sort: { by: "created_at", order: "desc" },
        pagination: { limit: 100, offset: 0 },
      });
      setKeys(r.data);
      setSearched(user);
    } catch (e) {
      setKeys(null);
      setError(asApiError(e));
    }
  };

  const bulkRevoke = async () => {
    if (!searched) return;
    setError(null);
    try {
      const r = await call<{ revokedCount: number; message: string }>(
        ctx.prefix, ctx.token, "POST", "/v1/api-keys/bulk-revoke", { username: searched },
      );
      setNotice(r.message || `revoked ${r.revokedCount} keys`);
      await search(searched);
      setNotice(r.message || `revoked ${r.revokedCount} keys`);
    } catch (e) {
      setError(asApiError(e));
    }
    setConfirmBulk(false);
  };

  return (
    <>
      <h2>Keys by user</h2>
      <p className="muted">For administrators: other users get the API's refusal.</p>
      <form
        className="filters"
        onSubmit={(e) => {
          e.preventDefault();
          void search(username.trim());
        }}
      >
        <input id="admin-username" placeholder="username (empty: everyone)" value={username} onChange={(e) => setUsername(e.target.value)} />
        <label className="check">
          <input id="admin-active-only" type="checkbox" checked={activeOnly} onChange={(e) => setActiveOnly(e.target.checked)} />
          active only
        </label>
        <button id="admin-search" type="submit">Search</button>
      </form>
      <ErrorBox error={error} />
      {notice && <p className="notice" id="admin-notice">{notice}</p>}
      {keys && (
        <section className="card">
          <h3>
            {keys.length} key{keys.length === 1 ? "" : "s"}
            {searched ? ` of ${searched}` : ""}
          </h3>
          <KeyTable keys={keys} ctx={ctx} showUser onChanged={() => void search(searched ?? "")} />
          {searched && keys.some((k) => k.status === "active") &&
            (confirmBulk ? (
              <p>
                <button id="bulk-revoke-confirm" className="danger" onClick={() => void bulkRevoke()}>
                  Revoke every active key of {searched}
                </button>{" "}
                <button className="link" onClick={() => setConfirmBulk(false)}>cancel</button>
              </p>
            ) : (
              <button id="bulk-revoke" className="secondary" onClick={() => setConfirmBulk(true)}>
                Revoke all of {searched}'s keys…
              </button>
            ))}
        </section>
      )}
      <SpendByGroup ctx={ctx} />
    </>
  );
}

import { useCallback, useEffect, useState } from "react";
import { ApiError, call, fmtDate, type ApiKey, type KeyLimits, type MintedKey, type Subscription } from "../api";
import type { Ctx } from "../App";
import { CopyButton, ErrorBox, asApiError } from "../widgets";

const EXPIRIES = [
  ["1h", "1 hour"],
  ["1d", "1 day"],
  ["7d", "7 days"],
  ["30d", "30 days"],
  ["", "the maximum (90 days by default)"],
] as const;

const STATUSES = ["active", "expired", "revoked"] as const;

export function KeysPage({ ctx }: { ctx: Ctx }) {
  const [minted, setMinted] = useState<MintedKey | null>(null);
  const [reload, setReload] = useState(0);
  return (
    <>
      <h2>My API keys</h2>
      <MintForm ctx={ctx} onMinted={(k) => { setMinted(k); setReload((n) => n + 1); }} />
      {minted && <ShownOnce minted={minted} onDone={() => setMinted(null)} />}
      <KeyList ctx={ctx} reload={reload} />
    </>
  );
}

function MintForm({ ctx, onMinted }: { ctx: Ctx; onMinted: (k: MintedKey) => void }) {
  const [name, setName] = useState("");
  const [description, setDescription] = useState("");
  const [expiresIn, setExpiresIn] = useState("30d");
  const [tier, setTier] = useState("");
  const [subscription, setSubscription] = useState("");
  // This key's own limits per day (empty: none beyond its tier's or subscription's).
  const [requestsPerDay, setRequestsPerDay] = useState("");
  const [tokensPerDay, setTokensPerDay] = useState("");
  const [subscriptions, setSubscriptions] = useState<Subscription[]>([]);
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);
  const qualified = ctx.tiers.filter((t) => t.qualified);
  useEffect(() => {
    // The caller's subscriptions; none (or a companion without the listing): no select.
    call<Subscription[]>(ctx.prefix, ctx.token, "GET", "/v1/subscriptions")
      .then((r) => setSubscriptions(Array.isArray(r) ? r : []))
      .catch(() => setSubscriptions([]));
  }, [ctx.prefix, ctx.token]);
  return (
    <form
      className="card mint"
      onSubmit={async (e) => {
        e.preventDefault();
        setBusy(true);
        setError(null);
        try {
          const body: Record<string, unknown> = { name: name.trim() };
          if (description.trim()) body.description = description.trim();
          if (expiresIn) body.expiresIn = expiresIn;
          if (tier) body.tier = tier;
          if (subscription) body.subscription = subscription;
          const limits = keyLimits(requestsPerDay, tokensPerDay);
          if (limits) body.limits = limits;
          onMinted(await call<MintedKey>(ctx.prefix, ctx.token, "POST", "/v1/api-keys", body));
          setName("");
          setDescription("");
          setRequestsPerDay("");
          setTokensPerDay("");
        } catch (err) {
          setError(asApiError(err));
        } finally {
          setBusy(false);
        }
      }}
    >
      <h3>Mint a key</h3>
      <label>
        Name
        <input id="mint-name" value={name} onChange={(e) => setName(e.target.value)} placeholder="laptop" />
      </label>
      <label>
        Description
        <input id="mint-description" value={description} onChange={(e) => setDescription(e.target.value)} placeholder="optional" />
      </label>
      <label>
        Expires in
        <select id="mint-expiry" value={expiresIn} onChange={(e) => setExpiresIn(e.target.value)}>
          {EXPIRIES.map(([v, label]) => (
            <option key={v} value={v}>{label}</option>
          ))}
        </select>
      </label>
      <label>
        Tier
        <select id="mint-tier" value={tier} onChange={(e) => setTier(e.target.value)}>
          <option value="">follow my highest tier</option>
          {qualified.map((t) => (
            <option key={t.name} value={t.name}>{t.displayName ?? t.name}</option>
          ))}
        </select>
      </label>
      {subscriptions.length > 0 && (
        <label>
          Subscription
          <select id="mint-subscription" value={subscription} onChange={(e) => setSubscription(e.target.value)}>
            <option value="">default</option>
            {subscriptions.map((s) => (
              <option key={s.subscription_id_header} value={s.subscription_id_header}>
                {s.display_name ?? s.subscription_id_header}
              </option>
            ))}
          </select>
        </label>
      )}
      <label title="This key alone: at most this many requests a day, whatever its tier or subscription allows">
        Requests per day (this key)
        <input id="mint-requests-per-day" inputMode="numeric" value={requestsPerDay}
          onChange={(e) => setRequestsPerDay(e.target.value)} placeholder="no limit of its own" />
      </label>
      <label title="This key alone: at most this many tokens a day">
        Tokens per day (this key)
        <input id="mint-tokens-per-day" inputMode="numeric" value={tokensPerDay}
          onChange={(e) => setTokensPerDay(e.target.value)} placeholder="no limit of its own" />
      </label>
      <button id="mint" type="submit" disabled={busy}>Mint</button>
      <ErrorBox error={error} />
    </form>
  );
}

/** The mint request's `limits` from the two per-day fields; none when both are empty (a value
 * that is not a whole number is sent as typed, so the server's 400 names the field). */
function keyLimits(requests: string, tokens: string): Record<string, unknown> | null {
  const limit = (v: string) => {
    const t = v.trim().replace(/[ ,_]/g, "");
    return /^\d+$/.test(t) ? Number(t) : t;
  };
  const out: Record<string, unknown> = {};
  if (requests.trim()) out.requests = [{ limit: limit(requests), window: "1d" }];
  if (tokens.trim()) out.tokens = [{ limit: limit(tokens), window: "1d" }];
  return Object.keys(out).length > 0 ? out : null;
}

/** A key's own limits as text: `50 requests / 1d · 10,000 tokens / 1d`. */
function limitsText(l: KeyLimits | null | undefined): string | null {
  if (!l) return null;
  const parts = [
    ...(l.requests ?? []).map((x) => `${x.limit.toLocaleString("en-US")} requests / ${x.window}`),
    ...(l.tokens ?? []).map((x) => `${x.limit.toLocaleString("en-US")} tokens / ${x.window}`),
    ...(l.budgets ?? []).map((x) => `${x.amount} / ${x.window}`),
  ];
  return parts.length > 0 ? parts.join(" · ") : null;
}

function ShownOnce({ minted, onDone }: { minted: MintedKey; onDone: () => void }) {
  return (
    <div className="card once" id="new-key-panel">
      <h3>Your new key “{minted.name}”</h3>
      <p>
        Copy it now: <b>it is shown only once</b> and cannot be shown again. Tier{" "}
        <b>{minted.tier}</b>, expires {fmtDate(minted.expiresAt)}.
      </p>
      <div className="secret">
        <code id="new-key">{minted.key}</code>
        <CopyButton text={minted.key} id="copy-new-key" />
      </div>
      <button id="new-key-done" className="secondary" onClick={onDone}>I have saved it</button>
    </div>
  );
}

function KeyList({ ctx, reload }: { ctx: Ctx; reload: number }) {
  const [status, setStatus] = useState<string[]>(["active"]);
  const [includeEphemeral, setIncludeEphemeral] = useState(false);
  const [query, setQuery] = useState("");
  const [keys, setKeys] = useState<ApiKey[] | null>(null);
  const [error, setError] = useState<ApiError | null>(null);
  const [tick, setTick] = useState(0);

  const load = useCallback(async () => {
    setError(null);
    try {
      const r = await call<{ data: ApiKey[] }>(ctx.prefix, ctx.token, "POST", "/v1/api-keys/search", {
        filters: { status, includeEphemeral },
        sort: { by: "created_at", order: "desc" },
        pagination: { limit: 100, offset: 0 },
      });
      setKeys(r.data);
    } catch (e) {
      setError(asApiError(e));
    }
  }, [ctx.prefix, ctx.token, status, includeEphemeral]);

  useEffect(() => {
    void load();
  }, [load, reload, tick]);

  const q = query.trim().toLowerCase();
  const shown = (keys ?? []).filter(
    (k) => !q || k.name.toLowerCase().includes(q) || k.keyPrefix.toLowerCase().includes(q),
  );
  return (
    <section className="card">
      <h3>Keys</h3>
      <div className="filters">
        <input id="key-search" placeholder="search name or prefix" value={query} onChange={(e) => setQuery(e.target.value)} />
        {STATUSES.map((s) => (
          <label key={s} className="check">
            <input
              type="checkbox"
              id={`status-${s}`}
              checked={status.includes(s)}
              onChange={(e) => setStatus(e.target.checked ? [...status, s] : status.filter((x) => x !== s))}
            />
            {s}
          </label>
        ))}
        <label className="check">
          <input type="checkbox" checked={includeEphemeral} onChange={(e) => setIncludeEphemeral(e.target.checked)} />
          ephemeral
        </label>
      </div>
      <ErrorBox error={error} />
      <KeyTable keys={shown} ctx={ctx} onChanged={() => setTick((n) => n + 1)} showUser={false} />
      {keys && shown.length === 0 && <p className="muted" id="no-keys">No keys match.</p>}
    </section>
  );
}

/** A table of keys, each active one with a two-step Revoke. Shared with the admin page. */
export function KeyTable(props: { keys: ApiKey[]; ctx: Ctx; onChanged: () => void; showUser: boolean }) {
  const [confirming, setConfirming] = useState<string | null>(null);
  const [error, setError] = useState<ApiError | null>(null);
  if (props.keys.length === 0) return <ErrorBox error={error} />;
  return (
    <>
      <ErrorBox error={error} />
      <div className="table-scroll">
        <table className="keys">
          <thead>
            <tr>
              {props.showUser && <th>User</th>}
              <th>Name</th>
              <th>Prefix</th>
              <th>Tier</th>
              <th>Subscription</th>
              <th>Own limits</th>
              <th>Created</th>
              <th>Expires</th>
              <th>Last used</th>
              <th>Status</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {props.keys.map((k) => (
              <tr key={k.id} data-key-id={k.id} data-key-name={k.name}>
                {props.showUser && <td data-label="User">{k.username}</td>}
                <td className="name" data-label="Name" title={k.description ?? ""}>{k.name}</td>
                <td data-label="Prefix"><code>{k.keyPrefix}</code></td>
                <td data-label="Tier">{k.tier ?? <span className="muted">highest</span>}</td>
                <td className="subscription" data-label="Subscription">{k.subscription ?? <span className="muted">—</span>}</td>
                <td className="limits" data-label="Own limits">{limitsText(k.limits) ?? <span className="muted">—</span>}</td>
                <td data-label="Created">{fmtDate(k.creationDate)}</td>
                <td data-label="Expires">{fmtDate(k.expirationDate)}</td>
                <td data-label="Last used">{fmtDate(k.lastUsedAt)}</td>
                <td data-label="Status"><span className={`status ${k.status}`}>{k.status}</span></td>
                <td className="actions">
                  {k.status === "active" &&
                    (confirming === k.id ? (
                      <>
                        <button
                          className="danger revoke-confirm"
                          onClick={async () => {
                            setError(null);
                            try {
                              await call(props.ctx.prefix, props.ctx.token, "DELETE", `/v1/api-keys/${encodeURIComponent(k.id)}`);
                            } catch (e) {
                              setError(asApiError(e));
                            }
                            setConfirming(null);
                            props.onChanged();
                          }}
                        >
                          Confirm revoke
                        </button>
                        <button className="link" onClick={() => setConfirming(null)}>cancel</button>
                      </>
                    ) : (
                      <button className="secondary revoke" onClick={() => setConfirming(k.id)}>Revoke</button>
                    ))}
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      </div>
    </>
  );
}

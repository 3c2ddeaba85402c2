// The companion's public API, called from the page with the signed-in token. Every error the
// API answers is shown as it wrote it (the OpenAI-style `error.message`).

/** Where the app lives: `<prefix>/ui/` (the prefix is `/maas-api` through the gateway, empty
 *  on the companion's own listener). The API is at `<prefix>/v1/…`. */
export function locate(pathname: string): { prefix: string; uiRoot: string; route: string } {
  const at = pathname.indexOf("/ui/");
  if (at < 0) {
    const bare = pathname.endsWith("/ui") ? pathname.slice(0, -3) : "";
    return { prefix: bare, uiRoot: `${bare}/ui/`, route: "" };
  }
  const prefix = pathname.slice(0, at);
  const route = pathname.slice(at + 4).replace(/\/+$/, "");
  return { prefix, uiRoot: `${prefix}/ui/`, route };
}

export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly code: string | null,
  ) {
    super(message);
  }
}

const TOKEN_KEY = "maas.token";

/** The token lives in sessionStorage only: gone when the tab closes. */
export const session = {
  get: (): string | null => sessionStorage.getItem(TOKEN_KEY),
  set: (t: string) => sessionStorage.setItem(TOKEN_KEY, t),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

export async function call<T>(
  prefix: string,
  token: string,
  method: "GET" | "POST" | "DELETE",
  path: string,
  body?: unknown,
): Promise<T> {
  const headers: Record<string, string> = { Authorization: `Bearer ${token}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let resp: Response;
  try {
    resp = await fetch(`${prefix}${path}`, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "omit",
      cache: "no-store",
    });
  } catch (e) {
    throw new ApiError(`network error: ${String(e)}`, 0, null);
  }
  const text = await resp.text();
  let json: unknown = null;
  try {
    json = text ? JSON.parse(text) : null;
  } catch {
    json = null;
  }
  if (!resp.ok) {
    const err = (json as { error?: { message?: unknown; code?: unknown } } | null)?.error;
    const message =
      typeof err?.message === "string" && err.message
        ? err.message
        : `HTTP ${resp.status}${text ? `: ${text.slice(0, 200)}` : ""}`;
    throw new ApiError(message, resp.status, typeof err?.code === "string" ? err.code : null);
  }
  return json as T;
}

// Shapes (companion/README.md, GET /openapi.json).

export interface Tier {
  name: string;
  displayName?: string | null;
  description?: string | null;
  level: number;
  current: boolean;
  qualified: boolean;
  models: string[];
  limits: {
    requests?: { limit: number; window: string }[];
    tokens?: { limit: number; window: string }[];
    /** Money budgets: an exact decimal amount per window. */
    budgets?: { amount: string; window: string; shadow?: boolean }[];
  };
}

export interface ApiKey {
  id: string;
  name: string;
  description?: string | null;
  username: string;
  keyPrefix: string;
  tier?: string | null;
  creationDate: string;
  expirationDate: string;
  lastUsedAt?: string | null;
  revokedAt?: string | null;
  status: string;
  ephemeral: boolean;
  /** The subscription the key is bound to (none: it follows the tiers). */
  subscription?: string | null;
  labels?: Record<string, string>;
  /** The key's own limits, set at mint (counted per key beside its tier's or subscription's). */
  limits?: KeyLimits | null;
}

/** A key's own limits, as minted: requests, tokens and money per window. */
export interface KeyLimits {
  requests?: { limit: number; window: string }[];
  tokens?: { limit: number; window: string }[];
  budgets?: { amount: string; window: string }[];
}

/** `GET /v1/subscriptions` (the reference's item shape, snake_case). */
export interface Subscription {
  subscription_id_header: string;
  subscription_description?: string | null;
  display_name?: string | null;
  priority?: number | null;
  model_refs?: { name: string; namespace?: string | null }[];
}

export interface MintedKey {
  id: string;
  key: string;
  keyPrefix: string;
  name: string;
  tier: string;
  expiresAt: string;
}

/** `GET /v1/models` (the reference's shape). */
export interface ModelEntry {
  id: string;
  owned_by: string;
  /** The model server answered its readiness probe. */
  ready: boolean;
  /** The model's own URL (its path prefix on the gateway). */
  url?: string | null;
  kind?: string;
  aliases?: string[];
  modelDetails?: { displayName?: string; description?: string; contextWindow?: number } | null;
  subscriptions?: { name: string; displayName?: string | null }[];
}

/** `GET /v1/usage?from=&to=&groupBy=day` */
export interface UsageRow {
  day: string;
  model: string;
  promptTokens: number;
  completionTokens: number;
  requests: number;
  /** Requests the gateway refused, by reason. */
  refused?: Record<string, number>;
  /** The part of `promptTokens` served from the provider's prompt cache. */
  cachedInputTokens?: number;
  /** Tokens × the subscription's billing rate (an exact decimal string). */
  cost?: string;
}

/** `GET /v1/quota` */
export interface QuotaRow {
  kind: string;
  window: string;
  limit: number;
  used: number;
  remaining: number;
  resetsAt?: string | null;
  /** A key bound to a subscription: the model this window is for. */
  model?: string | null;
  /** The subscription's limits are one pool for all its users: `used` is everyone's. */
  pool?: boolean;
  /** A scope's window (the policy's `scopes[].name`), counted beside the caller's own. */
  scope?: string | null;
  percentUsed?: number;
  /** The highest warning threshold (percent) passed. */
  warning?: number | null;
  burnRatePerHour?: number;
  /** When the limit is reached at the current rate, if before the reset. */
  projectedExhaustionAt?: string | null;
  /** Kind `cost` (a money budget, counted in nano-units): the figures as exact decimals. */
  amounts?: { limit: string; used: string; remaining: string; burnRatePerHour: string } | null;
}

export function fmtDate(s: string | null | undefined): string {
  if (!s) return "—";
  const d = new Date(s);
  return Number.isNaN(d.getTime()) ? s : d.toLocaleString();
}

export async function copyText(text: string): Promise<boolean> {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    return false;
  }
}

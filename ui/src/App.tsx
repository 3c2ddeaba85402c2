import { useCallback, useEffect, useState } from "react";
import { ApiError, call, locate, session, type Tier } from "./api";
import { KeysPage } from "./pages/Keys";
import { ModelsPage } from "./pages/Models";
import { UsagePage } from "./pages/Usage";
import { QuotaPage } from "./pages/Quota";
import { AdminPage } from "./pages/Admin";
import { ErrorBox } from "./widgets";

const PAGES = [
  { route: "keys", title: "API keys" },
  { route: "models", title: "Models" },
  { route: "usage", title: "Usage" },
  { route: "quota", title: "Quota" },
  { route: "admin", title: "Admin" },
] as const;
type Route = (typeof PAGES)[number]["route"];

function asRoute(r: string): Route {
  return (PAGES.find((p) => p.route === r)?.route ?? "keys") as Route;
}

export interface Ctx {
  prefix: string;
  token: string;
  tiers: Tier[];
}

export function App() {
  const where = locate(window.location.pathname);
  const [route, setRoute] = useState<Route>(asRoute(where.route));
  const [token, setToken] = useState<string | null>(session.get());
  const [tiers, setTiers] = useState<Tier[] | null>(null);
  const [signInError, setSignInError] = useState<ApiError | null>(null);

  useEffect(() => {
    const onPop = () => setRoute(asRoute(locate(window.location.pathname).route));
    window.addEventListener("popstate", onPop);
    return () => window.removeEventListener("popstate", onPop);
  }, []);

  const go = useCallback(
    (r: Route) => {
      window.history.pushState(null, "", `${where.uiRoot}${r}`);
      setRoute(r);
    },
    [where.uiRoot],
  );

  // A token is checked by reading the tiers with it (any API error signs out, with the
  // API's message).
  const signIn = useCallback(
    async (t: string) => {
      setSignInError(null);
      try {
        const list = await call<{ data: Tier[] }>(where.prefix, t, "GET", "/v1/tiers");
        session.set(t);
        setToken(t);
        setTiers(list.data);
      } catch (e) {
        session.clear();
        setToken(null);
        setTiers(null);
        setSignInError(e instanceof ApiError ? e : new ApiError(String(e), 0, null));
      }
    },
    [where.prefix],
  );

  useEffect(() => {
    const t = session.get();
    if (t && tiers === null) void signIn(t);
  }, [signIn, tiers]);

  const signOut = () => {
    session.clear();
    setToken(null);
    setTiers(null);
  };

  if (!token || !tiers) {
    return <SignIn onSignIn={signIn} error={signInError} pending={!!token && !signInError} />;
  }
  const current = tiers.find((t) => t.current);
  const ctx: Ctx = { prefix: where.prefix, token, tiers };
  return (
    <div className="shell">
      <header>
        <span className="brand">MaaS Gateway</span>
        <nav>
          {PAGES.map((p) => (
            <a
              key={p.route}
              id={`nav-${p.route}`}
              href={`${where.uiRoot}${p.route}`}
              className={p.route === route ? "active" : ""}
              onClick={(e) => {
                e.preventDefault();
                go(p.route);
              }}
            >
              {p.title}
            </a>
          ))}
        </nav>
        <span className="who">
          tier <b id="current-tier">{current?.displayName ?? current?.name ?? "none"}</b>
          <button id="sign-out" className="link" onClick={signOut}>
            Sign out
          </button>
        </span>
      </header>
      <main>
        {route === "keys" && <KeysPage ctx={ctx} />}
        {route === "models" && <ModelsPage ctx={ctx} />}
        {route === "usage" && <UsagePage ctx={ctx} />}
        {route === "quota" && <QuotaPage ctx={ctx} />}
        {route === "admin" && <AdminPage ctx={ctx} />}
      </main>
    </div>
  );
}

function SignIn(props: {
  onSignIn: (t: string) => void;
  error: ApiError | null;
  pending: boolean;
}) {
  const [value, setValue] = useState("");
  return (
    <div className="signin">
      <h1>MaaS Gateway</h1>
      <p>
        Sign in with your token: an OpenShift token (<code>oc whoami -t</code>) on a cluster, or a
        local identity token (<code>alice-token</code>, <code>bob-token</code>,{" "}
        <code>carol-token</code>) on the local stack. It is kept in this tab only.
      </p>
      <form
        onSubmit={(e) => {
          e.preventDefault();
          if (value.trim()) props.onSignIn(value.trim());
        }}
      >
        <input
          id="token"
          type="password"
          autoComplete="off"
          placeholder="token"
          value={value}
          onChange={(e) => setValue(e.target.value)}
        />
        <button id="sign-in" type="submit" disabled={!value.trim()}>
          Sign in
        </button>
      </form>
      {props.pending && <p className="muted">Checking the token…</p>}
      <ErrorBox error={props.error} />
    </div>
  );
}

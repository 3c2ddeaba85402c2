import { useState } from "react";
import { ApiError, copyText } from "./api";

/** An API error as the API wrote it. */
export function ErrorBox({ error }: { error: ApiError | null }) {
  if (!error) return null;
  return (
    <div className="error" role="alert">
      <b>{error.status ? `${error.status}` : "error"}</b> {error.message}
      {error.code && <span className="code"> ({error.code})</span>}
    </div>
  );
}

export function CopyButton({ text, id }: { text: string; id?: string }) {
  const [state, setState] = useState<"idle" | "copied" | "failed">("idle");
  return (
    <button
      id={id}
      type="button"
      className="copy"
      onClick={async () => {
        setState((await copyText(text)) ? "copied" : "failed");
        setTimeout(() => setState("idle"), 2000);
      }}
    >
      {state === "idle" ? "Copy" : state === "copied" ? "Copied" : "Select and copy"}
    </button>
  );
}

export function asApiError(e: unknown): ApiError {
  return e instanceof ApiError ? e : new ApiError(String(e), 0, null);
}

/** The page's API answered 404: this gateway does not serve it yet. */
export function NotYet({ what }: { what: string }) {
  return (
    <div className="notyet" id="not-available">
      <b>{what} is not available yet</b> on this gateway: its API answered 404. It will show here
      once the gateway serves it.
    </div>
  );
}

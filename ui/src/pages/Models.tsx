import { useEffect, useState } from "react";
import { ApiError, call, type ModelEntry } from "../api";
import type { Ctx } from "../App";
import { CopyButton, ErrorBox, asApiError } from "../widgets";

/** The one base URL OpenAI clients take for every model (the body's `model` picks it). */
export function oneBaseUrl(): string {
  return `${window.location.origin}/v1`;
}

/** The model's own URL + `/v1` (its path prefix; the reference calls it legacy). */
function modelBaseUrl(m: ModelEntry): string {
  const u = m.url ?? `${window.location.origin}/llm/${m.id}`;
  return `${u.replace(/\/+$/, "")}/v1`;
}

export function curlSnippet(m: ModelEntry): string {
  return `curl -s ${oneBaseUrl()}/chat/completions \\
  -H "Authorization: Bearer $MAAS_API_KEY" \\
  -H 'Content-Type: application/json' \\
  -d '{"model":"${m.id}","messages":[{"role":"user","content":"Hello!"}]}'`;
}

export function pythonSnippet(m: ModelEntry): string {
  return `# pip install openai
import os
from openai import OpenAI

client = OpenAI(base_url="${oneBaseUrl()}", api_key=os.environ["MAAS_API_KEY"])
reply = client.chat.completions.create(
    model="${m.id}",
    messages=[{"role": "user", "content": "Hello!"}],
)
print(reply.choices[0].message.content)`;
}

export function ModelsPage({ ctx }: { ctx: Ctx }) {
  const [models, setModels] = useState<ModelEntry[] | null>(null);
  const [error, setError] = useState<ApiError | null>(null);
  useEffect(() => {
    call<{ data: ModelEntry[] }>(ctx.prefix, ctx.token, "GET", "/v1/models")
      .then((r) => setModels(r.data))
      .catch((e) => setError(asApiError(e)));
  }, [ctx.prefix, ctx.token]);
  return (
    <>
      <h2>Models I may use</h2>
      <p className="muted">
        Put a key from <i>API keys</i> in <code>MAAS_API_KEY</code>, then paste a snippet.
      </p>
      <ErrorBox error={error} />
      {models && models.length > 0 && (
        <section className="card" id="one-base-url">
          <p>
            One base URL for every model <code>{oneBaseUrl()}</code> <CopyButton text={oneBaseUrl()} />
          </p>
          <p className="muted">The request's <code>model</code> picks the model: its id or an alias below.</p>
        </section>
      )}
      {models && models.length === 0 && <p id="no-models">Your tier may use no model.</p>}
      {models?.map((m) => (
        <section className="card model" key={m.id} data-model={m.id}>
          <h3>
            {m.modelDetails?.displayName ?? m.id}{" "}
            <span className={m.ready ? "model-ready ready" : "model-ready unready"}>
              {m.ready ? "ready" : "not ready"}
            </span>{" "}
            <span className="muted">by {m.owned_by}</span>
          </h3>
          {m.modelDetails?.description && <p>{m.modelDetails.description}</p>}
          <p>
            Model id <code>{m.id}</code>
            {(m.aliases ?? []).length > 0 && (
              <>
                {" "}
                · also <span className="model-aliases">{(m.aliases ?? []).join(", ")}</span>
              </>
            )}
            {(m.subscriptions ?? []).length > 0 && (
              <>
                {" "}
                · subscriptions{" "}
                <span className="model-subscriptions">
                  {(m.subscriptions ?? []).map((s) => s.displayName ?? s.name).join(", ")}
                </span>
              </>
            )}
          </p>
          <p>
            Its own URL <code className="model-url">{modelBaseUrl(m)}</code>
          </p>
          <Snippet title="curl" text={curlSnippet(m)} />
          <Snippet title="OpenAI SDK (Python)" text={pythonSnippet(m)} />
        </section>
      ))}
    </>
  );
}

function Snippet({ title, text }: { title: string; text: string }) {
  return (
    <div className="snippet">
      <div className="snippet-head">
        <span>{title}</span>
        <CopyButton text={text} />
      </div>
      <pre>{text}</pre>
    </div>
  );
}

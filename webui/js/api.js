// HTTP client for the KVMem server: models, streamed chat completions, workspaces.
// Every failure becomes an ApiError whose `kind` the page turns into one clear message.

export class ApiError extends Error {
  /** kind: "down" | "auth" | "busy" | "too_long" | "restarting" | "not_found" | "bad_request" | "server" | "stream" */
  constructor(kind, message, { status = 0, code = null, retryAfter = null } = {}) {
    super(message);
    this.kind = kind;
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }
}

function kindOf(status, code) {
  if (status === 401 || status === 403) return "auth";
  if (status === 429) return "busy";
  if (status === 413 || code === "context_length_exceeded") return "too_long";
  if (status === 503) return "restarting";
  if (status === 404) return "not_found";
  if (status >= 400 && status < 500) return "bad_request";
  return "server";
}

/** The ApiError for a non-2xx response carrying (or not) the OpenAI error JSON. */
export async function errorFrom(response) {
  let message = `${response.status} ${response.statusText}`.trim();
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch {
    // A body that is not the error JSON keeps the status line as the message.
  }
  const retry = Number(response.headers.get("Retry-After"));
  return new ApiError(kindOf(response.status, code), message, {
    status: response.status,
    code,
    retryAfter: Number.isFinite(retry) && retry > 0 ? retry : null,
  });
}

/** One sentence for the user about `err` (an ApiError or anything thrown). */
export function errorText(err) {
  if (!(err instanceof ApiError)) return `Something went wrong: ${err.message}`;
  const wait = err.retryAfter ? ` Try again in ${err.retryAfter} s.` : " Try again in a moment.";
  switch (err.kind) {
    case "down":
      return "The KVMem server cannot be reached. Is `kvmem serve` still running?";
    case "auth":
      return `The server needs a valid API key (${err.status}). Enter it in Settings.`;
    case "busy":
      return `The server is busy with other requests (429).${wait}`;
    case "too_long":
      return `This conversation is too long for the server (${err.status || err.code}): ${err.message} Start a new chat or delete this one.`;
    case "restarting":
      return `The engine is restarting (503).${wait}`;
    default:
      return `The server refused the request${err.status ? ` (${err.status})` : ""}: ${err.message}`;
  }
}

export class Api {
  /** base: origin of the server ("" = same origin); apiKey: sent as a Bearer token when set. */
  constructor(base = "", apiKey = "") {
    this.base = base;
    this.apiKey = apiKey;
  }

  headers(extra = {}) {
    const h = { ...extra };
    if (this.apiKey) h.Authorization = `Bearer ${this.apiKey}`;
    return h;
  }

  async request(method, path, { body, signal } = {}) {
    let response;
    try {
      response = await fetch(this.base + path, {
        method,
        signal,
        headers: this.headers(body === undefined ? {} : { "Content-Type": "application/json" }),
        body: body === undefined ? undefined : JSON.stringify(body),
      });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError("down", "The KVMem server cannot be reached.");
    }
    if (!response.ok) throw await errorFrom(response);
    return response;
  }

  /** Model ids served, from GET /v1/models. */
  async models() {
    const body = await (await this.request("GET", "/v1/models")).json();
    return (body.data || []).map((m) => m.id);
  }

  /** The workspace JSON of GET /v1/kvmem/workspaces/{id}. */
  async workspace(id) {
    return (await this.request("GET", `/v1/kvmem/workspaces/${encodeURIComponent(id)}`)).json();
  }

  /** Frees a workspace's storage on the server; a workspace already gone counts as deleted. */
  async deleteWorkspace(id) {
    try {
      await this.request("DELETE", `/v1/kvmem/workspaces/${encodeURIComponent(id)}`);
    } catch (err) {
      if (!(err instanceof ApiError && err.kind === "not_found")) throw err;
    }
  }

  /**
   * Streams POST /v1/chat/completions. Calls onChunk(chunk) for every parsed SSE chunk and
   * resolves when the stream ends ([DONE] or end of body). Aborting `signal` rejects with an
   * AbortError; an error object inside the stream rejects with an ApiError of kind "stream".
   */
  async chatStream(body, onChunk, signal) {
    const response = await this.request("POST", "/v1/chat/completions", { body, signal });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        if (handleEvent(event, onChunk)) return;
      }
    }
    if (buffer.trim()) handleEvent(buffer, onChunk);
  }
}

/** Parses one SSE event; returns true on [DONE]. */
function handleEvent(event, onChunk) {
  const data = event
    .split(/\r?\n/)
    .filter((line) => line.startsWith("data:"))
    .map((line) => line.slice(5).replace(/^ /, ""))
    .join("\n");
  if (!data) return false; // comments (": ping") and empty events
  if (data.trim() === "[DONE]") return true;
  const chunk = JSON.parse(data);
  if (chunk.error) {
    const e = chunk.error;
    throw new ApiError(e.code === "context_length_exceeded" ? "too_long" : "stream", e.message || "The answer failed.", {
      code: e.code || null,
    });
  }
  onChunk(chunk);
  return false;
}

// The REST API and its event stream, with the bearer token from the prompt (kept in sessionStorage, never in a URL).

const TOKEN_KEY = "longrun-token";
const unauthorizedListeners = [];

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export const token = () => sessionStorage.getItem(TOKEN_KEY);
export const setToken = (value) => sessionStorage.setItem(TOKEN_KEY, value);
export const forgetToken = () => sessionStorage.removeItem(TOKEN_KEY);
export const onUnauthorized = (listener) => unauthorizedListeners.push(listener);

function headers(extra = {}) {
  const all = { ...extra };
  const bearer = token();
  if (bearer) all.Authorization = `Bearer ${bearer}`;
  return all;
}

function refused(status) {
  if (status === 401) unauthorizedListeners.forEach((listener) => listener());
}

function detailText(detail) {
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) return detail.map((e) => `${(e.loc || []).join(".")}: ${e.msg}`).join("; ");
  return JSON.stringify(detail);
}

export async function api(path, { method = "GET", body, params } = {}) {
  const url = new URL(path, location.origin);
  for (const [key, value] of Object.entries(params || {})) {
    if (value !== undefined && value !== null) url.searchParams.set(key, value);
  }
  const response = await fetch(url, {
    method,
    headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) {
    refused(response.status);
    let detail = response.statusText;
    try {
      detail = detailText((await response.json()).detail);
    } catch {
      // a body that is not JSON: the status text says enough
    }
    throw new ApiError(response.status, detail);
  }
  return response.status === 204 ? null : response.json();  // a DELETE answers with no body
}

export const runPath = (runId, tail = "") => `/v1/runs/${encodeURIComponent(runId)}${tail}`;

function parseEvent(block) {
  const event = { id: null, kind: "message", data: "" };
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "id") event.id = value;
    else if (field === "event") event.kind = value;
    else if (field === "data") event.data += value;
  }
  return event.data ? { ...event, data: JSON.parse(event.data) } : null;
}

const pause = (ms, signal) => new Promise((resolve) => {
  const timer = setTimeout(resolve, ms);
  signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
});

// EventSource cannot send an Authorization header, so the stream is read with fetch(); it resumes with
// Last-Event-ID after the server ends it (a finished run) or the connection drops.
export async function followEvents(runId, onEvent, signal) {
  let lastId = null;
  while (!signal.aborted) {
    try {
      const extra = { Accept: "text/event-stream" };
      if (lastId) extra["Last-Event-ID"] = lastId;
      const response = await fetch(runPath(runId, "/events"), { headers: headers(extra), signal });
      if (!response.ok) {
        refused(response.status);
        if (response.status === 401 || response.status === 404) return;
      } else {
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value.replaceAll("\r\n", "\n");
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            const event = parseEvent(buffer.slice(0, end));
            buffer = buffer.slice(end + 2);
            if (event) {
              if (event.id) lastId = event.id;
              onEvent(event);
            }
          }
        }
      }
    } catch (error) {
      if (signal.aborted) return;
      console.warn("event stream interrupted", error);
    }
    await pause(3000, signal);
  }
}

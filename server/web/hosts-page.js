// The hosts: each one's address, workspace and state (with the worker's reason when it cannot reach it, which names
// its fix), and a form that changes its settings through PATCH /v1/hosts/{name}.

import { api } from "./api.js";
import { el, replace } from "./dom.js";

// the fields PATCH takes; an emptied optional one is sent as null (the server's user, default keys, known_hosts)
const FIELDS = [
  ["address", "Address", "a name or IP address, or a ~/.ssh/config alias", false],
  ["port", "Port", "22 yields to the SSH config's Port", false],
  ["username", "User", "empty: the server's user", true],
  ["key_path", "Key path", "a private key on the server's machine; empty: the default keys", true],
  ["host_key", "Host key", "the host's public key line, pinned; empty: the server's known_hosts", true],
  ["workspace", "Workspace", "only while no run uses the host", false],
  ["python", "Python", "the host's Python that has torch", false],
];

// as registered, then, once the worker has reached it, where it connected (its ~/.ssh/config applied)
export const hostAddress = (h) => {
  const given = !h.port || h.port === 22 ? h.address : `${h.address}:${h.port}`;
  return h.reached ? `${given} → ${h.reached}` : given;
};

function stateOf(host) {
  if (host.reachable === false) return el("span", { class: "error" }, "unreachable: ", host.last_error || "the worker gave no reason");
  if (host.reachable) return el("span", {}, "reachable");
  return el("span", { class: "muted" }, "not contacted yet");
}

// onSaved(host, message): the card is drawn again from the saved host, the message under its form
function editForm(host, onSaved, message = "") {
  const inputs = new Map();
  const note = el("p", { class: "small host-note", role: "status" }, message);
  const rows = FIELDS.map(([key, label, help]) => {
    const value = host[key] ?? "";
    const input = el("input", { name: key, value: String(value), type: key === "port" ? "number" : "text", size: 50 });
    inputs.set(key, input);
    return el("label", { class: "field" }, el("span", {}, label), input, el("small", { class: "muted" }, help));
  });
  const save = el("button", { type: "submit", class: "host-save" }, "Save");
  const form = el("form", {
    class: "host-form",
    onsubmit: async (event) => {
      event.preventDefault();
      const body = {};
      for (const [key, , , clearable] of FIELDS) {
        const raw = inputs.get(key).value.trim();
        if (raw === String(host[key] ?? "")) continue;
        body[key] = key === "port" ? Number(raw) : raw === "" && clearable ? null : raw;
      }
      if (!Object.keys(body).length) { replace(note, "nothing changed"); return; }
      try {
        save.disabled = true;
        const saved = await api(`/v1/hosts/${encodeURIComponent(host.name)}`, { method: "PATCH", body });
        onSaved(saved, `saved: ${Object.keys(body).join(", ")}`);
      } catch (error) {
        replace(note, el("span", { class: "error" }, error.message));
      } finally {
        save.disabled = false;
      }
    },
  }, rows, el("div", { class: "buttons" }, save), note);
  return el("details", { class: "host-edit", open: Boolean(message) }, el("summary", {}, `Edit ${host.name}`), form);
}

function hostCard(host) {
  const card = el("section", { class: "card host", "data-host": host.name });
  const draw = (h, message) => replace(card,
    el("h2", {}, h.name, " ", el("span", { class: "muted small" }, h.kind)),
    el("p", {}, el("span", { class: "host-address" }, hostAddress(h)), " · ", h.workspace),
    el("p", { class: "host-state" }, stateOf(h)),
    editForm(h, draw, message));
  draw(host);
  return card;
}

export function showHosts(root) {
  const status = el("p", { class: "muted small" });
  const list = el("div", { id: "hosts" });
  replace(root, el("p", {}, el("a", { href: "#/" }, "← all runs")), el("h1", {}, "Hosts"), list, status);
  api("/v1/hosts").then((hosts) => replace(list, hosts.length ? hosts.map(hostCard) : el("p", { class: "empty" }, "no hosts")),
    (error) => replace(status, el("span", { class: "error" }, error.message)));
}

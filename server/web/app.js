// The page's entry: the token prompt, and the views chosen by the URL's fragment (#/, #/runs/<id>, #/hosts).

import { forgetToken, onUnauthorized, setToken, token } from "./api.js";
import { el, replace } from "./dom.js";
import { showHosts } from "./hosts-page.js";
import { showRun } from "./run-page.js";
import { showRunsList } from "./runs-list.js";

const root = document.getElementById("view");
const dialog = document.getElementById("token-dialog");
const tokenInput = document.getElementById("token-input");
let current = null;

function route() {
  current?.abort();
  current = new AbortController();
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const match = /^\/runs\/([^/]+)$/.exec(path || "/");
  if (match) showRun(root, decodeURIComponent(match[1]), current.signal);
  else if (path === "/hosts") showHosts(root);
  else showRunsList(root, new URLSearchParams(query || ""), current.signal);
}

function askForToken() {
  if (dialog.open) return;
  tokenInput.value = "";
  dialog.showModal();
}

onUnauthorized(askForToken);
document.getElementById("token-form").addEventListener("submit", () => {
  // the dialog's form closes it; the token stays in this tab's sessionStorage, never in a URL
  if (tokenInput.value.trim()) setToken(tokenInput.value.trim());
  showTokenState();
  route();
});
document.getElementById("forget-token").addEventListener("click", () => {
  forgetToken();
  showTokenState();
  route();
});
window.addEventListener("hashchange", route);
function showTokenState() {
  replace(document.getElementById("token-state"), token() ? "token set" : el("span", { class: "muted" }, "no token"));
}

showTokenState();
route();

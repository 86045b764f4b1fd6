// The chat page: wires conversations, the streamed answer, settings and the memory view.

import { Api, ApiError, errorText } from "./api.js";
import { historyOf, streamAnswer } from "./chat.js";
import { renderMemory } from "./memory.js";
import { messageElement, renderMessage } from "./render.js";
import { bindSettings, fillModels, requestBody } from "./settings.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const settings = store.loadSettings();
const api = new Api("", settings.apiKey);
const state = { conv: null, controller: null, panel: null };

// ---- errors --------------------------------------------------------------------------------

const ACTIONS = {
  down: ["Retry", () => loadModels()],
  auth: ["Open settings", () => openPanel("settings-panel")],
  too_long: ["New chat", () => newChat()],
};

function describe(err) {
  return { text: errorText(err), action: err instanceof ApiError ? ACTIONS[err.kind] : undefined };
}

function showError(err) {
  const { text, action } = describe(err);
  $("banner").dataset.kind = err.kind ?? "error";
  $("banner-text").textContent = text;
  const button = $("banner-action");
  button.hidden = !action;
  if (action) {
    button.textContent = action[0];
    button.onclick = () => {
      hideError();
      action[1]();
    };
  }
  $("banner").hidden = false;
  if (err.kind === "down") setStatus("down");
}

function hideError() {
  $("banner").hidden = true;
}

function setStatus(status) {
  $("server-status").className = `status-dot ${status}`;
  $("server-status").title = `server: ${status}`;
}

// ---- conversations -------------------------------------------------------------------------

function renderList() {
  const convs = store.listConversations();
  if (!convs.some((c) => c.id === state.conv.id)) convs.unshift(state.conv);
  $("conv-list").replaceChildren(
    ...convs.map((conv) => {
      const item = document.createElement("button");
      item.type = "button";
      item.className = `conv${conv.id === state.conv.id ? " active" : ""}`;
      item.dataset.id = conv.id;
      const title = document.createElement("span");
      title.className = "conv-name";
      title.textContent = conv.title;
      const when = document.createElement("span");
      when.className = "conv-when";
      when.textContent = new Date(conv.updated).toLocaleString([], { dateStyle: "short", timeStyle: "short" });
      item.append(title, when);
      item.addEventListener("click", () => switchTo(conv.id));
      return item;
    }),
  );
  $("conv-title").textContent = state.conv.title;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren($("empty"));
  $("empty").hidden = state.conv.messages.length > 0;
  for (const message of state.conv.messages) {
    const el = messageElement(message.role);
    renderMessage(el, message);
    box.append(el);
  }
  box.scrollTop = box.scrollHeight;
}

function show(conv) {
  stopAnswer();
  state.conv = conv;
  store.setCurrentId(conv.id);
  hideError();
  renderList();
  renderMessages();
  refreshMemory();
  closeSidebar();
}

function switchTo(id) {
  const conv = store.getConversation(id);
  if (conv) show(conv);
}

function newChat() {
  if (state.conv.messages.length === 0) return closeSidebar();
  show(store.createConversation());
  $("prompt").focus();
}

function save() {
  state.conv.updated = Date.now();
  store.saveConversation(state.conv);
  renderList();
}

function renameChat() {
  $("rename-input").value = state.conv.title;
  $("rename-dialog").returnValue = "";
  $("rename-dialog").showModal();
}

$("rename-dialog").addEventListener("close", () => {
  const title = $("rename-input").value.trim();
  if ($("rename-dialog").returnValue !== "ok" || !title) return;
  state.conv.title = title;
  save();
});

function deleteChat() {
  $("delete-title").textContent = state.conv.title;
  $("delete-ws-row").hidden = !state.conv.workspaceId;
  $("delete-ws-id").textContent = state.conv.workspaceId ?? "";
  $("delete-dialog").returnValue = "";
  $("delete-dialog").showModal();
}

$("delete-dialog").addEventListener("close", async () => {
  if ($("delete-dialog").returnValue !== "ok") return;
  const { id, workspaceId } = state.conv;
  const freeMemory = workspaceId && $("delete-ws").checked;
  store.deleteConversation(id);
  const next = store.listConversations()[0];
  show(next ?? store.createConversation());
  if (!freeMemory) return;
  try {
    await api.deleteWorkspace(workspaceId);
  } catch (err) {
    showError(err);
  }
});

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  a.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function exportChat() {
  const slug = state.conv.title.replace(/[^\w-]+/g, "-").replace(/^-|-$/g, "").slice(0, 40) || "conversation";
  download(`kvmem-${slug}.json`, store.exportJson(state.conv));
}

// ---- answering ------------------------------------------------------------------------------

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function stopAnswer() {
  state.controller?.abort();
}

async function send(text) {
  if (state.controller || !text.trim()) return;
  hideError();
  const conv = state.conv;
  if (conv.messages.length === 0) conv.title = store.titleFrom(text);
  conv.messages.push({ role: "user", content: text });
  const body = requestBody(historyOf(conv.messages), settings);
  const answer = { role: "assistant", content: "" };
  conv.messages.push(answer);
  save();
  renderMessages();
  const el = $("messages").lastElementChild;
  renderMessage(el, answer, true);
  state.controller = new AbortController();
  setBusy(true);
  let pending = false;
  const update = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      renderMessage(el, answer, true);
      const box = $("messages");
      if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
    });
  };
  try {
    // the first chunk names the workspace, so an answer stopped early still links its memory
    await streamAnswer(api, body, answer, update, state.controller.signal, (id) => { conv.workspaceId = id; });
    setStatus("up");
  } catch (err) {
    if (!answer.content) {
      // Nothing came back (or Stop came first): take the turn out and give the text back.
      conv.messages.splice(-2, 2);
      $("prompt").value = text;
    } else if (err.name === "AbortError") {
      answer.stopped = true;
    } else {
      answer.error = err.message;
    }
    if (err.name !== "AbortError") showError(err);
  } finally {
    state.controller = null;
    setBusy(false);
  }
  if (conv.messages.length === 0) {
    conv.title = "New conversation";
    store.deleteConversation(conv.id);
  } else {
    conv.updated = Date.now();
    store.saveConversation(conv);
  }
  if (state.conv !== conv) return;
  store.setCurrentId(conv.id);
  renderList();
  renderMessages();
  refreshMemory();
}

// ---- panels ---------------------------------------------------------------------------------

function openPanel(id) {
  for (const panelId of ["memory-panel", "settings-panel"]) {
    const open = panelId === id && state.panel !== id;
    $(panelId).hidden = !open;
  }
  state.panel = state.panel === id ? null : id;
  $("toggle-memory").setAttribute("aria-pressed", String(state.panel === "memory-panel"));
  $("toggle-settings").setAttribute("aria-pressed", String(state.panel === "settings-panel"));
  if (state.panel === "memory-panel") refreshMemory();
}

async function refreshMemory() {
  if (state.panel !== "memory-panel") return;
  const root = $("memory");
  const id = state.conv.workspaceId;
  if (!id) return renderMemory(root, { status: "empty" });
  const conv = state.conv;
  if (!root.childElementCount) renderMemory(root, { status: "loading" });
  try {
    const workspace = await api.workspace(id);
    const last = conv.messages.findLast((m) => m.role === "assistant" && m.stats);
    if (state.conv === conv) renderMemory(root, { status: "ok", workspace, lastAnswer: { cachedTokens: last?.stats.cachedTokens } });
  } catch (err) {
    if (state.conv !== conv) return;
    if (err instanceof ApiError && err.kind === "not_found") renderMemory(root, { status: "missing" });
    else renderMemory(root, { status: "error", message: describe(err).text });
  }
}

function closeSidebar() {
  $("app").classList.remove("sidebar-open");
  $("scrim").hidden = true;
}

// ---- start ----------------------------------------------------------------------------------

async function loadModels() {
  try {
    fillModels($("set-model"), await api.models(), settings);
    store.saveSettings(settings);
    setStatus("up");
    hideError();
  } catch (err) {
    setStatus(err instanceof ApiError && err.kind === "down" ? "down" : "up");
    showError(err);
  }
}

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stopAnswer);
  $("new-chat").addEventListener("click", newChat);
  $("rename").addEventListener("click", renameChat);
  $("delete").addEventListener("click", deleteChat);
  $("export").addEventListener("click", exportChat);
  $("toggle-memory").addEventListener("click", () => openPanel("memory-panel"));
  $("toggle-settings").addEventListener("click", () => openPanel("settings-panel"));
  $("refresh-memory").addEventListener("click", refreshMemory);
  for (const button of document.querySelectorAll(".close-panel")) button.addEventListener("click", () => openPanel(state.panel));
  $("banner-close").addEventListener("click", hideError);
  $("toggle-sidebar").addEventListener("click", () => {
    $("app").classList.add("sidebar-open");
    $("scrim").hidden = false;
  });
  $("scrim").addEventListener("click", closeSidebar);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.controller) stopAnswer();
  });
  bindSettings($("settings-form"), settings, (key) => {
    if (key === "apiKey") {
      api.apiKey = settings.apiKey;
      loadModels();
    }
  });
}

wire();
show(store.getConversation(store.currentId()) ?? store.listConversations()[0] ?? store.createConversation());
loadModels();

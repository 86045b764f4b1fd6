// Conversations and settings, kept in the browser's localStorage (one key per conversation).
//
// Conversation: {id, title, created, updated, workspaceId, messages: [Message]}
// Message: {role: "user"|"assistant", content, reasoning?, stats?, stopped?, error?}

const CONV_PREFIX = "kvmem.conv.";
const CURRENT_KEY = "kvmem.current";
const SETTINGS_KEY = "kvmem.settings";

export const DEFAULT_SETTINGS = Object.freeze({
  model: "",
  systemPrompt: "",
  temperature: 0.7,
  topP: 0.95,
  topK: 40,
  maxTokens: 512,
  reasoningEffort: "", // "" = the model's default; else low | medium | high
  thinking: "default", // default | on | off (chat_template_kwargs.enable_thinking)
  thinkingBudget: "", // "" = no limit; else reasoning_budget_tokens
  apiKey: "",
});

function newId() {
  const bytes = crypto.getRandomValues(new Uint8Array(8));
  return "c" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

export function createConversation() {
  const now = Date.now();
  return { id: newId(), title: "New conversation", created: now, updated: now, workspaceId: null, messages: [] };
}

export function listConversations() {
  const out = [];
  for (let i = 0; i < localStorage.length; i++) {
    const key = localStorage.key(i);
    if (!key.startsWith(CONV_PREFIX)) continue;
    try {
      out.push(JSON.parse(localStorage.getItem(key)));
    } catch {
      // An unreadable entry is skipped rather than breaking the list.
    }
  }
  return out.sort((a, b) => b.updated - a.updated);
}

export function getConversation(id) {
  const raw = id && localStorage.getItem(CONV_PREFIX + id);
  return raw ? JSON.parse(raw) : null;
}

export function saveConversation(conv) {
  localStorage.setItem(CONV_PREFIX + conv.id, JSON.stringify(conv));
}

export function deleteConversation(id) {
  localStorage.removeItem(CONV_PREFIX + id);
  if (localStorage.getItem(CURRENT_KEY) === id) localStorage.removeItem(CURRENT_KEY);
}

export function currentId() {
  return localStorage.getItem(CURRENT_KEY);
}

export function setCurrentId(id) {
  localStorage.setItem(CURRENT_KEY, id);
}

/** A conversation as a downloadable JSON document (messages in OpenAI shape plus page extras). */
export function exportJson(conv) {
  return JSON.stringify({ format: "kvmem.conversation", version: 1, ...conv }, null, 2);
}

/** A title from the first user message: its first line, at most 48 characters. */
export function titleFrom(text) {
  const line = text.trim().split("\n")[0].trim();
  return line.length > 48 ? line.slice(0, 47) + "…" : line || "New conversation";
}

export function loadSettings() {
  try {
    return { ...DEFAULT_SETTINGS, ...JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") };
  } catch {
    return { ...DEFAULT_SETTINGS };
  }
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

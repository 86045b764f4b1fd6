// The settings panel: form fields bound to the settings object (saved on every change), and
// the request fields they turn into.

import { saveSettings } from "./store.js";

const NUMBER_FIELDS = {
  temperature: [0, 2], topP: [0.01, 1], topK: [0, 1000], maxTokens: [1, 1 << 20], thinkingBudget: [0, 1 << 20],
};
const OPTIONAL_FIELDS = new Set(["thinkingBudget"]); // may be left empty: no value is sent

function readField(input) {
  const key = input.name;
  if (OPTIONAL_FIELDS.has(key) && input.value.trim() === "") return "";
  if (!(key in NUMBER_FIELDS)) return input.value;
  const [lo, hi] = NUMBER_FIELDS[key];
  const value = Number(input.value);
  return Number.isFinite(value) ? Math.min(Math.max(value, lo), hi) : null;
}

/** Fills the form from `settings` and keeps `settings` in step with it; onChange(key) after each save. */
export function bindSettings(form, settings, onChange) {
  for (const input of form.elements) {
    if (!input.name || !(input.name in settings)) continue;
    input.value = settings[input.name];
    input.addEventListener("change", () => {
      const value = readField(input);
      if (value === null) {
        input.value = settings[input.name];
        return;
      }
      settings[input.name] = value;
      input.value = value;
      saveSettings(settings);
      onChange(input.name);
    });
  }
}

/** Replaces the model choices with `ids`, keeping the saved choice when the server still has it. */
export function fillModels(select, ids, settings) {
  select.replaceChildren(
    ...ids.map((id) => {
      const option = document.createElement("option");
      option.value = id;
      option.textContent = id;
      return option;
    }),
  );
  if (!ids.includes(settings.model)) settings.model = ids[0] ?? "";
  select.value = settings.model;
}

/** The body of a streamed chat completion for `messages` under `settings`. */
export function requestBody(messages, settings) {
  const body = {
    messages: settings.systemPrompt.trim()
      ? [{ role: "system", content: settings.systemPrompt }, ...messages]
      : messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: settings.temperature,
    top_p: settings.topP,
    top_k: settings.topK,
    max_tokens: settings.maxTokens,
  };
  if (settings.model) body.model = settings.model;
  if (settings.reasoningEffort) body.reasoning_effort = settings.reasoningEffort;
  if (settings.thinking !== "default") body.chat_template_kwargs = { enable_thinking: settings.thinking === "on" };
  if (settings.thinkingBudget !== "") body.reasoning_budget_tokens = Math.round(settings.thinkingBudget);
  return body;
}

// Safe rendering of model output: Markdown through marked, raw HTML in the output escaped to
// text, the result sanitized by DOMPurify, thinking blocks split off into <details>.

import { Marked } from "../vendor/marked.js";
import DOMPurify from "../vendor/purify.js";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const marked = new Marked({ gfm: true, breaks: true, async: false });
marked.use({
  renderer: {
    // Model output never becomes markup: HTML it writes is shown as the text it is.
    html({ text }) {
      return escapeHtml(text);
    },
    // Images would make the browser fetch whatever URL the model names; show a link instead.
    image({ href, text }) {
      return `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`;
    },
  },
});

const PURIFY = {
  ALLOWED_TAGS: [
    "a", "p", "br", "hr", "strong", "em", "del", "code", "pre", "blockquote", "ul", "ol", "li",
    "h1", "h2", "h3", "h4", "h5", "h6", "table", "thead", "tbody", "tr", "th", "td", "input", "span",
  ],
  ALLOWED_ATTR: ["href", "title", "class", "start", "align", "type", "checked", "disabled"],
  ALLOW_DATA_ATTR: false,
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
  if (node.tagName === "INPUT" && node.getAttribute("type") !== "checkbox") node.remove();
});

/** Markdown text to sanitized HTML: the only path by which model text reaches innerHTML. */
export function markdownToHtml(text) {
  return DOMPurify.sanitize(marked.parse(text), PURIFY);
}

/**
 * Splits `<think>…</think>` off an answer. A closing tag alone means the template opened the
 * block in the prompt. Returns {thinking, answer, open} where open = still thinking.
 */
export function splitThink(text) {
  const open = text.indexOf("<think>");
  const close = text.indexOf("</think>");
  if (open >= 0 && (close < 0 || open < close)) {
    const before = text.slice(0, open);
    if (close < 0) return { thinking: text.slice(open + 7), answer: before, open: true };
    return { thinking: text.slice(open + 7, close), answer: before + text.slice(close + 8), open: false };
  }
  if (close >= 0) return { thinking: text.slice(0, close), answer: text.slice(close + 8), open: false };
  return { thinking: "", answer: text, open: false };
}

function addCopyButtons(root) {
  for (const pre of root.querySelectorAll("pre")) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(pre.querySelector("code")?.textContent ?? pre.textContent);
        button.textContent = "Copied";
      } catch {
        button.textContent = "Copy failed";
      }
      setTimeout(() => (button.textContent = "Copy"), 1500);
    });
    pre.append(button);
  }
}

function formatStats(stats) {
  const parts = [];
  if (stats.completionTokens != null) parts.push(`${stats.completionTokens} tokens`);
  if (stats.tokPerSec != null) parts.push(`${stats.tokPerSec.toFixed(1)} tok/s`);
  if (stats.cachedTokens != null) parts.push(`${stats.cachedTokens} cache-hit tokens`);
  if (stats.promptTokens != null) parts.push(`prompt ${stats.promptTokens}`);
  if (stats.finishReason === "length") parts.push("cut at max tokens");
  return parts.join(" · ");
}

/** Fills `el` (an .msg element) with one message. A thinking block is open while the model thinks and
 * folds when the answer begins, unless the user opened or closed it (that choice is kept). */
export function renderMessage(el, message, streaming = false) {
  const body = el.querySelector(".msg-body");
  if (message.role === "user") {
    body.textContent = message.content;
  } else {
    const before = body.querySelector("details.think");
    const split = splitThink(message.content);
    const thinking = [message.reasoning || "", split.thinking].filter(Boolean).join("\n");
    const stillThinking = streaming && (split.open || !split.answer);
    body.replaceChildren();
    if (thinking) {
      const details = document.createElement("details");
      details.className = "think";
      const chosen = before?.dataset.user === "1";
      details.open = chosen ? before.open : stillThinking;
      if (chosen) details.dataset.user = "1";
      const summary = document.createElement("summary");
      summary.addEventListener("click", () => { details.dataset.user = "1"; });
      summary.textContent = stillThinking ? "Thinking…" : "Thoughts";
      const inner = document.createElement("div");
      inner.className = "markdown";
      inner.innerHTML = markdownToHtml(thinking);
      details.append(summary, inner);
      body.append(details);
    }
    const answer = document.createElement("div");
    answer.className = "markdown";
    answer.innerHTML = markdownToHtml(split.answer);
    addCopyButtons(answer);
    body.append(answer);
  }
  el.classList.toggle("streaming", streaming);
  const footer = el.querySelector(".msg-stats");
  const notes = [];
  if (message.stats) notes.push(formatStats(message.stats));
  if (message.stopped) notes.push("stopped");
  if (message.error) notes.push(`failed: ${message.error}`);
  footer.textContent = notes.filter(Boolean).join(" · ");
  footer.hidden = notes.length === 0;
}

/** A new, empty message element for `role`. */
export function messageElement(role) {
  const el = document.createElement("article");
  el.className = `msg msg-${role}`;
  const body = document.createElement("div");
  body.className = "msg-body";
  const footer = document.createElement("footer");
  footer.className = "msg-stats";
  footer.hidden = true;
  el.append(body, footer);
  return el;
}

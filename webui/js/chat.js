// One answer: stream a chat completion into an assistant message and measure it.

/** The turns sent to the server: failed or empty answers are left out of the history; an answer's
 * thinking goes along as `reasoning_content` (templates that render it repeat the model's tokens). */
export function historyOf(messages) {
  return messages
    .filter((m) => !(m.role === "assistant" && !m.content))
    .map((m) => (m.role === "assistant" && m.reasoning
      ? { role: m.role, content: m.content, reasoning_content: m.reasoning }
      : { role: m.role, content: m.content }));
}

/**
 * Streams `body` into `message` (content, reasoning, stats), calling onUpdate() after each
 * piece of text, and onWorkspace(id) when a chunk names the server-side workspace (the first
 * one does). Resolves with the last `kvmem` object seen (null if none). An abort leaves the
 * partial answer in place and rejects with the AbortError.
 */
export async function streamAnswer(api, body, message, onUpdate, signal, onWorkspace = () => {}) {
  let kvmem = null;
  let pieces = 0;
  let firstAt = null;
  let lastAt = null;
  let usage = null;
  let finishReason = null;
  let timings = null;
  const finish = () => {
    message.stats = answerStats({ usage, pieces, firstAt, lastAt, finishReason, timings, kvmemTimings: kvmem?.timings });
  };
  try {
    await api.chatStream(
      body,
      (chunk) => {
        if (chunk.kvmem?.workspace_id) onWorkspace(chunk.kvmem.workspace_id);
        if (chunk.kvmem) kvmem = chunk.kvmem;
        if (chunk.usage) usage = chunk.usage;
        if (chunk.timings) timings = chunk.timings;
        const choice = chunk.choices?.[0];
        if (!choice) return;
        const delta = choice.delta ?? {};
        const text = (delta.content ?? "") + (delta.reasoning_content ?? "");
        if (text) {
          const now = performance.now();
          firstAt ??= now;
          lastAt = now;
          pieces += 1;
          if (delta.reasoning_content) message.reasoning = (message.reasoning ?? "") + delta.reasoning_content;
          if (delta.content) message.content += delta.content;
          onUpdate();
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      },
      signal,
    );
  } finally {
    finish();
  }
  return kvmem;
}

/**
 * Decode speed and cache hits of one answer. tok/s counts the tokens after the first over the
 * time from the first to the last piece of text, so prefill time stays out of it; the
 * server's own decode timing (llama.cpp's `timings`, or KVMem's `kvmem.timings`) wins.
 */
export function answerStats({ usage, pieces, firstAt, lastAt, finishReason, timings, kvmemTimings }) {
  const completion = usage?.completion_tokens ?? (pieces || null);
  const details = usage?.prompt_tokens_details ?? {};
  const cached = details.cached_tokens ?? usage?.prompt_cache_hit_tokens ?? null;
  let tokPerSec = timings?.predicted_per_second ?? null;
  if (tokPerSec === null && kvmemTimings?.decode_s > 0 && kvmemTimings.decode_tokens > 0) {
    tokPerSec = kvmemTimings.decode_tokens / kvmemTimings.decode_s;
  }
  if (tokPerSec === null && completion > 1 && lastAt > firstAt) {
    tokPerSec = ((completion - 1) * 1000) / (lastAt - firstAt);
  }
  return {
    completionTokens: completion,
    promptTokens: usage?.prompt_tokens ?? null,
    cachedTokens: cached,
    tokPerSec,
    finishReason,
  };
}

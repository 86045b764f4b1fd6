// The memory view: one conversation's workspace as a strip of blocks in chronological order,
// coloured by tier, the last selection highlighted, budget and reserve drawn to scale.
// normalizeWorkspace() reads the server's JSON defensively (see docs/webui.md for the shape).

const TIER_ORDER = ["gpu", "host", "nvme"];
const TIER_NAMES = { gpu: "GPU view", host: "host RAM", nvme: "NVMe", none: "not stored" };

function tierOf(raw) {
  const values = Array.isArray(raw) ? raw : [raw];
  const tiers = values.map((v) => {
    const t = String(v ?? "").toLowerCase();
    if (["gpu", "view", "device", "vram", "cuda", "slot"].some((k) => t.includes(k))) return "gpu";
    if (["host", "cpu", "ram", "memory"].some((k) => t.includes(k))) return "host";
    if (["nvme", "disk", "ssd", "file"].some((k) => t.includes(k))) return "nvme";
    return "none";
  });
  // A block held in several tiers is shown at the fastest one.
  return TIER_ORDER.find((t) => tiers.includes(t)) ?? "none";
}

const first = (...values) => values.find((v) => v !== undefined && v !== null);
const num = (...values) => {
  const v = values.find((x) => typeof x === "number" && Number.isFinite(x));
  return v === undefined ? null : v;
};

function selectedIndices(selection) {
  const list = first(selection?.blocks, selection?.selected, selection?.block_indices, selection?.indices) ?? [];
  return new Set((Array.isArray(list) ? list : []).map((b) => (typeof b === "object" ? b.index : b)));
}

function blockRange(b, cursor, blockTokens) {
  const range = first(b.token_range, b.tokens_range, b.range);
  const start = num(b.start, b.token_start, b.start_token, Array.isArray(range) ? range[0] : null, cursor);
  const end = num(b.end, b.token_end, b.end_token, Array.isArray(range) ? range[1] : null,
    start + num(b.n_tokens, b.num_tokens, b.tokens, b.length, blockTokens));
  return [start, end];
}

/** The server's workspace JSON as {id, blockTokens, budget, reserve, blocks, totals}. */
export function normalizeWorkspace(ws) {
  const cfg = ws.config ?? {};
  const raw = Array.isArray(ws.blocks) ? ws.blocks : [];
  const widest = Math.max(0, ...raw.map((b) => num(b.end) - num(b.start)).filter(Number.isFinite));
  const blockTokens = num(ws.block_tokens, cfg.block_tokens, widest || null, 128);
  const selection = first(ws.last_selection, ws.selection) ?? {};
  // A step whose whole prompt fit the budget selects nothing: every block is in the view.
  const all = selection.method === "full";
  const picked = selectedIndices(selection);
  let cursor = 0;
  const blocks = raw.map((b, i) => {
    const [start, end] = blockRange(b, cursor, blockTokens);
    cursor = end;
    const index = num(b.index, b.idx, i);
    return {
      index,
      start,
      end,
      tokens: end - start,
      tier: tierOf(first(b.tiers, b.tier, b.location)),
      selected: Boolean(first(b.selected, b.in_view, all || picked.has(index))),
      preview: String(first(b.preview, b.text_preview, b.text, b.head) ?? ""),
    };
  });
  const totals = ws.totals ?? {};
  const sumOf = (list) => list.reduce((s, b) => s + b.tokens, 0);
  const stored = num(totals.tokens_stored, totals.tokens, totals.stored_tokens, ws.tokens, sumOf(blocks));
  const history = num(selection.history_tokens);
  const selectedView = history === null ? null : history + (num(selection.tail_tokens) ?? 0);
  return {
    id: first(ws.id, ws.workspace_id),
    blockTokens,
    budget: num(selection.budget, ws.budget, cfg.budget, totals.budget),
    reserve: num(selection.gen_budget, ws.gen_budget, ws.reserve, cfg.gen_budget, totals.gen_budget, totals.reserve),
    blocks,
    totals: {
      stored,
      inView: num(totals.tokens_in_view, totals.view_tokens, selection.tokens_in_view, selection.view_tokens,
        selectedView, all ? stored : null, sumOf(blocks.filter((b) => b.selected))),
      cacheHits: num(totals.cache_hit_tokens, totals.cached_tokens, ws.cache_hit_tokens, selection.cached_tokens),
    },
  };
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));

function stat(label, value, hint) {
  const box = el("div", "stat");
  box.append(el("div", "stat-value", fmt(value)), el("div", "stat-label", label));
  if (hint) box.title = hint;
  return box;
}

function legend() {
  const box = el("div", "legend");
  for (const tier of TIER_ORDER) {
    const item = el("span", "legend-item");
    item.append(el("span", `swatch tier-${tier}`), document.createTextNode(TIER_NAMES[tier]));
    box.append(item);
  }
  const sel = el("span", "legend-item");
  sel.append(el("span", "swatch swatch-selected"), document.createTextNode("selected for the last answer"));
  box.append(sel);
  return box;
}

/** First `n` words of a block's text, for the hover card. */
export function firstWords(text, n = 12) {
  const words = text.trim().split(/\s+/).filter(Boolean);
  if (!words.length) return "";
  return words.slice(0, n).join(" ") + (words.length > n ? " …" : "");
}

function blockCell(block, ws, tooltip) {
  const cell = el("button", `block tier-${block.tier}${block.selected ? " selected" : ""}`);
  cell.type = "button";
  cell.style.flexGrow = "0";
  cell.style.width = `calc(var(--cell) * ${Math.max(block.tokens / ws.blockTokens, 0.25)})`;
  cell.dataset.index = String(block.index);
  cell.setAttribute(
    "aria-label",
    `block ${block.index}, tokens ${block.start} to ${block.end}, ${TIER_NAMES[block.tier]}${block.selected ? ", selected" : ""}`,
  );
  const show = () => tooltip.show(cell, block);
  cell.addEventListener("mouseenter", show);
  cell.addEventListener("focus", show);
  cell.addEventListener("mouseleave", () => tooltip.hide());
  cell.addEventListener("blur", () => tooltip.hide());
  return cell;
}

function scaleBars(ws) {
  const { stored, inView } = ws.totals;
  const budget = ws.budget ?? 0;
  const reserve = ws.reserve ?? 0;
  const axis = Math.max(stored ?? 0, budget + reserve, 1);
  const pct = (n) => `${(100 * n) / axis}%`;
  const box = el("div", "scale");
  const row = (label, segments) => {
    const line = el("div", "scale-row");
    const bar = el("div", "scale-bar");
    for (const [cls, width, title] of segments) {
      const seg = el("div", `seg ${cls}`);
      seg.style.width = pct(width);
      seg.title = title;
      bar.append(seg);
    }
    line.append(el("span", "scale-label", label), bar);
    return line;
  };
  const byTier = TIER_ORDER.map((t) => [t, ws.blocks.filter((b) => b.tier === t).reduce((s, b) => s + b.tokens, 0)]);
  box.append(row("stored", byTier.filter(([, n]) => n > 0).map(([t, n]) => [`tier-${t}`, n, `${fmt(n)} tokens in ${TIER_NAMES[t]}`])));
  const viewSegs = [["seg-view", Math.min(inView ?? 0, budget || (inView ?? 0)), `${fmt(inView)} history tokens in view`]];
  if (budget > (inView ?? 0)) viewSegs.push(["seg-budget", budget - (inView ?? 0), `budget ${fmt(budget)} tokens`]);
  if (reserve) viewSegs.push(["seg-reserve", reserve, `generation reserve ${fmt(reserve)} tokens`]);
  box.append(row("view", viewSegs));
  const caption = el("div", "scale-caption", ws.budget === null
    ? `to scale: ${fmt(inView)} tokens in view of ${fmt(stored)} stored (the server did not report its budget)`
    : `to scale: budget ${fmt(ws.budget)} + reserve ${fmt(ws.reserve)} tokens against ${fmt(stored)} stored`);
  box.append(caption);
  return box;
}

/** A hover card positioned next to a block; text only, never markup. */
export function makeTooltip(root) {
  const tip = el("div", "tooltip");
  tip.setAttribute("role", "tooltip");
  tip.hidden = true;
  root.append(tip);
  return {
    show(cell, block) {
      const head = el("div", "tooltip-head", `Block ${block.index} · tokens ${block.start}–${block.end} · ${TIER_NAMES[block.tier]}`);
      const words = firstWords(block.preview);
      tip.replaceChildren(head, el("div", "tooltip-text", words ? `“${words}”` : "(no text preview)"));
      tip.hidden = false;
      const r = cell.getBoundingClientRect();
      const host = root.getBoundingClientRect();
      const left = Math.min(Math.max(r.left - host.left - 40, 4), host.width - tip.offsetWidth - 4);
      tip.style.left = `${left}px`;
      tip.style.top = `${r.bottom - host.top + root.scrollTop + 6}px`;
    },
    hide() {
      tip.hidden = true;
    },
  };
}

/**
 * Renders the memory view into `root`. state: {status: "empty"|"loading"|"missing"|"error"|"ok",
 * workspace (server JSON), lastAnswer ({cachedTokens}), message}.
 */
export function renderMemory(root, state) {
  root.replaceChildren();
  if (state.status !== "ok") {
    const messages = {
      empty: "No memory yet. Send a message and the workspace appears here.",
      loading: "Loading the workspace…",
      missing: "The server no longer holds this conversation's workspace (deleted or evicted). The next message rebuilds it.",
      error: state.message || "The workspace could not be loaded.",
    };
    root.append(el("p", "memory-note", messages[state.status]));
    return;
  }
  const ws = normalizeWorkspace(state.workspace);
  const last = state.lastAnswer ?? {};
  const hits = last.cachedTokens ?? ws.totals.cacheHits;
  const stats = el("div", "stats");
  stats.append(
    stat("tokens stored", ws.totals.stored),
    stat("in view", ws.totals.inView, "history tokens materialized for the last answer"),
    stat("cache hits", hits, "prompt tokens of the last answer found in memory (no prefill)"),
  );
  const id = el("div", "memory-id", `workspace ${ws.id ?? "?"} · ${ws.blocks.length} blocks of ${ws.blockTokens} tokens`);
  const strip = el("div", "strip");
  strip.style.setProperty("--cell", ws.blocks.length > 160 ? "8px" : ws.blocks.length > 48 ? "12px" : "18px");
  const tooltip = makeTooltip(root);
  for (const block of ws.blocks) strip.append(blockCell(block, ws, tooltip));
  if (!ws.blocks.length) strip.append(el("p", "memory-note", "The workspace holds no complete block yet."));
  root.append(id, stats, legend(), strip, scaleBars(ws));
}

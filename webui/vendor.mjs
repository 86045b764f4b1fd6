// Copies the pinned libraries' browser builds from node_modules into vendor/, so the page
// loads them from the server itself (no CDN, no build step when serving). Run after
// `npm ci` whenever package.json changes: `npm run vendor`.
import { copyFileSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = dirname(fileURLToPath(import.meta.url));
const out = join(root, "vendor");
const files = [
  ["marked/lib/marked.esm.js", "marked.js"],
  ["dompurify/dist/purify.es.mjs", "purify.js"],
];
const licenses = [
  ["marked/LICENSE", "LICENSE.marked"],
  ["dompurify/LICENSE", "LICENSE.dompurify"],
];

mkdirSync(out, { recursive: true });
for (const [src, dst] of files) {
  const text = readFileSync(join(root, "node_modules", src), "utf8");
  // The source maps are not vendored; drop the reference so browsers do not ask for them.
  writeFileSync(join(out, dst), text.replace(/\n\/\/# sourceMappingURL=\S+\s*$/, "\n"));
}
for (const [src, dst] of licenses) copyFileSync(join(root, "node_modules", src), join(out, dst));
const pkg = JSON.parse(readFileSync(join(root, "package.json"), "utf8"));
writeFileSync(join(out, "VERSIONS.json"), JSON.stringify(pkg.dependencies, null, 2) + "\n");
console.log(`vendored ${files.length} files into ${out}`);

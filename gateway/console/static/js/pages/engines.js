// Engines: health, model, queues, KV-cache use and prefix-cache hit rate (GET /admin/engines).
import { h, page, percent, table } from "../ui.js";

const REFRESH_MS = 5000;

export default async function engines({ get }) {
  const body = h("div", { "aria-live": "polite" });
  const refresh = async () => {
    const list = (await get("/admin/engines")).data;
    body.replaceChildren(
      table(
        "Engines",
        [
          ["Engine", (e) => h("code", {}, e.url)],
          ["Health", (e) => h("span", { class: `badge ${e.healthy ? "active" : "revoked"}`, title: e.error || "" }, e.healthy ? "healthy" : "down")],
          ["Models", (e) => e.models.join(", ") || "none"],
          ["Running", (e) => e.running ?? "n/a"],
          ["Waiting", (e) => e.waiting ?? "n/a"],
          ["In flight from this gateway", (e) => e.inflight],
          ["KV cache used", (e) => (e.kv_blocks_total ? `${percent(e.kv_cache_usage)} (${e.kv_blocks_used} of ${e.kv_blocks_total} blocks)` : "n/a")],
          ["Prefix-cache hit rate", (e) => (e.prompt_tokens ? `${percent(e.prefix_cache_hit_rate)} of ${e.prompt_tokens} prompt tokens` : "n/a")],
        ],
        list,
        "No engines configured.",
      ),
      h("p", { class: "hint" }, `Updated ${new Date().toLocaleTimeString()}; refreshes every ${REFRESH_MS / 1000} s.`),
    );
  };
  await refresh();
  const timer = setInterval(() => {
    if (!body.isConnected) clearInterval(timer);
    else refresh().catch(() => {});
  }, REFRESH_MS);
  return page("Engines", body);
}

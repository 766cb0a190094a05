// Usage and billing: a chart over time by model or key, the rows behind it (and their CSV),
// and a tenant's monthly bill. All from /admin/reports.
import { request } from "../api.js";
import { budgetsCard } from "../budgets.js";
import { barChart } from "../chart.js";
import { field, h, input, message, page, select, table, tenantSelect } from "../ui.js";

const METRICS = [
  ["requests", "Requests"],
  ["prompt_tokens", "Prompt tokens"],
  ["cached_tokens", "Cached prompt tokens"],
  ["completion_tokens", "Completion tokens"],
  ["reasoning_tokens", "Reasoning tokens (of completion)"],
  ["total_tokens", "Total tokens"],
  ["cost", "Cost"],
];
const BREAKDOWN_FIELD = { model: "model", key: "key_id" };

const today = () => new Date().toISOString().slice(0, 10);
const monthStart = () => `${today().slice(0, 8)}01`;

/** Every day from ``start`` to ``end`` (YYYY-MM-DD, UTC), so quiet days show as empty bars. */
function days(start, end) {
  const out = [];
  for (let d = new Date(`${start}T00:00:00Z`); d <= new Date(`${end}T00:00:00Z`); d.setUTCDate(d.getUTCDate() + 1)) {
    out.push(d.toISOString().slice(0, 10));
    if (out.length > 400) break;
  }
  return out;
}

function chartOf(report, { metric, breakdown, start, end, keyNames }) {
  const labels = days(start, end);
  const name = (row) => {
    if (!breakdown) return METRICS.find(([m]) => m === metric)[1];
    const value = row[BREAKDOWN_FIELD[breakdown]];
    return breakdown === "key" ? keyNames.get(value) || value : value;
  };
  const byName = new Map();
  for (const row of report.rows) {
    const series = byName.get(name(row)) || new Array(labels.length).fill(0);
    const i = labels.indexOf(row.day);
    if (i >= 0) series[i] += Number(row[metric]);
    byName.set(name(row), series);
  }
  const title = `${METRICS.find(([m]) => m === metric)[1]} per day${breakdown ? ` by ${breakdown}` : ""}, ${start} to ${end}`;
  return barChart({ title, labels, series: [...byName].map(([n, values]) => ({ name: n, values })) });
}

async function keyNames(get, tenant) {
  const keys = (await get("/admin/keys", { tenant_id: tenant || undefined, limit: 1000 })).data;
  return new Map(keys.map((k) => [k.id, `${k.name} (${k.hint})`]));
}

function usageCard(get) {
  const form = h(
    "form",
    { class: "card inline", "aria-label": "Usage period" },
    field("From", input("from", { type: "date", value: monthStart(), required: true })),
    field("To", input("to", { type: "date", value: today(), required: true })),
    field("Break down by", select("breakdown", [["", "nothing"], ["model", "model"], ["key", "key"]])),
    field("Metric", select("metric", METRICS)),
    h("button", { type: "submit" }, "Show usage"),
  );
  const out = h("div", { class: "card", "aria-live": "polite" });
  let query = null;
  let latest = 0; // only the newest report is drawn: an older one may answer last

  const show = async () => {
    const call = ++latest;
    const v = Object.fromEntries(new FormData(form));
    const tenant = form.elements.tenant?.value || undefined;
    const groupBy = v.breakdown ? `day,${v.breakdown}` : "day";
    const shown = { from: v.from, to: v.to, tenant, group_by: groupBy };
    try {
      const report = await (await request("GET", "/admin/reports/usage", { query: shown })).json();
      const names = v.breakdown === "key" ? await keyNames(get, tenant) : new Map();
      if (call !== latest) return;
      query = shown; // what the CSV button downloads: the report on screen
      const columns = [["Day", (r) => r.day]];
      if (v.breakdown === "model") columns.push(["Model", (r) => r.model]);
      if (v.breakdown === "key") columns.push(["Key", (r) => names.get(r.key_id) || r.key_id]);
      for (const [m, label] of [["requests", "Requests"], ["errors", "Errors"], ...METRICS.slice(1)]) columns.push([label, (r) => r[m]]);
      out.replaceChildren(
        chartOf(report, { metric: v.metric, breakdown: v.breakdown, start: v.from, end: v.to, keyNames: names }),
        h("button", { type: "button", class: "secondary", onclick: download }, "Download CSV"),
        table("Usage rows", columns, report.rows, "No usage in this period."),
      );
    } catch (error) {
      if (call === latest) message(out, error.message, "error");
    }
  };

  // The CSV of exactly the rows on screen, from the same report endpoint.
  const download = async () => {
    try {
      const blob = await (await request("GET", "/admin/reports/usage", { query: { ...query, format: "csv" } })).blob();
      const link = h("a", { href: URL.createObjectURL(blob), download: `tern-usage-${query.from}-${query.to}.csv` });
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(link.href), 10000);
    } catch (error) {
      message(out, error.message, "error");
    }
  };

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    show();
  });
  for (const control of form.querySelectorAll("select")) control.addEventListener("change", show);
  return { form, out, show };
}

function billingCard(tenantPicker) {
  const form = h(
    "form",
    { class: "card inline", "aria-label": "Billing month" },
    field("Month", input("month", { type: "month", value: today().slice(0, 7), required: true })),
    h("button", { type: "submit" }, "Show bill"),
  );
  const out = h("div", { "aria-live": "polite" });
  const show = async () => {
    if (!tenantPicker.value) {
      out.replaceChildren(h("p", { class: "empty" }, "Pick a tenant to see its bill."));
      return;
    }
    try {
      const query = { tenant: tenantPicker.value, month: form.elements.month.value };
      const bill = await (await request("GET", "/admin/reports/billing", { query })).json();
      out.replaceChildren(
        table(
          `Bill for ${bill.month}`,
          [
            ["Model", (l) => l.model],
            ["Requests", (l) => l.requests],
            ["Prompt tokens", (l) => l.prompt_tokens],
            ["Cached tokens", (l) => l.cached_tokens],
            ["Completion tokens", (l) => l.completion_tokens],
            ["Price from", (l) => l.price_effective_from ?? "no price"],
            ["Cost", (l) => l.cost],
          ],
          bill.lines,
          "Nothing billed this month.",
        ),
        h("p", { class: "total" }, `Total: ${bill.total_tokens} tokens, cost ${bill.total_cost}`),
      );
    } catch (error) {
      message(out, error.message, "error");
    }
  };
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    show();
  });
  return { card: h("div", { class: "card" }, h("h2", {}, "Billing"), form, out), show };
}

export default async function usage({ get }) {
  const tenantPicker = await tenantSelect(get, { allLabel: "All tenants" });
  const { form, out, show } = usageCard(get);
  form.prepend(field("Tenant", tenantPicker));
  const billing = billingCard(tenantPicker);
  const budgets = h("div");
  const showBudgets = async () => {
    budgets.replaceChildren(tenantPicker.value ? await budgetsCard(get, tenantPicker.value) : "");
  };
  tenantPicker.addEventListener("change", billing.show);
  tenantPicker.addEventListener("change", showBudgets);
  await Promise.all([show(), billing.show(), showBudgets()]);
  return page("Usage", budgets, form, out, billing.card);
}

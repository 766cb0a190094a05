// Budgets as bars: settled usage and the worst cases held by requests in flight, against each
// budget's limit, with when its period resets; on the Limits page also the form that adds one.
import { api } from "./api.js";
import { clearErrors, dateTime, field, h, input, message, select, showError, values } from "./ui.js";

const PERIODS = [["day", "per day"], ["week", "per week"], ["month", "per month"], ["total", "in total"]];
const PERIOD_TEXT = Object.fromEntries(PERIODS);

function describe(budget, keyNames) {
  const owner = budget.key_id ? `Key ${keyNames[budget.key_id] ?? budget.key_id}` : "Tenant";
  return `${owner}: ${budget.metric} ${PERIOD_TEXT[budget.period]}`;
}

// Widths are set through the CSSOM: the console's CSP allows no inline style attributes.
function segment(kind, fraction) {
  const el = h("span", { class: kind });
  el.style.width = `${Math.max(0, Math.min(100, 100 * fraction))}%`;
  return el;
}

export function budgetBar(budget, keyNames, remove) {
  const label = describe(budget, keyNames);
  const limit = Number(budget.limit);
  const used = limit > 0 ? Number(budget.used) / limit : 1;
  const held = limit > 0 ? Number(budget.reserved) / limit : 0;
  const reset = budget.resets_at ? `resets ${dateTime(budget.resets_at)} UTC` : "never resets";
  const amounts = `${budget.used} of ${budget.limit}${Number(budget.reserved) ? `, ${budget.reserved} in flight` : ""}`;
  const bar = h(
    "div",
    {
      class: "bar",
      role: "meter",
      "aria-label": label,
      "aria-valuemin": 0,
      "aria-valuemax": budget.limit,
      "aria-valuenow": budget.used,
      "aria-valuetext": `${amounts}; ${reset}`,
    },
    segment("bar-used", used),
    segment("bar-held", Math.min(held, 1 - used)),
  );
  if (budget.alert_ratio) {
    const mark = segment("bar-alert", budget.alert_ratio);
    mark.title = `alert at ${Math.round(100 * budget.alert_ratio)}%`;
    bar.append(mark);
  }
  return h(
    "div",
    { class: "budget" },
    h("div", { class: "budget-label" }, h("strong", {}, label), h("span", {}, `${amounts} · ${reset}`)),
    bar,
    remove && budget.id !== null
      ? h("button", { type: "button", class: "secondary", onclick: () => remove(budget) }, `Delete ${label}`)
      : null,
  );
}

/** Every budget of the tenant as a bar (``editable``: with delete buttons and the add form). */
export async function budgetsCard(get, tenantId, { editable = false, rerender } = {}) {
  const [listed, keys] = await Promise.all([
    get("/admin/budgets", { tenant: tenantId }),
    get("/admin/keys", { tenant_id: tenantId, include_revoked: false, limit: 1000 }),
  ]);
  const keyNames = Object.fromEntries(keys.data.map((k) => [k.id, k.name]));
  const card = h("div", { class: "card", "aria-label": "Budgets", role: "region" }, h("h2", {}, "Budgets"));
  const remove = editable
    ? async (budget) => {
        if (!confirm(`Delete the budget "${describe(budget, keyNames)}"?`)) return;
        try {
          await api("DELETE", `/admin/budgets/${budget.id}`);
          await rerender();
        } catch (error) {
          message(card, error.message, "error");
        }
      }
    : null;
  card.append(
    listed.data.length
      ? h("div", { class: "budgets" }, listed.data.map((b) => budgetBar(b, keyNames, remove)))
      : h("p", { class: "empty" }, "No budgets."),
  );
  if (editable) card.append(addForm(tenantId, keys.data, rerender));
  return card;
}

function addForm(tenantId, keys, rerender) {
  const form = h(
    "form",
    { class: "grid", "aria-label": "Add budget" },
    field("For", select("key_id", [["", "the whole tenant"], ...keys.map((k) => [k.id, `key ${k.name}`])])),
    field("Metric", select("metric", [["tokens", "tokens"], ["spend", "spend"]])),
    field("Period", select("period", PERIODS)),
    field("Amount", input("amount", { required: true, inputmode: "decimal" }), "tokens, or money in the prices' currency"),
    field("Alert at (%)", input("alert_percent", { type: "number", min: 1, max: 100 }), "empty: no alert"),
    h("button", { type: "submit" }, "Add budget"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form);
    const v = values(form);
    const body = { tenant_id: tenantId, metric: v.metric, period: v.period, amount: v.amount };
    if (v.key_id) body.key_id = v.key_id;
    if (v.alert_percent) body.alert_ratio = Number(v.alert_percent) / 100;
    try {
      await api("POST", "/admin/budgets", { body });
      await rerender();
    } catch (error) {
      showError(form, error);
    }
  });
  return form;
}

// Limits and prices: whole-tenant limits, a key's extra limits, and model prices.
import { api } from "../api.js";
import { budgetsCard } from "../budgets.js";
import {
  clearErrors, field, h, input, intOrNull, message, page, select, showError, table, tenantSelect, values,
} from "../ui.js";

let chosenTenant = "";

const TENANT_FIELDS = [
  ["rpm_limit", "Requests per minute"],
  ["tpm_limit", "Tokens per minute"],
  ["max_concurrency", "Max concurrency"],
  ["monthly_token_budget", "Monthly token budget"],
];

const number = (name, value, attrs = {}) => input(name, { type: "number", min: 0, value: value ?? "", ...attrs });

function modelLimitsField(current) {
  const text = Object.keys(current || {}).length ? JSON.stringify(current, null, 1) : "";
  return field(
    "Per-model limits (JSON)",
    h("textarea", { name: "model_limits", rows: 3, placeholder: '{"model-id": {"rpm_limit": 60, "tpm_limit": 10000}}' }, text),
    "rpm, tpm and concurrency per model; empty: none",
  );
}

function parseModelLimits(form, text) {
  if (!text) return {};
  try {
    return JSON.parse(text);
  } catch {
    throw Object.assign(new Error("Per-model limits must be a JSON object."), { param: "model_limits" });
  }
}

function saveOnSubmit(form, path, body) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form);
    try {
      await api("PUT", path, { body: body(values(form)) });
      message(form, "Saved.");
    } catch (error) {
      showError(form, error);
    }
  });
}

async function tenantLimitsForm(tenantId) {
  const current = await api("GET", `/admin/limits/tenants/${tenantId}`);
  const form = h(
    "form",
    { class: "card grid", "aria-label": "Tenant limits" },
    h("h2", {}, "Tenant limits"),
    h("p", {}, "Across all of the tenant's keys. Empty means unlimited."),
    TENANT_FIELDS.map(([name, label]) => field(label, number(name, current[name]))),
    field("Monthly spend budget", number("monthly_spend_budget", current.monthly_spend_budget, { step: "any" })),
    modelLimitsField(current.model_limits),
    h("button", { type: "submit" }, "Save tenant limits"),
  );
  saveOnSubmit(form, `/admin/limits/tenants/${tenantId}`, (v) => ({
    ...Object.fromEntries(TENANT_FIELDS.map(([name]) => [name, intOrNull(v[name])])),
    monthly_spend_budget: v.monthly_spend_budget ?? null,
    model_limits: parseModelLimits(form, v.model_limits),
  }));
  return form;
}

async function keyLimitsForm(get, tenantId) {
  const keys = (await get("/admin/keys", { tenant_id: tenantId, include_revoked: false, limit: 1000 })).data;
  const wrapper = h("div", { class: "card" }, h("h2", {}, "Key limits"));
  if (!keys.length) {
    wrapper.append(h("p", { class: "empty" }, "This tenant has no active keys."));
    return wrapper;
  }
  const keyPicker = select("key", keys.map((k) => [k.id, `${k.name} (${k.hint})`]));
  const slot = h("div");
  const load = async () => {
    const current = await api("GET", `/admin/limits/keys/${keyPicker.value}`);
    const form = h(
      "form",
      { class: "grid", "aria-label": "Key limits" },
      field("Monthly spend budget", number("monthly_spend_budget", current.monthly_spend_budget, { step: "any" })),
      field(
        "When Redis is down",
        select("failure_policy", [["", "gateway default"], ["open", "let requests in"], ["closed", "refuse requests"]]),
      ),
      modelLimitsField(current.model_limits),
      h("button", { type: "submit" }, "Save key limits"),
    );
    form.elements.failure_policy.value = current.failure_policy ?? "";
    saveOnSubmit(form, `/admin/limits/keys/${keyPicker.value}`, (v) => ({
      monthly_spend_budget: v.monthly_spend_budget ?? null,
      failure_policy: v.failure_policy ?? null,
      model_limits: parseModelLimits(form, v.model_limits),
    }));
    slot.replaceChildren(form);
  };
  keyPicker.addEventListener("change", load);
  await load();
  wrapper.append(
    h("p", {}, "Rate limits and the token budget of a key are edited on the Keys page."),
    field("Key", keyPicker),
    slot,
  );
  return wrapper;
}

async function pricesCard(get, rerender) {
  const prices = (await get("/admin/prices")).data;
  const form = h(
    "form",
    { class: "grid", "aria-label": "Add price" },
    field("Model", input("model", { required: true })),
    field("Prompt price per 1M tokens", input("prompt_per_mtok", { required: true, inputmode: "decimal" })),
    field("Cached prompt price per 1M tokens", input("cached_prompt_per_mtok", { inputmode: "decimal" }), "empty: the prompt price"),
    field("Completion price per 1M tokens", input("completion_per_mtok", { required: true, inputmode: "decimal" })),
    field("Effective from", input("effective_from", { type: "date" }), "empty: today"),
    h("button", { type: "submit" }, "Add price"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form);
    try {
      await api("POST", "/admin/prices", { body: values(form) });
      await rerender();
    } catch (error) {
      showError(form, error);
    }
  });
  const card = h("div", { class: "card" }, h("h2", {}, "Prices"));
  const remove = (price) => async () => {
    if (!confirm(`Delete the ${price.model} price from ${price.effective_from}?`)) return;
    try {
      await api("DELETE", `/admin/prices/${price.id}`);
      await rerender();
    } catch (error) {
      message(card, error.message, "error");
    }
  };
  card.append(
    table(
      "Prices per million tokens",
      [
        ["Model", (p) => p.model],
        ["From", (p) => p.effective_from],
        ["Prompt", (p) => p.prompt_per_mtok],
        ["Cached prompt", (p) => p.cached_prompt_per_mtok],
        ["Completion", (p) => p.completion_per_mtok],
        ["", (p) => h("button", { type: "button", class: "secondary", onclick: remove(p) }, "Delete")],
      ],
      prices,
      "No prices: usage costs nothing.",
    ),
    form,
  );
  return card;
}

export default async function limits({ get, rerender }) {
  const tenantPicker = await tenantSelect(get, { name: "tenant_id" });
  if (chosenTenant && [...tenantPicker.options].some((o) => o.value === chosenTenant)) tenantPicker.value = chosenTenant;
  chosenTenant = tenantPicker.value;
  tenantPicker.addEventListener("change", () => {
    chosenTenant = tenantPicker.value;
    rerender();
  });
  const section = page("Limits and prices", h("div", { class: "card inline" }, field("Tenant", tenantPicker)));
  if (chosenTenant) {
    section.append(
      await budgetsCard(get, chosenTenant, { editable: true, rerender }),
      await tenantLimitsForm(chosenTenant),
      await keyLimitsForm(get, chosenTenant),
    );
  }
  section.append(await pricesCard(get, rerender));
  return section;
}

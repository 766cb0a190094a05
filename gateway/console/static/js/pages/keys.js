// Keys: per tenant; create (the secret shown once), edit models and limits, rotate, revoke.
import { api } from "../api.js";
import {
  clearErrors, dateTime, field, h, input, intOrNull, message, page, select, showError, table, tenantSelect, values,
} from "../ui.js";

let chosenTenant = "";

const LIMIT_FIELDS = [
  ["rpm_limit", "Requests per minute"],
  ["tpm_limit", "Tokens per minute"],
  ["max_concurrency", "Max concurrency"],
  ["monthly_token_budget", "Monthly token budget"],
];

const limitInputs = (key = {}) =>
  LIMIT_FIELDS.map(([name, label]) =>
    field(label, input(name, { type: "number", min: 0, value: key[name] ?? "" }), "empty: no limit"),
  );

const modelsInput = (key = {}) =>
  field("Models", input("models", { value: (key.models || []).join(", "), placeholder: "all models" }),
    "comma-separated; empty: all");

function keyFields(form) {
  const v = values(form);
  const body = { models: (v.models || "").split(",").map((m) => m.trim()).filter(Boolean) };
  for (const [name] of LIMIT_FIELDS) body[name] = intOrNull(v[name]);
  return body;
}

/** A rotated key keeps working until its grace period ends: it shows as "expires <when>". */
function status(key) {
  if (key.revoked_at) return "revoked";
  if (key.expires_at) return new Date(key.expires_at) <= new Date() ? "expired" : `expires ${dateTime(key.expires_at)}`;
  return "active";
}

/** The one time a secret is shown: with a copy button. */
function secretPanel(title, created) {
  const code = h("code", { class: "secret", "aria-label": "New key" }, created.key);
  const copied = h("span", { role: "status" });
  return h(
    "div",
    { class: "card secret-panel", role: "region", "aria-label": title },
    h("h2", {}, title),
    h("p", {}, "Copy it now: it is shown only once and cannot be shown again."),
    code,
    h("button", {
      type: "button",
      onclick: async () => {
        try {
          await navigator.clipboard.writeText(created.key);
          copied.textContent = "Copied.";
        } catch {
          getSelection().selectAllChildren(code);
          copied.textContent = "Selected: press Ctrl+C to copy.";
        }
      },
    }, "Copy key"),
    copied,
  );
}

export default async function keys({ get, rerender }) {
  const tenantPicker = await tenantSelect(get, { name: "tenant_id" });
  if (chosenTenant && [...tenantPicker.options].some((o) => o.value === chosenTenant)) tenantPicker.value = chosenTenant;
  chosenTenant = tenantPicker.value;
  tenantPicker.addEventListener("change", () => {
    chosenTenant = tenantPicker.value;
    rerender();
  });
  const section = page("Keys", h("div", { class: "card inline" }, field("Tenant", tenantPicker)));
  if (!chosenTenant) {
    section.append(h("p", { class: "empty" }, "Create a tenant first."));
    return section;
  }
  const list = (await get("/admin/keys", { tenant_id: chosenTenant, limit: 1000 })).data;
  const panel = h("div", { class: "panel" });

  const create = h(
    "form",
    { class: "card grid", "aria-label": "Create key" },
    h("h2", {}, "New key"),
    field("Key name", input("name", { required: true, maxlength: 200 })),
    field("Kind", select("kind", [["inference", "inference"], ["admin", "admin (this tenant)"]])),
    modelsInput(),
    limitInputs(),
    h("button", { type: "submit" }, "Create key"),
  );
  create.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(create);
    const v = values(create);
    try {
      const created = await api("POST", "/admin/keys", {
        body: { tenant_id: chosenTenant, name: v.name, kind: v.kind, ...keyFields(create) },
      });
      await rerender();
      document.querySelector(".panel").replaceChildren(secretPanel(`Key “${created.name}” created`, created));
    } catch (error) {
      showError(create, error);
    }
  });

  const edit = (key) => {
    const form = h(
      "form",
      { class: "card grid", "aria-label": `Edit key ${key.name}` },
      h("h2", {}, `Edit “${key.name}”`),
      modelsInput(key),
      limitInputs(key),
      h("button", { type: "submit" }, "Save key"),
    );
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      clearErrors(form);
      try {
        await api("PATCH", `/admin/keys/${key.id}`, { body: keyFields(form) });
        await rerender();
      } catch (error) {
        showError(form, error);
      }
    });
    panel.replaceChildren(form);
    form.querySelector("input").focus();
  };

  const rotate = (key) => {
    const form = h(
      "form",
      { class: "card inline", "aria-label": `Rotate key ${key.name}` },
      h("h2", {}, `Rotate “${key.name}”`),
      field("Grace period (seconds)", input("grace_seconds", { type: "number", min: 0, value: 3600 }),
        "the old key keeps working this long"),
      h("button", { type: "submit" }, "Rotate key"),
    );
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      clearErrors(form);
      try {
        const created = await api("POST", `/admin/keys/${key.id}/rotate`, {
          body: { grace_seconds: intOrNull(form.elements.grace_seconds.value) ?? 0 },
        });
        await rerender();
        document.querySelector(".panel").replaceChildren(secretPanel(`Key “${key.name}” rotated`, created));
      } catch (error) {
        showError(form, error);
      }
    });
    panel.replaceChildren(form);
  };

  const revoke = async (key) => {
    if (!confirm(`Revoke key “${key.name}”? Requests with it are refused at once.`)) return;
    try {
      await api("POST", `/admin/keys/${key.id}/revoke`);
      await rerender();
    } catch (error) {
      message(section, error.message, "error");
    }
  };

  const button = (label, onclick) => h("button", { type: "button", class: "secondary", onclick }, label);
  const limitsText = (k) =>
    LIMIT_FIELDS.filter(([name]) => k[name] !== null).map(([name, label]) => `${label}: ${k[name]}`).join("; ") || "none";

  section.append(
    create,
    panel,
    table(
      "Keys of this tenant",
      [
        ["Name", (k) => k.name],
        ["Key", (k) => h("code", {}, k.hint)],
        ["Kind", (k) => k.kind],
        ["Models", (k) => (k.models.length ? k.models.join(", ") : "all")],
        ["Limits", limitsText],
        ["Status", (k) => h("span", { class: `badge ${status(k).split(" ")[0]}` }, status(k))],
        ["Last used", (k) => dateTime(k.last_used_at)],
        [
          "Actions",
          (k) =>
            k.revoked_at
              ? ""
              : h("span", { class: "actions", role: "group", "aria-label": `Actions for ${k.name}` },
                button("Edit", () => edit(k)),
                button("Rotate", () => rotate(k)),
                button("Revoke", () => revoke(k))),
        ],
      ],
      list,
      "No keys yet.",
    ),
  );
  return section;
}

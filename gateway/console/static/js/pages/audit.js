// Audit log: who changed what, with the object before and after (GET /admin/audit).
import { dateTime, field, h, input, message, page, table, values } from "../ui.js";

/** The fields that differ between before and after, as "field: old → new" lines. */
function changes(entry) {
  const before = entry.before || {};
  const after = entry.after || {};
  const names = [...new Set([...Object.keys(before), ...Object.keys(after)])];
  const show = (v) => (v === undefined ? "—" : JSON.stringify(v));
  const changed = names.filter((n) => JSON.stringify(before[n]) !== JSON.stringify(after[n]));
  if (!entry.before || !entry.after) {
    return h("details", {}, h("summary", {}, entry.before ? "removed" : "created"),
      h("pre", {}, JSON.stringify(entry.after || entry.before, null, 2)));
  }
  return h("ul", { class: "changes" }, changed.map((n) => h("li", {}, h("code", {}, n), `: ${show(before[n])} → ${show(after[n])}`)));
}

export default async function audit({ get }) {
  const form = h(
    "form",
    { class: "card inline", "aria-label": "Audit filters" },
    field("Action", input("action", { placeholder: "e.g. key.revoke" })),
    field("Object type", input("object_type", { placeholder: "e.g. tenant" })),
    field("Object ID", input("object_id")),
    h("button", { type: "submit" }, "Filter"),
  );
  const out = h("div", { "aria-live": "polite" });
  const tenantNames = new Map((await get("/admin/tenants", { limit: 1000 })).data.map((t) => [t.id, t.name]));
  const show = async () => {
    try {
      const entries = (await get("/admin/audit", { ...values(form), limit: 200 })).data;
      out.replaceChildren(
        table(
          "Audit log, newest first",
          [
            ["When", (e) => dateTime(e.at)],
            ["Actor key", (e) => (e.actor_key_id ? h("code", {}, e.actor_key_id) : "system")],
            ["Tenant", (e) => (e.tenant_id ? tenantNames.get(e.tenant_id) ?? h("code", {}, e.tenant_id) : "platform")],
            ["Action", (e) => e.action],
            ["Object", (e) => `${e.object_type} ${e.object_id}`],
            ["Change", changes],
          ],
          entries,
          "No audit entries match.",
        ),
      );
    } catch (error) {
      message(out, error.message, "error");
    }
  };
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    show();
  });
  await show();
  return page("Audit log", form, out);
}

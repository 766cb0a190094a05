// Tenants: list, create, suspend/resume, delete.
import { api } from "../api.js";
import { clearErrors, dateTime, field, h, input, message, page, showError, table } from "../ui.js";

export default async function tenants({ get, rerender }) {
  const list = (await get("/admin/tenants", { limit: 1000 })).data;

  const form = h(
    "form",
    { class: "card inline", "aria-label": "Create tenant" },
    field("Tenant name", input("name", { required: true, maxlength: 200 })),
    h("button", { type: "submit" }, "Create tenant"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form);
    try {
      await api("POST", "/admin/tenants", { body: { name: form.elements.name.value } });
      await rerender();
    } catch (error) {
      showError(form, error);
    }
  });

  const section = page("Tenants", form);
  const act = (label, run) =>
    h("button", {
      type: "button",
      class: "secondary",
      onclick: async () => {
        try {
          if (await run()) await rerender();
        } catch (error) {
          message(section, error.message, "error");
        }
      },
    }, label);

  const setStatus = (tenant, status) => async () => {
    await api("PATCH", `/admin/tenants/${tenant.id}`, { body: { status } });
    return true;
  };
  const remove = (tenant) => async () => {
    if (!confirm(`Delete tenant “${tenant.name}”? Its keys stop working at once.`)) return false;
    await api("DELETE", `/admin/tenants/${tenant.id}`);
    return true;
  };

  section.append(
    table(
      "Tenants",
      [
        ["Name", (t) => t.name],
        ["ID", (t) => h("code", {}, t.id)],
        ["Status", (t) => h("span", { class: `badge ${t.status}` }, t.status)],
        ["Created", (t) => dateTime(t.created_at)],
        [
          "Actions",
          (t) =>
            h(
              "span",
              { class: "actions", "aria-label": `Actions for ${t.name}`, role: "group" },
              t.status === "active"
                ? act(`Suspend`, setStatus(t, "suspended"))
                : act(`Resume`, setStatus(t, "active")),
              act("Delete", remove(t)),
            ),
        ],
      ],
      list,
      "No tenants yet: create the first one above.",
    ),
  );
  return section;
}

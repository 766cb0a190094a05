// Small DOM helpers: elements are built with textContent, never from HTML strings.

/** h("tag", {attr: value, onclick: fn}, ...children) */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "class") el.className = value;
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, value);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
}

let fieldCounter = 0;

/** A labelled input with a place for the API's error about it (matched by ``name``). */
export function field(label, input, hint) {
  const id = input.id || `f${++fieldCounter}`;
  input.id = id;
  const error = h("span", { class: "field-error", "data-error-for": input.name, id: `${id}-error` });
  input.setAttribute("aria-describedby", error.id);
  return h("div", { class: "field" }, h("label", { for: id }, label), input, hint ? h("small", {}, hint) : null, error);
}

export const input = (name, attrs = {}) => h("input", { name, ...attrs });

export function select(name, options, attrs = {}) {
  return h(
    "select",
    { name, ...attrs },
    options.map(([value, text]) => h("option", { value }, text)),
  );
}

/** Show an API error next to its field when the form has one, else in the form's message line. */
export function showError(form, error) {
  clearErrors(form);
  const param = (error.param || "").split(".")[0];
  const slot = param && form.querySelector(`[data-error-for="${CSS.escape(param)}"]`);
  if (slot) {
    slot.textContent = error.message;
    const control = form.querySelector(`[name="${CSS.escape(param)}"]`);
    if (control) control.setAttribute("aria-invalid", "true");
  } else {
    message(form, error.message, "error");
  }
}

export function clearErrors(form) {
  for (const slot of form.querySelectorAll(".field-error")) slot.textContent = "";
  for (const control of form.querySelectorAll("[aria-invalid]")) control.removeAttribute("aria-invalid");
  message(form, "");
}

/** The form's (or page's) one-line status: role=alert for errors, role=status otherwise. */
export function message(container, text, kind = "info") {
  let line = container.querySelector(":scope > .message");
  if (!line) {
    line = h("p", { class: "message" });
    container.append(line);
  }
  line.textContent = text;
  line.setAttribute("role", kind === "error" ? "alert" : "status");
  line.dataset.kind = kind;
}

/** A table with a caption; ``columns`` are [header, row => cell content]. */
export function table(caption, columns, rows, empty = "Nothing yet.") {
  if (!rows.length) return h("p", { class: "empty" }, empty);
  return h(
    "table",
    {},
    h("caption", {}, caption),
    h("thead", {}, h("tr", {}, columns.map(([title]) => h("th", { scope: "col" }, title)))),
    h(
      "tbody",
      {},
      rows.map((row) => h("tr", {}, columns.map(([, cell]) => h("td", {}, cell(row))))),
    ),
  );
}

/** Form values as an object; empty inputs are left out. */
export function values(form) {
  const out = {};
  for (const [name, value] of new FormData(form).entries()) {
    if (value !== "") out[name] = value;
  }
  return out;
}

export const intOrNull = (value) => (value === undefined || value === "" ? null : Number(value));

export const dateTime = (iso) => (iso ? new Date(iso).toISOString().replace("T", " ").slice(0, 19) : "");

export const percent = (fraction) => (fraction === null || fraction === undefined ? "n/a" : `${(100 * fraction).toFixed(1)}%`);

export function page(title, ...children) {
  return h("section", { "aria-labelledby": "page-title" }, h("h1", { id: "page-title" }, title), ...children);
}

/** A select of the tenants this key can see (a tenant-scoped key sees only its own). */
export async function tenantSelect(get, { name = "tenant", allLabel } = {}) {
  const tenants = (await get("/admin/tenants", { limit: 1000 })).data;
  const options = tenants.map((t) => [t.id, `${t.name}${t.status === "active" ? "" : ` (${t.status})`}`]);
  if (allLabel) options.unshift(["", allLabel]);
  return select(name, options);
}

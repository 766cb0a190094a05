// The console's shell: sign in, navigation by URL hash, sign out.
import { ApiError, get, session } from "./api.js";
import { field, h, input, message, page } from "./ui.js";
import audit from "./pages/audit.js";
import engines from "./pages/engines.js";
import keys from "./pages/keys.js";
import limits from "./pages/limits.js";
import playground from "./pages/playground.js";
import tenants from "./pages/tenants.js";
import usage from "./pages/usage.js";

const PAGES = { tenants, keys, limits, usage, engines, audit, playground };
const main = document.getElementById("main");
const nav = document.getElementById("nav");
const signOutButton = document.getElementById("sign-out");

function signInPage() {
  const form = h(
    "form",
    { class: "card narrow", "aria-label": "Sign in" },
    field("Admin key", input("admin_key", { type: "password", autocomplete: "off", required: true })),
    h("button", { type: "submit" }, "Sign in"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = form.elements.admin_key.value.trim();
    try {
      // Any admin key, platform or tenant-scoped, may list the tenants it can see.
      const response = await fetch("/admin/tenants?limit=1", { headers: { Authorization: `Bearer ${key}` } });
      if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
      session.signIn(key);
      render(); // the page the URL names (a deep link survives signing in), else Tenants
    } catch (error) {
      message(form, error.message, "error");
    }
  });
  return page("Sign in to Tern", h("p", {}, "Use a platform or tenant admin key."), form);
}

async function render() {
  const signedIn = Boolean(session.adminKey);
  nav.hidden = !signedIn;
  signOutButton.hidden = !signedIn;
  if (!signedIn) {
    main.replaceChildren(signInPage());
    document.title = "Sign in · Tern console";
    return;
  }
  const name = location.hash.replace(/^#\/?/, "").split("?")[0] || "tenants";
  const show = PAGES[name] || tenants;
  for (const link of nav.querySelectorAll("a")) {
    if (link.getAttribute("href") === `#/${name}`) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const title = name.charAt(0).toUpperCase() + name.slice(1);
  document.title = `${title} · Tern console`;
  main.replaceChildren(h("p", { role: "status" }, "Loading…"));
  try {
    main.replaceChildren(await show({ get, rerender: render }));
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      session.signOut();
      return render();
    }
    main.replaceChildren(page(title, h("p", { role: "alert", class: "message", "data-kind": "error" }, error.message)));
  }
}

// Sign out forgets the keys and reloads, so nothing of the session (a chat, a shown key) stays in memory.
signOutButton.addEventListener("click", () => {
  session.signOut();
  location.replace("/ui/");
});
window.addEventListener("hashchange", render);
render();

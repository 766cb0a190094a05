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

let latestRender = 0; // a slower, older render must not replace a newer page

async function render() {
  const call = ++latestRender;
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
  // Name the page shown in the URL (no hashchange), so its own nav link does not render it again.
  if (!location.hash.replace(/^#\/?/, "")) history.replaceState(null, "", `#/${name}`);
  for (const link of nav.querySelectorAll("a")) {
    if (link.getAttribute("href") === `#/${name}`) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const title = name.charAt(0).toUpperCase() + name.slice(1);
  document.title = `${title} · Tern console`;
  main.replaceChildren(h("p", { role: "status" }, "Loading…"));
  try {
    const shown = await show({ get, rerender: render });
    if (call === latestRender) main.replaceChildren(shown);
  } catch (error) {
    if (call !== latestRender) return;
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

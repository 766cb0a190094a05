// Calls to the gateway's public admin and /v1 APIs with the signed-in admin key.
// The key lives in sessionStorage: this tab's session only, never a cookie or a URL.

const ADMIN_KEY = "tern.adminKey";

export const session = {
  get adminKey() {
    return sessionStorage.getItem(ADMIN_KEY);
  },
  signIn(key) {
    sessionStorage.setItem(ADMIN_KEY, key);
  },
  signOut() {
    sessionStorage.clear();
  },
};

/** An API error: the OpenAI-shaped body's message, plus the offending parameter when there is one. */
export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.param = error.param || null;
    this.code = error.code || null;
  }
}

export function withQuery(path, query = {}) {
  const params = new URLSearchParams();
  for (const [name, value] of Object.entries(query)) {
    if (value !== undefined && value !== null && value !== "") params.append(name, value);
  }
  const qs = params.toString();
  return qs ? `${path}?${qs}` : path;
}

/** fetch with the bearer key; throws ApiError on a non-2xx answer. */
export async function request(method, path, { body, query, key, signal } = {}) {
  const headers = { Authorization: `Bearer ${key ?? session.adminKey}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(withQuery(path, query), {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
    cache: "no-store",
  });
  if (!response.ok) {
    let payload = null;
    try {
      payload = await response.json();
    } catch {
      // not JSON: the status says enough
    }
    throw new ApiError(response.status, payload);
  }
  return response;
}

/** The JSON answer of a call (null for 204). */
export async function api(method, path, options = {}) {
  const response = await request(method, path, options);
  return response.status === 204 ? null : response.json();
}

export const get = (path, query) => api("GET", path, { query });

// Playground: a multi-turn chat that streams from POST /v1/chat/completions with an inference key,
// showing time to first token, tokens per second and each answer's usage.
import { api, request } from "../api.js";
import { field, h, input, message, page, select, tenantSelect } from "../ui.js";

const INFERENCE_KEY = "tern.inferenceKey";
let history = []; // [{role, content}] of the current conversation (kept across page switches)

/** The JSON payloads of a server-sent-event stream, as they arrive. */
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function bubble(role, text = "") {
  return h("div", { class: `bubble ${role}` }, h("strong", {}, role === "user" ? "You" : "Assistant"), h("p", {}, text));
}

function statsLine({ ttftMs, tokensPerS, usage }) {
  const cached = usage?.prompt_tokens_details?.cached_tokens ?? 0;
  const parts = [
    `TTFT ${ttftMs === null ? "n/a" : `${ttftMs.toFixed(0)} ms`}`,
    `${tokensPerS === null ? "n/a" : tokensPerS.toFixed(1)} tokens/s`,
  ];
  if (usage) parts.push(`usage: ${usage.prompt_tokens} prompt (${cached} cached) + ${usage.completion_tokens} completion tokens`);
  return h("p", { class: "stats" }, parts.join(" · "));
}

export default async function playground({ get }) {
  const keyInput = input("inference_key", {
    type: "password", autocomplete: "off", value: sessionStorage.getItem(INFERENCE_KEY) || "",
  });
  const modelPicker = select("model", []);
  const settings = h(
    "form",
    { class: "card grid", "aria-label": "Playground settings" },
    field("Inference key", keyInput),
    field("Model", modelPicker),
    field("System prompt", h("textarea", { name: "system", rows: 2 })),
    field("Temperature", input("temperature", { type: "number", min: 0, max: 2, step: 0.1, value: 0.7 })),
    field("Max tokens", input("max_tokens", { type: "number", min: 1, value: 128 })),
    field("Top-p", input("top_p", { type: "number", min: 0, max: 1, step: 0.05, value: 1 })),
  );

  const loadModels = async () => {
    const key = keyInput.value.trim();
    sessionStorage.setItem(INFERENCE_KEY, key);
    if (!key) return;
    try {
      const models = await api("GET", "/v1/models", { key });
      modelPicker.replaceChildren(...models.data.map((m) => h("option", { value: m.id }, m.id)));
      message(settings, `${models.data.length} model(s) available.`);
    } catch (error) {
      message(settings, error.message, "error");
    }
  };
  keyInput.addEventListener("change", loadModels);

  // Create an inference key from the console, for a tenant this admin key can manage.
  const creator = h("form", { class: "card inline", "aria-label": "Create a playground key" });
  const tenantPicker = await tenantSelect(get, { name: "tenant_id" });
  creator.append(
    field("Tenant", tenantPicker),
    h("button", { type: "submit", class: "secondary" }, "Create inference key"),
  );
  creator.addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      const created = await api("POST", "/admin/keys", {
        body: { tenant_id: tenantPicker.value, name: "playground", kind: "inference" },
      });
      keyInput.value = created.key;
      message(creator, `Created key ${created.hint} for this tenant; it is in the Inference key field.`);
      await loadModels();
    } catch (error) {
      message(creator, error.message, "error");
    }
  });

  const transcript = h("div", { class: "transcript", role: "log", "aria-label": "Conversation" });
  for (const turn of history) transcript.append(bubble(turn.role, turn.content));
  const composer = h(
    "form",
    { class: "card composer", "aria-label": "Chat" },
    field("Message", h("textarea", { name: "message", rows: 3, required: true })),
    h("div", { class: "actions" },
      h("button", { type: "submit" }, "Send"),
      h("button", { type: "button", class: "secondary", onclick: () => { history = []; transcript.replaceChildren(); } }, "New chat")),
  );

  composer.addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = composer.elements.message.value.trim();
    const key = keyInput.value.trim();
    if (!text) return;
    if (!key) {
      message(composer, "Paste or create an inference key first.", "error");
      return;
    }
    const s = new FormData(settings);
    const messages = [...(s.get("system") ? [{ role: "system", content: s.get("system") }] : []), ...history, { role: "user", content: text }];
    const sendButton = composer.querySelector("button[type=submit]");
    sendButton.disabled = true;
    message(composer, "Generating…");
    const userBubble = bubble("user", text);
    const answer = bubble("assistant");
    transcript.append(userBubble, answer);
    const started = performance.now();
    let first = null;
    let usage = null;
    let content = "";
    try {
      const response = await request("POST", "/v1/chat/completions", {
        key,
        body: {
          model: s.get("model"),
          messages,
          temperature: Number(s.get("temperature")),
          max_tokens: Number(s.get("max_tokens")),
          top_p: Number(s.get("top_p")),
          stream: true,
          stream_options: { include_usage: true },
        },
      });
      for await (const chunk of events(response)) {
        const delta = chunk.choices?.[0]?.delta?.content;
        if (delta) {
          first ??= performance.now();
          content += delta;
          answer.querySelector("p").textContent = content;
        }
        if (chunk.usage) usage = chunk.usage;
      }
      // Decode speed: the tokens after the first, over the time after the first.
      const elapsed = (performance.now() - (first ?? started)) / 1000;
      const generated = usage?.completion_tokens ?? 0;
      answer.append(statsLine({
        ttftMs: first === null ? null : first - started,
        tokensPerS: generated > 1 && elapsed > 0 ? (generated - 1) / elapsed : null,
        usage,
      }));
      history.push({ role: "user", content: text }, { role: "assistant", content });
      composer.elements.message.value = "";
      message(composer, "Done.");
    } catch (error) {
      userBubble.remove();
      answer.remove();
      message(composer, error.message, "error");
    } finally {
      sendButton.disabled = false;
    }
  });

  if (keyInput.value) await loadModels();
  return page("Playground", creator, settings, transcript, composer);
}

// Interactive API docs for the gateway's /openapi.json (Swagger UI, vendored: see docs/gateway.md).
// "Authorize" takes a Tern key; requests go to this gateway.
window.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis],
  });
});

"""API keys: format, HMAC storage, authentication with a short revocation-safe cache."""

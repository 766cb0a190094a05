"""The contract between gateway and engine: the internal RPC and the OpenAI surface.

Imported by both ``engine`` and ``gateway``, which never import each other. Free of torch and of
any web framework (pydantic and orjson only), so the gateway stays light; tests/test_import_contract.py
holds it to that.
"""

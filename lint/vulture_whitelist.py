"""What only a framework reads: vulture counts every name here as used (`make lint`, [tool.vulture]).

Reviewed one by one; each line says who reads the name. Decorated framework entry points (routes,
validators, fixtures, state-machine rules) and fixed framework names (``pytestmark``, ``extra_repr``,
alembic's revision fields) are excluded in pyproject.toml instead, so they need no entry here. Never
read or imported: ruff and mypy skip this file.
"""

# ruff: noqa
# mypy: ignore-errors
_ = object()

# Called by name through a string -------------------------------------------------------------------
_._render  # engine/chat_template.py: jinja's Extension.call_method("_render")
run_watchdog  # tern_stack/processes.py: the watchdog child runs "from ... import run_watchdog"
teardown  # tests/engine/test_radix_cache.py: hypothesis' RuleBasedStateMachine calls it after a run
test_radix_cache_state_machine  # the state machine's TestCase, collected by pytest by its name

# Columns and fields a library reads or writes: SQLAlchemy (INSERT/SELECT), pydantic (the JSON) -----
UsageDaily  # gateway/usage/models.py: the usage_daily table in Base.metadata, written by raw SQL
hint  # gateway/keys: the key's visible prefix, a column and an API field
rotated_from  # gateway/keys: a column and an API field
updated_at  # gateway/limits: a column, set on update
_.updated_at
ttft_ms  # gateway/usage: a column and an API field
duration_ms
recorded_at
kv_blocks_total  # gateway/engines/schemas.py: API fields
prefix_cache_hit_rate
price_effective_from  # gateway/reports/schemas.py: an API field
owned_by  # protocol/rpc.py: an OpenAI /v1/models field
refusal  # protocol/openai: request fields OpenAI's SDK sends back, accepted and ignored
verbosity
generate_summary
previous_response_id
time_us  # bench/engine/kernels.py: Result fields, printed as JSON
bytes_moved
pct_peak_bandwidth
baseline_time_us
speedup
AGREEMENT_MEASURED  # tests/engine/test_families_fast_path.py: the measured figures the docstring cites

# JSON-schema properties in structured-output tests (pydantic models whose schema is the point) -----
city
country
home
quantity
positive
sentiment
stars
confidence
email
phone
population

# Attributes set on a library's objects, which the library reads ------------------------------------
_.pre_tokenizer  # tokenizers.Tokenizer
_.post_processor
_.normalizer  # tokenizers.Tokenizer
_.set_vocab  # llama.cpp's HF converter calls it (bench/engine/convert_bitnet_hf.py patches it)
_.padding_side  # transformers tokenizer
_.pad_token
_.quantization_config  # transformers config
_.logMultiprocessing  # logging: gateway/logging.py turns off per-record lookups
_.logProcesses
_.logThreads
_._srcfile
_.background  # starlette Response (gateway/proxy/relay.py)
_.prec  # decimal context (gateway/reports/pricing.py)
_.should_exit  # uvicorn Server (tests/gateway/live_server.py)
_.color_message  # uvicorn's log record extra (tests/gateway/test_ops.py)

# Parameters a signature must have ------------------------------------------------------------------
is_pretokenized  # gateway/proxy/token_count.py: tokenizers' encode() signature, as a Protocol
eager_transformers  # a fixture requested by tests and fixtures for its side effect
pods  # tests/gateway/test_engine_discovery.py: a fixture requested for its side effect

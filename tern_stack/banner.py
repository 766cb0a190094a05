"""The text ``tern up`` prints once the stack is ready: where everything is and how to call the API."""

from __future__ import annotations

from tern_stack.state import StateDir


def banner(*, url: str, admin_key: str, demo_key: str, model: str, state: StateDir) -> str:
    return f"""
Tern is ready at {url}   (logs: {state.logs}/, data: {state.root}/; Ctrl-C stops everything)

  web console:       {url}/ui/   (sign in with the admin key)
  admin key:         {admin_key}
  demo tenant's key: {demo_key}
  model:             {model}

curl:
  curl {url}/v1/chat/completions \\
    -H "Authorization: Bearer {demo_key}" \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "max_tokens": 64, "temperature": 0,
         "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

Python (pip install openai):
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="{demo_key}")
  reply = client.chat.completions.create(
      model="{model}",
      messages=[{{"role": "user", "content": "What is the capital of France?"}}],
      max_tokens=64,
      temperature=0,
  )
  print(reply.choices[0].message.content)
"""
